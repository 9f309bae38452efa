"""The weight publisher against the messages it replaces, side by side, one run on openreg:

  (a) queue        a tiny non-tensor object, ping-pong through a spawn Queue pair: the floor of
                   one message per generation
  (b) generation   publish(wait=True) of packed weights (copy=False) to 2 subscribers that take
                   the zero-copy views (tensors()) and ack: 1,000 and 10,000 tensors
  (c) copy_into    240 MiB of packed weights, each of 2 engines copy_into its own tensors (both at
                   once, as engines do; then one alone), against a 1-thread host memcpy of the
                   same bytes
  (d) 1,000        share_tensors (copy=True, 7 MiB) opened by a consumer, against 1,000 per-tensor
                   devipc handles through a Queue (put, get: opened); new tensors each time
  (e) nixl         WeightPublisher(transport="nixl"), 64 MiB packed weights: a subscriber in its
                   own process (and PID namespace, where `unshare` works) pulls each generation
                   (wait: generation word, one read of the whole range, generation word again),
                   against a plain NIXL read of the same 64 MiB between the same two processes;
                   UCX over TCP loopback, as between two hosts

Subscribers and engines live on openreg:1, the publisher on openreg:0, as in an RL loop.
(a) and (b) alternate over 10 rounds (the machine's speed drifts from second to second); each
median is over all of a kind's samples.
Usage: python benchmarks/weight_publisher.py [--generations N] [--only-nixl]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing as mp

import devipc
import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)
from devipc._tools._bench.common import markdown, memcpy_seconds
from devipc._tools._bench.weight_sync import settle, transformer_shapes

TIMEOUT = 120
ROUNDS = 10  # (a) and (b) alternate, each round with new publishers
ENGINE = "openreg:1"


def note(text):
    print(text, file=sys.stderr, flush=True)


def receive(conn):
    if not conn.poll(TIMEOUT):
        raise TimeoutError(f"no reply within {TIMEOUT} s")
    return conn.recv()


def subscriber(conn):
    """Subscribes to each token it gets, (token, "views" | "copy"), until the publisher closes;
    replies with its copy_into+ack times and, for "copy", per-tensor sums of its own tensors."""
    while (job := receive(conn)) is not None:
        token, mode = job
        times, own = [], None
        with devipc.WeightSubscriber(token, device=ENGINE) as sub:
            conn.send("ready")
            while True:
                try:
                    sub.wait(timeout=TIMEOUT)
                except devipc.PeerGoneError:
                    break
                if mode == "views":
                    sub.tensors()
                    sub.ack()
                    continue
                if own is None:
                    own = {n: torch.zeros_like(t) for n, t in sub.tensors().items()}
                start = time.perf_counter()
                sub.copy_into(own)
                sub.ack()  # waits for the device's copy
                times.append(time.perf_counter() - start)
        sums = None if own is None else [t.double().sum().item() for t in own.values()]
        del own
        conn.send((times, sums))


def queue_consumer(inbox, outbox, done):
    """(a): echoes pings on `outbox`. (d): opens what comes, says "done" on the `done` pipe (its
    own thread writes it: no feeder-thread delay), drops it and runs its releases."""
    while (message := inbox.get(timeout=TIMEOUT)) is not None:
        kind, payload = message
        if kind == "ping":
            outbox.put(payload)
            continue
        if kind == "bucket":
            held = list(devipc.open_tensors(payload).values())
        else:
            held = [inbox.get(timeout=TIMEOUT) for _ in range(payload)]
        torch.accelerator.synchronize()
        done.send(len(held))
        del held
        settle()
        done.send("settled")


def queue_round_trip(inbox, outbox, rounds):
    """(a): seconds of a tiny object there and back, `rounds` times after 20 untimed."""
    times = []
    for i in range(rounds + 20):
        start = time.perf_counter()
        inbox.put(("ping", i))
        assert outbox.get(timeout=TIMEOUT) == i
        times.append(time.perf_counter() - start)
    return times[20:]


def packed_tensors(count, numel):
    """`count` float32 tensors of `numel` elements, packed into one allocation."""
    return devipc.pack({f"t{i}": torch.randn(numel, device="openreg:0") for i in range(count)})


def generations(weights, subs, mode, count):
    """(b), (c): publish `count` generations to the subscribers; the publisher's seconds per
    generation and what each subscriber replied."""
    times = []
    with devipc.WeightPublisher(weights) as publisher:
        for conn in subs:
            conn.send((publisher.token(), mode))
        for conn in subs:
            assert receive(conn) == "ready"
        for _ in range(count):
            start = time.perf_counter()
            publisher.publish(timeout=TIMEOUT)
            times.append(time.perf_counter() - start)
    return times, [receive(conn) for conn in subs]


def many_tensors(inbox, done, tensors, how):
    """(d): seconds from the producer's first call until the consumer holds them all."""
    devipc.ipc_collect()
    start = time.perf_counter()
    if how == "bucket":
        inbox.put(("bucket", bytes(devipc.share_tensors(tensors))))
    else:
        inbox.put(("per-tensor", len(tensors)))
        for tensor in tensors.values():
            inbox.put(tensor)
    assert receive(done) == len(tensors)
    seconds = time.perf_counter() - start
    assert receive(done) == "settled"
    return seconds


