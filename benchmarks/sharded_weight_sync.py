"""Sharded weight sync against gather-then-publish, in one run: 4 trainer ranks (FSDP-like:
every weight sharded on dim 0 over the ranks, CPU, gloo) feed 4 tensor-parallel engines
(Megatron-style: qkv and up split on dim 0, o and down on dim 1) over NIXL (UCX over TCP
loopback: every byte an engine reads crosses a socket, as between hosts).

  sharded    each rank publishes its own shards (`ShardedPublisher`, copy=False); each engine
             (`ShardedSubscriber`, `tp_slices`) pulls only its slices, from the ranks that hold
             them (o and down: a column block, from all 4)
  gathered   the whole-model path: rank 0 gathers the full model (gloo) into a buffer it
             publishes (`WeightPublisher`, copy=False); each engine pulls it whole and keeps its
             slices

Per way: bytes each engine pulls per generation (the subscribers' own count of the runs they
read) against the model's; the trainer's peak memory (the largest growth of a rank's peak RSS
past its RSS once it held its shards: the sync's own memory, NIXL's agent included,
in model sizes); seconds per generation, from the ranks' start (for
gathered: the gather) until every engine acknowledged, median of the generations. All 8
processes share this machine's cores and its loopback.

Then, run as root with iproute2 (`ip`, `tc`), the same on an emulated cluster (each trainer rank
and each engine a host: a network namespace whose one link is limited by `tc` to `--mbit` each
way, as `benchmarks/fleet_relay.py` makes them): seconds per generation of `sharded` against the
whole-model relay (`relayed`: rank 0 holding the full model, `WeightPublisher(transport="nixl",
relay=True)`, every engine pulling it whole through the chain; the gather not counted), and the
bytes each engine's and each rank's link carried per generation, in models.

Usage: python benchmarks/sharded_weight_sync.py [--mib 64] [--generations 3] [--mbit 200]
       [--no-cluster] [--no-doc]
"""

import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing as mp

import devipc
from devipc._tools._bench.common import markdown, replace_section

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fleet_relay import Cluster, Process  # its namespaces, links and hosts

RANKS = TP = 4
TIMEOUT = 600
DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks.md")
SECTION = "## Sharded weight sync (`benchmarks/sharded_weight_sync.py`)"
TP_DIMS = {"qkv": 0, "o": 1, "up": 0, "down": 1}


def layout_of_model(hidden: int, layers: int) -> dict[str, devipc.ParamLayout]:
    shapes = {
        "qkv": (3 * hidden, hidden),
        "o": (hidden, hidden),
        "up": (4 * hidden, hidden),
        "down": (hidden, 4 * hidden),
    }
    return {
        f"{layer}.{kind}": devipc.ParamLayout(shape, (RANKS,), [0])
        for layer in range(layers)
        for kind, shape in shapes.items()
    }


def tp_dim(name: str) -> int:
    return TP_DIMS[name.split(".")[1]]


def known(shape, box=None) -> torch.Tensor:
    """Generation 0 of a weight on the cluster (each publish adds 1 to every element): values
    that say where they lie, exact in float32; `box` the part of it a rank holds."""
    whole = (torch.arange(torch.Size(shape).numel(), dtype=torch.int64) % 65521).view(shape)
    part = whole if box is None else whole[tuple(slice(*span) for span in box)]
    return part.to(torch.float32)


def rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def receive(conn):
    if not conn.poll(TIMEOUT):
        raise TimeoutError(f"no reply within {TIMEOUT} s")
    return conn.recv()


