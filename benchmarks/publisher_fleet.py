"""What one WeightPublisher pays per engine, for fleets of 1 to 1,024 engines on one publisher:
the subscribers live in a few processes (several each: processes are the limit on a small
machine) and take each generation (wait, tensors, ack) as engines do; per N subscribers:

  memory       the publisher process's resident memory grown from its first token to
               all N subscribers attached (its records, card slots, NIXL's side of each
               connection), per engine
  publish      publish(wait=False): the publisher's own work on a generation (looking at every
               record, the relay's chain), wall time; median of the generations
  acks cpu     the publisher's CPU time while wait_acks() waits for the N acknowledgements (it
               looks at the records each time some land; across hosts it polls its own words
               for as long as the engines take), median of the generations
and what one more engine adds to each, from the fewest engines to the most. Every subscriber
checks every generation's bytes (each generation's weights hold its own number); one that held
other bytes ends the run with an error.

Weights: 64 KiB packed on openreg (copy=False), so that what is measured is the bookkeeping,
not the bytes. NIXL: UCX over TCP loopback, relay=True, each subscriber with buffers of its own.
Usage: python benchmarks/publisher_fleet.py [--ipc 1,64,256,1024] [--nixl 1,16,64]
       [--processes 4] [--generations 5]
"""

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

import devipc
import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)
from devipc._tools._bench.common import markdown

TIMEOUT = 600


def receive(conn):
    if not conn.poll(TIMEOUT):
        raise TimeoutError(f"no reply within {TIMEOUT} s")
    return conn.recv()


def subscribers(conn, tokens, generations, share):
    """Opens every token, then takes each generation on each subscriber in turn."""
    from devipc._weights import _relay

    # a busy machine's engines are slow, not stalled
    _relay.RELAY_STALL = _relay.RELAY_LAG = TIMEOUT
    subs = [
        devipc.WeightSubscriber(token, **({} if share is None else {"share": share}))
        for token in tokens
    ]
    conn.send("ready")
    wrong = 0  # subscriber-generations whose bytes are not those published
    for _ in range(generations):
        for sub in subs:
            generation = sub.wait(timeout=TIMEOUT)
            wrong += not bool((sub.tensors()["w"] == generation + 1.0).all())
            sub.ack()
    for sub in subs:
        sub.close()
    conn.send(("closed", wrong))


def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def measure(transport: str, count: int, processes: int, generations: int) -> dict:
    weights = devipc.pack({"w": torch.zeros(16 << 10, device="openreg")})
    nixl = transport == "nixl"
    ctx = mp.get_context("spawn")
    with devipc.WeightPublisher(weights, transport=transport, relay=nixl) as publisher:
        before = resident()
        groups = []
        parts = min(processes, count)
        for part in range(parts):
            tokens = [
                publisher.token()
                for _ in range(count * (part + 1) // parts - count * part // parts)
            ]
            ours, theirs = ctx.Pipe()
            ctx.Process(
                target=subscribers,
                daemon=True,
                args=(theirs, tokens, generations, False if nixl else None),
            ).start()
            groups.append(ours)
        for conn in groups:
            assert receive(conn) == "ready"
        publisher.wait_subscribers(count, timeout=TIMEOUT)
        grown = resident() - before
        publish, acks = [], []
        for _ in range(generations):
            weights["w"].fill_(publisher.generation + 2.0)  # each generation's own bytes
            start = time.perf_counter()
            generation = publisher.publish(wait=False, timeout=TIMEOUT)
            publish.append(time.perf_counter() - start)
            cpu = time.process_time()
            publisher.wait_acks(generation, timeout=TIMEOUT)
            acks.append(time.process_time() - cpu)
        wrong = 0
        for conn in groups:
            closed, found = receive(conn)
            assert closed == "closed"
            wrong += found
    if wrong:
        raise RuntimeError(
            f"{transport}, {count} engines: {wrong} subscriber-generations held other bytes"
        )
    return {
        "transport": transport,
        "engines": count,
        "memory per engine (KiB)": grown / count / 1024,
        "publish (ms)": statistics.median(publish) * 1e3,
        "acks cpu (ms)": statistics.median(acks) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ipc", default="1,64,256,1024")
    parser.add_argument("--nixl", default="1,16,64")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--generations", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp")  # loopback, as between two hosts
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    rows, slopes = [], []
    for transport, counts in (("ipc", args.ipc), ("nixl", args.nixl)):
        found = [
            measure(transport, int(c), args.processes, args.generations)
            for c in counts.split(",")
            if c
        ]
        for row in found:
            print(row, file=sys.stderr, flush=True)
        rows += found
        if len(found) > 1:  # what one more engine adds: from the fewest to the most
            first, last = found[0], found[-1]
            engines = last["engines"] - first["engines"]
            slopes.append(
                f"{transport}: one more engine adds "
                + ", ".join(
                    f"{(last[key] - first[key]) / engines * 1e3:.1f} us to {key.split(' (')[0]}"
                    for key in ("publish (ms)", "acks cpu (ms)")
                )
                + " per generation"
            )
    print(
        markdown(
            list(rows[0]),
            [[f"{v:.2f}" if isinstance(v, float) else v for v in row.values()] for row in rows],
            right=2,
        )
    )
    print("\n".join(slopes))


if __name__ == "__main__":
    main()