NIXL_BYTES = 64 << 20
NIXL_ROUNDS = 20  # (e): generations, each followed by a plain read; the first 2 untimed
LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def nixl_subscriber(commands, replies):
    """(e), the subscriber's process: after each publish, times its pull (`wait`) and then a
    plain NIXL read of the same bytes into its own registered memory."""
    import devipc.p2p as p2p

    token, metadata, descriptor = commands.recv()
    pulls, reads = [], []
    with (
        devipc.WeightSubscriber(token, device=ENGINE) as sub,
        p2p.Endpoint(transport="nixl") as endpoint,
    ):
        connection = endpoint.connect(metadata)
        local, local_id = p2p.create_tensor((NIXL_BYTES,), torch.uint8, ENGINE)
        replies.send("ready")
        while commands.recv() is not None:
            start = time.perf_counter()
            sub.wait(timeout=TIMEOUT)
            pulls.append(time.perf_counter() - start)
            sub.ack()
            start = time.perf_counter()
            connection.read(local, descriptor)
            reads.append(time.perf_counter() - start)
            replies.send("done")
        sums = [t.double().sum().item() for t in sub.tensors().values()]
        p2p.deregister(local_id)
    replies.send((pulls, reads, sums))


def nixl_row():
    """(e): (rows, ratio of the pull's bandwidth to the plain read's), or (rows, None) without
    NIXL."""
    import devipc.p2p as p2p

    try:
        from devipc.p2p._nixl import load_nixl

        load_nixl()
    except ImportError as error:
        return [["(e) nixl: skipped", str(error), "", ""]], None
    os.environ.update(LOOPBACK)
    unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if (
        shutil.which("unshare") is None
        or subprocess.run([*unshare, "true"], capture_output=True).returncode != 0
    ):
        unshare = []  # the subscriber is then only another process
    ours_in, theirs_out = os.pipe()
    theirs_in, ours_out = os.pipe()
    proc = subprocess.Popen(
        [
            *unshare,
            sys.executable,
            os.path.abspath(__file__),
            "--nixl-subscriber",
            str(theirs_in),
            str(theirs_out),
        ],
        pass_fds=(theirs_in, theirs_out),
    )
    os.close(theirs_in)
    os.close(theirs_out)
    commands, replies = Connection(ours_out), Connection(ours_in)
    try:
        weights = packed_tensors(64, NIXL_BYTES // 64 // 4)
        storage = next(iter(weights.values())).untyped_storage()
        with (
            devipc.WeightPublisher(weights, transport="nixl") as publisher,
            p2p.Endpoint(transport="nixl") as endpoint,
        ):
            plain = endpoint.advertise(p2p.get_tensor_id_by_tensor(storage))
            commands.send((publisher.token(), endpoint.metadata(), plain))
            assert receive(replies) == "ready"
            for _ in range(NIXL_ROUNDS):
                generation = publisher.publish(wait=False)
                commands.send("pull")
                assert receive(replies) == "done"
                publisher.wait_acks(generation, timeout=TIMEOUT)
            commands.send(None)
            pulls, reads, sums = receive(replies)
        assert sums == [t.double().sum().item() for t in weights.values()], "the pull differs"
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        commands.close()
        replies.close()
    pull = NIXL_BYTES / statistics.median(pulls[2:]) / 1e9
    read = NIXL_BYTES / statistics.median(reads[2:]) / 1e9
    where = "own PID namespace" if unshare else "another process"
    return [
        [
            f"(e) nixl: subscriber pull of 64 MiB ({where})",
            f"{pull:.2f} GB/s",
            f"NIXL read {read:.2f} GB/s",
            f"{pull / read:.2f}x of NIXL read",
        ]
    ], pull / read


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--generations",
        type=int,
        default=30,
        help="(a), (b): timed round trips and generations per round",
    )
    parser.add_argument("--only-nixl", action="store_true", help="run (e) alone")
    parser.add_argument("--nixl-subscriber", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.nixl_subscriber:
        nixl_subscriber(*(Connection(fd) for fd in args.nixl_subscriber))
        return
    if args.only_nixl:
        rows, ratio = nixl_row()
        print(markdown(["what", "median", "against", "ratio"], rows))
        if ratio is not None:
            print(f"\n(e) >= 0.80x NIXL read: {ratio:.2f}x")
        return
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    done, theirs = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=queue_consumer, args=(inbox, outbox, theirs), daemon=True)]
    subs = []
    for _ in range(2):
        ours, end = ctx.Pipe()
        procs.append(ctx.Process(target=subscriber, args=(end,), daemon=True))
        subs.append(ours)
    rows = []
    try:
        for proc in procs:
            proc.start()
        weights = {count: packed_tensors(count, 64) for count in (1000, 10000)}
        pings, gens, first = [], {count: [] for count in weights}, {}
        for round_ in range(ROUNDS):  # interleaved: a slow spell of the machine hits all three
            note(f"(a), (b) round {round_ + 1}/{ROUNDS}")
            pings += queue_round_trip(inbox, outbox, args.generations)
            for count, packed in weights.items():
                times, _ = generations(packed, subs, "views", args.generations + 5)
                first.setdefault(count, times[0])
                gens[count] += times[5:]
        del weights
        queue = statistics.median(pings)
        rows.append(["(a) tiny object, Queue ping-pong", f"{queue * 1e6:.0f} µs", "", "1.00x"])
        per_generation = {count: statistics.median(times) for count, times in gens.items()}
        for count, seconds in per_generation.items():
            rows.append(
                [
                    f"(b) publish, {count:,} tensors, 2 subscribers (views, ack)",
                    f"{seconds * 1e6:.0f} µs",
                    f"first {first[count] * 1e3:.1f} ms",
                    f"{seconds / queue:.2f}x of (a)",
                ]
            )

        note("(c) 240 MiB: 2 engines copy_into, then 1 alone")
        cpu = {
            n: torch.randn(s, generator=torch.Generator().manual_seed(0))
            for n, s in transformer_shapes(256 << 20)
        }
        weights = devipc.pack({n: t.to("openreg:0") for n, t in cpu.items()})
        nbytes = sum(t.nbytes for t in weights.values())
        del cpu
        expected = [t.double().sum().item() for t in weights.values()]
        both, replies = generations(weights, subs, "copy", 6)
        _, alone = generations(weights, subs[:1], "copy", 6)
        assert all(sums == expected for _, sums in replies + alone), "an engine's copy differs"
        del weights
        memcpy = nbytes / memcpy_seconds(nbytes) / 1e9
        mib = f"{nbytes / 2**20:.0f} MiB"
        per_engine = []
        for what, (times, _) in [
            *((f"engine {i}, both at once", r) for i, r in enumerate(replies)),
            ("1 engine alone", alone[0]),
        ]:
            rate = nbytes / statistics.median(times[1:]) / 1e9
            per_engine.append(rate / memcpy)
            rows.append(
                [
                    f"(c) copy_into {mib}, {what}",
                    f"{rate:.2f} GB/s",
                    f"memcpy {memcpy:.2f} GB/s",
                    f"{rate / memcpy:.2f}x of memcpy",
                ]
            )
        alone_rate = per_engine.pop()
        together = 2 * nbytes / statistics.median(both[1:]) / 1e9
        rows.append(
            [
                f"(c) both engines together: 2 x {mib} / publish time",
                f"{together:.2f} GB/s",
                f"memcpy {memcpy:.2f} GB/s",
                f"{together / memcpy:.2f}x of memcpy",
            ]
        )

        note("(d) 1,000 tensors, 7 MiB: one bucket against per-tensor handles")
        runs = {"bucket": [], "per-tensor": []}
        for round_ in range(6):  # alternating; the first of each is untimed
            for how, times in runs.items():
                # new tensors each time, as a trainer's new snapshot (made before the clock)
                tensors = {f"t{i}": torch.randn(1835, device="openreg:0") for i in range(1000)}
                seconds = many_tensors(inbox, done, tensors, how)
                if round_:
                    times.append(seconds)
        bucket, single = (statistics.median(times) for times in runs.values())
        rows.append(
            [
                "(d) share_tensors(copy=True) of 1,000 (7 MiB), opened",
                f"{bucket * 1e3:.1f} ms",
                f"per-tensor {single * 1e3:.1f} ms",
                f"{single / bucket:.1f}x faster",
            ]
        )

        note("(e) NIXL: 64 MiB pulled by a subscriber, against a plain NIXL read")
        nixl_rows, nixl_ratio = nixl_row()
        rows += nixl_rows

        inbox.put(None)
        for conn in subs:
            conn.send(None)
        for proc in procs:
            proc.join(TIMEOUT)
            assert proc.exitcode == 0, f"{proc.name} exited with {proc.exitcode}"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(TIMEOUT)
    print(markdown(["what", "median", "against", "ratio"], rows))
    b1, b10 = per_generation[1000], per_generation[10000]
    print(
        f"\n(b) <= 2x (a): 1,000 {b1 / queue:.2f}x, 10,000 {b10 / queue:.2f}x; "
        f"10,000 / 1,000 = {b10 / b1:.2f} (target <= 1.5)"
    )
    print(
        f"(c) >= 0.70x memcpy per engine: {', '.join(f'{r:.2f}x' for r in per_engine)} "
        f"(both at once), {alone_rate:.2f}x alone"
    )
    print(f"(d) >= 10x: {single / bucket:.1f}x")
    if nixl_ratio is not None:
        print(f"(e) >= 0.80x NIXL read: {nixl_ratio:.2f}x")


if __name__ == "__main__":
    main()