def trainer(conn, rank, way, layout, engines, port):
    """One rank: its shards only (random, never the full model), then per "go" a step that
    writes them in place and a publish; replies its peak RSS growth past its baseline."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    local = devipc.pack(
        {name: torch.randn(param.local_shape(rank)) for name, param in layout.items()}
    )
    baseline = rss_kib()  # the rank's own shards held: what is measured is the sync's memory
    if way == "sharded":
        publisher = devipc.ShardedPublisher(local, layout, rank=rank, transport="nixl")
    else:  # rank 0 keeps a buffer of the full model to gather into and publish
        full = (
            devipc.pack({name: torch.empty(param.shape) for name, param in layout.items()})
            if rank == 0
            else None
        )
        publisher = devipc.WeightPublisher(full, transport="nixl") if full else None
    conn.send([publisher.token() for _ in range(engines)] if publisher else None)
    while receive(conn) == "go":
        with torch.no_grad():
            for tensor in local.values():
                tensor.add_(1.0)
        if way == "gathered":
            for name, tensor in local.items():
                pieces = list(full[name].chunk(RANKS)) if full else None
                dist.gather(tensor, pieces, dst=0)
        if publisher is not None:
            publisher.publish(timeout=TIMEOUT)
        dist.barrier()
        conn.send("published")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if publisher is not None:
        publisher.close()
    dist.destroy_process_group()
    conn.send((peak - baseline) * 1024)


def engine(conn, way, layout, tokens, tp_rank):
    """One tensor-parallel engine on the CPU: per generation waits, reads its slices (a sum, so
    every byte is touched), acknowledges; replies the bytes it pulls per generation."""
    torch.set_num_threads(1)
    slices = devipc.tp_slices(layout, tp_rank, TP, tp_dim)
    if way == "sharded":
        subscriber = devipc.ShardedSubscriber(tokens, layout, slices, device="cpu")
        pulled = subscriber.pull_bytes
    else:
        subscriber = devipc.WeightSubscriber(tokens[0], device="cpu")
        pulled = sum(param.shape[0] * param.shape[1] * 4 for param in layout.values())
    conn.send("ready")
    while receive(conn) == "take":
        subscriber.wait(TIMEOUT)
        held = subscriber.tensors()
        for name, (dim, start, stop) in slices.items():
            tensor = held[name] if way == "sharded" else held[name].narrow(dim, start, stop - start)
            tensor.sum()
        subscriber.ack()
        conn.send("taken")
    subscriber.close()
    conn.send(pulled)


def rank_role(commands: Connection, replies: Connection) -> None:
    """A trainer rank on a host: ("sharded", layout, rank, engines) or ("relayed", layout,
    engines) -> tokens (relayed: rank 0 publishes the full model, the others nothing);
    ("publish", checksum) -> "published" once every engine took it; ("close",)."""
    torch.set_num_threads(1)
    publisher = weights = None
    while (command := commands.recv())[0] != "exit":
        try:
            if command[0] == "sharded":
                _, layout, rank, engines = command
                weights = devipc.pack(
                    {name: known(param.shape, param.box(rank)) for name, param in layout.items()}
                )
                publisher = devipc.ShardedPublisher(weights, layout, rank=rank, transport="nixl")
                replies.send([publisher.token() for _ in range(engines)])
            elif command[0] == "relayed":
                _, layout, engines = command
                weights = devipc.pack({name: known(param.shape) for name, param in layout.items()})
                publisher = devipc.WeightPublisher(weights, transport="nixl", relay=True)
                replies.send([publisher.token() for _ in range(engines)])
            elif command[0] == "publish":
                with torch.no_grad():
                    for tensor in weights.values():
                        tensor.add_(1.0)
                publisher.publish(timeout=TIMEOUT, checksum=command[1])
                replies.send("published")
            elif command[0] == "close":
                publisher.close()
                publisher = weights = None
                replies.send("closed")
        except Exception as error:  # noqa: BLE001 - the driver raises it
            replies.send(error)


def engine_role(commands: Connection, replies: Connection) -> None:
    """A TP engine on a host: ("open", tokens, layout, tp_rank) -> "ready" (one token: the
    whole model's); ("take", check) -> once it read its slices and acknowledged, whether they
    were those of the generation (`check`: compared with `known`'s and verified against the
    checksums published with it, else only summed);
    ("close",)."""
    torch.set_num_threads(1)
    subscriber = slices = None
    whole = False
    while (command := commands.recv())[0] != "exit":
        try:
            if command[0] == "open":
                _, tokens, layout, tp_rank = command
                slices = devipc.tp_slices(layout, tp_rank, TP, tp_dim)
                whole = len(tokens) == 1
                subscriber = (
                    devipc.WeightSubscriber(tokens[0], device="cpu")
                    if whole
                    else devipc.ShardedSubscriber(tokens, layout, slices, device="cpu")
                )
                replies.send("ready")
            elif command[0] == "take":
                generation = subscriber.wait(TIMEOUT)
                held = subscriber.tensors()
                exact = True
                for name, (dim, start, stop) in slices.items():
                    mine = held[name].narrow(dim, start, stop - start) if whole else held[name]
                    if command[1]:
                        expected = known(layout[name].shape).narrow(dim, start, stop - start)
                        exact &= torch.equal(mine, expected + (generation + 1))
                    else:
                        mine.sum()
                if command[1]:
                    subscriber.verify()  # ChecksumError: the driver raises it
                subscriber.ack()
                replies.send(exact)
            elif command[0] == "close":
                subscriber.close()
                replies.send("closed")
        except Exception as error:  # noqa: BLE001 - the driver raises it
            replies.send(error)


def run(way, layout, generations, port):
    ctx = mp.get_context("spawn")
    trainers, engines = [], []
    procs = []
    try:
        for rank in range(RANKS):
            ours, theirs = ctx.Pipe()
            procs.append(ctx.Process(target=trainer, args=(theirs, rank, way, layout, TP, port)))
            procs[-1].start()
            trainers.append(ours)
        tokens = [receive(conn) for conn in trainers]
        for tp_rank in range(TP):
            mine = (
                [tokens[rank][tp_rank] for rank in range(RANKS)]
                if way == "sharded"
                else [tokens[0][tp_rank]]
            )
            ours, theirs = ctx.Pipe()
            procs.append(ctx.Process(target=engine, args=(theirs, way, layout, mine, tp_rank)))
            procs[-1].start()
            engines.append(ours)
        for conn in engines:
            assert receive(conn) == "ready"
        seconds = []
        for _ in range(generations):
            for conn in engines:
                conn.send("take")
            start = time.perf_counter()
            for conn in trainers:
                conn.send("go")
            for conn in engines:
                assert receive(conn) == "taken"
            seconds.append(time.perf_counter() - start)
            for conn in trainers:
                assert receive(conn) == "published"
        for conn in engines:
            conn.send("stop")
        pulled = [receive(conn) for conn in engines]
        for conn in trainers:
            conn.send("stop")
        peaks = [receive(conn) for conn in trainers]
        for proc in procs:
            proc.join(TIMEOUT)
        return statistics.median(seconds), pulled, peaks
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


def run_cluster(layout, generations, mbit, model, check=False, ways=("sharded", "relayed")):
    """Each rank and each engine a host; per way: seconds per generation (median), what the
    busiest engine link and trainer link carried in, per generation, in models, and whether
    every engine's slices were exact (`check`: each generation's compared, and published with
    checksums that each engine verifies, untimed)."""
    ranks = ["t", "h1", "h2", "h3"]
    engines_at = ["h4", "h5", "h6", "h7"]
    results = {}
    with Cluster(7, mbit) as cluster:
        procs = [Process(cluster, host, "rank", __file__) for host in ranks] + [
            Process(cluster, host, "engine", __file__) for host in engines_at
        ]
        try:
            for way in ways:
                print(f"cluster: {way}", file=sys.stderr, flush=True)
                publishing = procs[:RANKS] if way == "sharded" else procs[:1]
                tokens = [
                    proc.ask("sharded", layout, rank, TP)
                    if way == "sharded"
                    else proc.ask("relayed", layout, TP)
                    for rank, proc in enumerate(publishing)
                ]
                for tp_rank, proc in enumerate(procs[RANKS:]):
                    assert (
                        proc.ask("open", [mine[tp_rank] for mine in tokens], layout, tp_rank)
                        == "ready"
                    )
                seconds = []
                for generation in range(generations + 1):  # the first: connections made
                    if generation == 1:
                        before = {
                            h: (cluster.sent(h), cluster.received(h)) for h in ranks + engines_at
                        }
                    for proc in procs[RANKS:]:
                        proc.send("take", check)
                    start = time.perf_counter()
                    for proc in publishing:
                        proc.send("publish", check)
                    for proc in publishing:
                        assert proc.reply() == "published"
                    exact = all([proc.reply() for proc in procs[RANKS:]])
                    seconds.append(time.perf_counter() - start)
                    if not exact:
                        raise AssertionError(
                            f"{way}: an engine's slices of generation "
                            f"{generation} were not the trainer's"
                        )
                after = {h: (cluster.sent(h), cluster.received(h)) for h in ranks + engines_at}
                for proc in procs[RANKS:] + publishing:
                    assert proc.ask("close") == "closed"
                per = generations * model
                results[way] = (
                    statistics.median(seconds[1:]),
                    max((after[h][1] - before[h][1]) / per for h in engines_at),
                    max((after[h][0] - before[h][0]) / per for h in ranks),
                )
        finally:
            for proc in procs:
                proc.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="the model's size")
    parser.add_argument("--generations", type=int, default=3)
    parser.add_argument("--mbit", type=int, default=200, help="each emulated link's rate")
    parser.add_argument("--no-cluster", action="store_true", help="skip the emulated cluster")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the emulated cluster only, sharded only, a small model, every "
        "engine's slices checked each generation, no figures",
    )
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--role", choices=("rank", "engine"), help=argparse.SUPPRESS)
    parser.add_argument("--fds", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        commands, replies = Connection(args.fds[0]), Connection(args.fds[1])
        (rank_role if args.role == "rank" else engine_role)(commands, replies)
        return
    cluster = not args.no_cluster
    if cluster and (os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc")):
        sys.exit("the emulated cluster needs root, ip and tc (iproute2); --no-cluster skips it")
    if args.smoke:
        layout = layout_of_model(64, 2)
        model = sum(param.shape[0] * param.shape[1] * 4 for param in layout.values())
        run_cluster(layout, 2, args.mbit, model, check=True, ways=("sharded",))
        print("every engine's slices exact and verified, each generation")
        return
    os.environ.update(UCX_TLS="tcp", UCX_NET_DEVICES="lo")  # the children inherit it
    layers = 4
    hidden = 64 * max(1, round((args.mib * 2**20 / (4 * layers * 12)) ** 0.5 / 64))
    layout = layout_of_model(hidden, layers)
    model = sum(param.shape[0] * param.shape[1] * 4 for param in layout.values())
    print(
        f"model: {layers} layers, hidden {hidden}: {model / 2**20:.1f} MiB float32; "
        f"{RANKS} trainer ranks -> {TP} TP engines",
        file=sys.stderr,
    )
    results = {
        way: run(way, layout, args.generations, 29600 + index)
        for index, way in enumerate(("sharded", "gathered"))
    }
    rows = []
    for way, (seconds, pulled, peaks) in results.items():
        rows.append(
            [
                way,
                f"{max(pulled) / model:.3f}",
                f"{sum(pulled) / model:.2f}",
                f"{max(peaks) / model:.2f}",
                f"{seconds:.3f}",
                f"{seconds / results['gathered'][0]:.2f}",
            ]
        )
    table = markdown(
        [
            "way",
            "pulled per engine (models)",
            "pulled by all engines (models)",
            "trainer peak beyond its shards (models, largest rank)",
            "s / generation (loopback)",
            "vs gathered",
        ],
        rows,
    )
    sharded, gathered = results["sharded"], results["gathered"]
    notes = (
        f"- each engine pulls {max(sharded[1]) / model:.3f} of the model (goal ~1/{TP}), "
        f"all engines {sum(sharded[1]) / model:.2f} (goal ~1): "
        f"{'met' if max(sharded[1]) <= 1.1 * model / TP else 'NOT met'}\n"
        f"- trainer memory beyond a rank's shards, largest rank: sharded "
        f"{max(sharded[2]) / 2**20:.0f} MiB (its publisher and NIXL agent), gathered "
        f"{max(gathered[2]) / 2**20:.0f} MiB: the gather's full copy is the "
        f"{(max(gathered[2]) - max(sharded[2])) / model:.2f} models between them; "
        f"no full-model copy on any rank with sharded: "
        f"{'met' if max(sharded[2]) < 0.5 * model else 'NOT met'}\n"
    )
    body = (
        f"A model of {model / 2**20:.1f} MiB float32 ({layers} layers, hidden {hidden}), "
        f"median of {args.generations} generations.\n\nOne host, UCX over TCP loopback:\n\n"
        f"{table}\n\n"
    )
    if cluster:
        on = run_cluster(layout, args.generations, args.mbit, model)
        rows = [
            [
                way,
                f"{seconds:.2f}",
                f"{seconds / on['relayed'][0]:.2f}",
                f"{engine:.2f}",
                f"{rank:.2f}",
            ]
            for way, (seconds, engine, rank) in on.items()
        ]
        body += (
            f"Emulated cluster: 4 rank hosts and 4 engine hosts, links of {args.mbit} "
            f"Mbit/s each way:\n\n"
            + markdown(
                [
                    "way",
                    "s / generation",
                    "vs relayed",
                    "busiest engine link in (models)",
                    "busiest rank link out (models)",
                ],
                rows,
            )
            + "\n\n"
        )
        ratio = on["sharded"][0] / on["relayed"][0]
        notes += (
            f"- time on the emulated cluster: sharded {ratio:.2f}x the whole-model relay "
            f"(goal <= 1/{TP} + 10% = {1 / TP + 0.1:.2f}): "
            f"{'met' if ratio <= 1 / TP + 0.1 else 'NOT met'}\n"
        )
    body += notes
    print(body)
    if not args.no_doc:
        replace_section(DOC, SECTION, body, notes="Method:")


if __name__ == "__main__":
    main()
