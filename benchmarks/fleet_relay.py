"""Weight sync to a fleet on an emulated cluster: the relay (`WeightPublisher(transport="nixl",
relay=True)`) against today's one-hop pull, in one run.

Each "host" is a network namespace with one link (a veth pair to a bridge in a namespace of its
own), rate limited both ways with `tc tbf`, so that the trainer's uplink is the bottleneck as in
a real cluster; engines on one host share its namespace (and its link). Only addresses inside the
namespaces this script creates are used (10.231.0.0/24), and everything is torn down on exit,
also on failure. Needs root, `ip` and `tc` (iproute2), and NIXL.

For K = 1, 2, 4, 8 engines on K hosts, and 2 hosts x 4 engines, it prints the seconds per
generation (publish() until every engine acknowledged), T(K)/T(1), the goodput (a generation's
bytes / T), that goodput as a fraction of a link's rate, and how many times the trainer's link
and the busiest engine host's link carried each generation (their byte counters), and how many
copies of a generation the engines pulled in all with the relay (the others map them; one-hop:
one per engine). Every engine's
bytes are checked (CRC-32) on the last generation of each setting.

Usage: python benchmarks/fleet_relay.py [--mib 64] [--mbit 200] [--generations 2]
       [--ks 1,2,4,8] [--ways relay,one-hop] [--straggler stop|late [--straggler-seconds 5]]
       [--smoke] [--no-doc]
(docs/benchmarks.md is rewritten only by a run of the default settings.)
"""

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from devipc._tools._bench.common import Piped, replace_section

NET = "10.231.0"
TIMEOUT = 300
DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks.md")
SECTION = "## Fleet relay (`benchmarks/fleet_relay.py`)"
ABOUT = """Weight sync to a fleet on an emulated cluster: each host a network namespace whose one
link (a veth pair to a bridge) is limited by `tc tbf` to the same rate each way, the trainer's
host one of them; engines on one host share its namespace and link. One engine process per
engine, all on openreg, UCX over TCP. `relay` is `WeightPublisher(transport="nixl",
relay=True)` (a chain grouped by host, chunks of 1/128 of a generation); `one-hop` is the same
publisher without relay (every engine pulls the whole generation from the trainer). Seconds are
from `publish()` until every engine acknowledged; "carried" is a link's byte counter over the
timed generations divided by their bytes (the trainer's link sending; a host's receiving /
sending); "machine busy" is the share of this machine's CPU time not idle meanwhile. All the
processes (the trainer, up to 8 engines, UCX's TCP and the kernel's forwarding for every link)
share this machine's 2 cores: at 400 Mbit/s the relay's 8-host setting kept them ~97% busy and
measured the CPU more than the links (its T(8)/T(1) 1.29 in one run, 1.48 in another), so the
links run at 200 Mbit/s, where that setting leaves a fifth of the CPU idle (the one-hop
settings still fill it, the trainer's link their bottleneck). With the relay, the engines of
one host (one device) map the buffers of the one among them that pulls: "copies" counts the
generations' bytes pulled by all the engines, per generation (the rest read in place). Real
hosts each have their own cores."""


def note(text):
    print(text, file=sys.stderr, flush=True)


def sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=60)


class Cluster:
    """Namespaces `<prefix>t` (the trainer), `<prefix>h1`... (engine hosts) and `<prefix>sw`
    (the bridge), each host linked to the bridge by a veth pair limited to `mbit` each way."""

    def __init__(self, hosts: int, mbit: int):
        self.prefix = f"dvf{os.getpid() % 100000}"
        self.names = ["t"] + [f"h{i}" for i in range(1, hosts + 1)]
        self.mbit = mbit
        self.made: list[str] = []

    def ns(self, name: str) -> str:
        return self.prefix + name

    def __enter__(self) -> "Cluster":
        try:
            switch = self.ns("sw")
            self._netns(switch)
            sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", switch, "link", "set", "br0", "up")
            for number, name in enumerate(self.names, start=1):
                ns = self.ns(name)
                self._netns(ns)
                outer = f"{self.prefix}{name}"[-15:]  # the bridge's end, in the switch
                sh(
                    "ip",
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    outer,
                    "netns",
                    switch,
                )
                sh("ip", "-n", switch, "link", "set", outer, "master", "br0", "up")
                sh("ip", "-n", ns, "addr", "add", f"{NET}.{number}/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                for where, dev in ((ns, "eth0"), (switch, outer)):  # both ways
                    sh(
                        "tc",
                        "-n",
                        where,
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        f"{self.mbit}mbit",
                        "burst",
                        "256kb",
                        "latency",
                        "100ms",
                    )
            return self
        except BaseException:
            self.__exit__()
            raise

    def _netns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.made.append(name)

    def __exit__(self, *exc) -> None:
        for name in reversed(self.made):
            pids = sh("ip", "netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            sh("ip", "netns", "del", name, check=False)
        self.made.clear()

    def sent(self, name: str) -> int:
        """Bytes the host `name` sent on its link (its end of the bridge received them)."""
        return self._counter(name, "rx_bytes")

    def received(self, name: str) -> int:
        return self._counter(name, "tx_bytes")

    def _counter(self, name: str, which: str) -> int:
        outer = f"{self.prefix}{name}"[-15:]
        out = sh(
            "ip",
            "netns",
            "exec",
            self.ns("sw"),
            "cat",
            f"/sys/class/net/{outer}/statistics/{which}",
        ).stdout
        return int(out)


class Process(Piped):
    """A script (this one unless named) in a role, on an emulated host, driven through two
    pipes."""

    def __init__(self, cluster: Cluster, host: str, role: str, script: str = __file__):
        env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "OMP_NUM_THREADS": "1"}
        super().__init__(
            [
                "ip",
                "netns",
                "exec",
                cluster.ns(host),
                sys.executable,
                os.path.abspath(script),
                "--role",
                role,
                "--fds",
            ],
            host,
            TIMEOUT,
            env,
        )
        self.host = host


def trainer(commands: Connection, replies: Connection) -> None:
    """Publishes: ("publisher", nbytes, relay, tokens) -> tokens; ("generations", engines, n,
    checksum) -> the seconds each took; ("close",)."""
    import torch

    import devipc
    import devipc_openreg  # noqa: F401

    publisher = weights = None
    while (command := commands.recv())[0] != "exit":
        try:
            if command[0] == "publisher":
                _, nbytes, relay, tokens = command
                weights = devipc.pack({"w": torch.zeros(nbytes // 4, device="openreg")})
                publisher = devipc.WeightPublisher(weights, transport="nixl", relay=relay)
                replies.send([publisher.token() for _ in range(tokens)])
            elif command[0] == "generations":
                publisher.wait_subscribers(command[1], timeout=TIMEOUT)
                seconds, starts = [], []
                for _ in range(command[2]):
                    weights["w"].fill_(float(publisher.generation + 2))
                    starts.append(time.monotonic())
                    publisher.publish(timeout=TIMEOUT, checksum=command[3])
                    seconds.append(time.monotonic() - starts[-1])
                replies.send((seconds, starts))
            elif command[0] == "close":
                publisher.close()
                publisher = weights = None
                replies.send("closed")
        except Exception as error:  # noqa: BLE001 - the driver raises it
            replies.send(error)


def engine(commands: Connection, replies: Connection) -> None:
    """Subscribes: ("open", token) -> "ready"; ("generations", n, verify) -> whether every
    one's bytes were those published (their checksum, with `verify`), and what the relay pulled
    from where; ("close",)."""
    import torch

    import devipc
    import devipc_openreg  # noqa: F401

    torch.set_num_threads(1)
    subscriber = None
    while (command := commands.recv())[0] != "exit":
        try:
            if command[0] == "open":
                subscriber = devipc.WeightSubscriber(command[1])
                replies.send("ready")
            elif command[0] == "generations":
                exact, arrivals = True, []
                for index in range(command[1]):
                    if index == 0 and command[3]:  # late to wait(): busy elsewhere, as mid-rollout
                        time.sleep(command[3])
                    generation = subscriber.wait(timeout=TIMEOUT)
                    arrivals.append(time.monotonic())
                    if command[2]:
                        subscriber.verify()
                        exact &= bool((subscriber.tensors()["w"] == generation + 1.0).all())
                    subscriber.ack()
                replies.send((exact, subscriber._backend.counts(), arrivals))
            elif command[0] == "close":
                subscriber.close()
                subscriber = None
                replies.send("closed")
        except Exception as error:  # noqa: BLE001 - the driver raises it
            replies.send(error)


def run_setting(cluster, pool, trainer_proc, placement, relay, nbytes, generations, straggler=None):
    """One publisher to engines placed as `placement` (host names, one per engine): a warm-up
    generation, then `generations` timed ones. `straggler` (kind, seconds): in the first timed
    generation the middle engine of the chain is frozen (SIGSTOP, 0.3 s after the publish, for
    `seconds`) or late to wait() by `seconds`; the timed generations' bytes are then checked
    too. Returns the measures."""
    engines = []
    for host in placement:
        slot = sum(1 for e in engines if e.host == host)
        key = (host, slot)
        if key not in pool:
            pool[key] = Process(cluster, host, "engine")
        engines.append(pool[key])
    tokens = trainer_proc.ask("publisher", nbytes, relay, len(engines))
    for proc, token in zip(engines, tokens):
        proc.send("open", token)
    for proc in engines:
        assert proc.reply() == "ready"

    middle = engines[len(engines) // 2] if straggler else None

    def run(count, verify, late=None):
        for proc in engines:
            proc.send("generations", count, verify, late if proc is middle else 0)
        seconds, starts = trainer_proc.ask("generations", len(engines), count, verify)
        return seconds, starts, [proc.reply() for proc in engines]

    def freeze(seconds):
        time.sleep(0.3)  # the generation under way: the engines pulling
        os.kill(middle.proc.pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(middle.proc.pid, signal.SIGCONT)

    run(1, False)  # warm-up: connections made
    hosts = sorted(set(placement))
    before = {name: (cluster.sent(name), cluster.received(name)) for name in ["t", *hosts]}
    idle = _idle()
    frozen = None
    if straggler and straggler[0] == "stop":
        frozen = threading.Thread(target=freeze, args=(straggler[1],))
        frozen.start()
    late = straggler[1] if straggler and straggler[0] == "late" else None
    seconds, starts, timed = run(generations, bool(straggler), late)
    if frozen is not None:
        frozen.join()
    idle = [now - then for now, then in zip(_idle(), idle)]
    after = {name: (cluster.sent(name), cluster.received(name)) for name in ["t", *hosts]}
    _, _, answers = run(1, True)  # every engine's bytes checked
    pulled = sum(a[1]["trainer"] + a[1]["upstream"] for a in answers)  # over every generation
    for proc in engines:
        assert proc.ask("close") == "closed"
    trainer_proc.ask("close")
    carried = {
        name: (
            (after[name][0] - before[name][0]) / (generations * nbytes),
            (after[name][1] - before[name][1]) / (generations * nbytes),
        )
        for name in after
    }
    return {
        "seconds": statistics.median(seconds),
        "exact": all(a[0] for a in answers + timed),
        "trainer": carried["t"][0],
        "host_in": max(carried[h][1] for h in hosts),
        "host_out": max(carried[h][0] for h in hosts),
        "counts": [a[1] for a in answers],
        "copies": pulled / ((generations + 2) * nbytes),
        "busy": 1 - idle[0] / idle[1],
        # seconds from each publish until each engine held the generation
        "arrivals": [[t - s for t, s in zip(a[2], starts)] for a in timed],
    }


def _idle() -> tuple[int, int]:
    """The machine's idle and total CPU time so far (/proc/stat, in ticks)."""
    with open("/proc/stat") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="a generation's size (MiB)")
    parser.add_argument("--mbit", type=int, default=200, help="each link's rate, each way")
    parser.add_argument("--generations", type=int, default=2, help="timed, per setting")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="2 hosts x 2 engines, 4 MiB, both ways: bytes checked, no figures",
    )
    parser.add_argument("--ks", default="1,2,4,8", help="engines, each on a host of its own")
    parser.add_argument(
        "--ways", default="relay,one-hop", help="relay, one-hop or both (comma-separated)"
    )
    parser.add_argument(
        "--straggler",
        choices=("stop", "late"),
        help="in the first timed generation, the middle engine is SIGSTOPped (or late to "
        "wait()) for --straggler-seconds; every timed generation's bytes are checked",
    )
    parser.add_argument("--straggler-seconds", type=float, default=5.0)
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    parser.add_argument("--role", choices=("trainer", "engine"), help=argparse.SUPPRESS)
    parser.add_argument("--fds", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        commands, replies = Connection(args.fds[0]), Connection(args.fds[1])
        (trainer if args.role == "trainer" else engine)(commands, replies)
        return
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        sys.exit(
            "fleet_relay.py needs root, ip and tc (iproute2): it emulates hosts with "
            "network namespaces"
        )
    if args.smoke:
        settings = [("2 hosts x 2", ["h1", "h1", "h2", "h2"])]
        args.mib, args.generations, args.no_doc = 4, 2, True
    else:
        ks = [int(k) for k in args.ks.split(",")]
        settings = [(f"{k} on {k} hosts", [f"h{i}" for i in range(1, k + 1)]) for k in ks]
        if args.ks == "1,2,4,8" and not args.straggler:
            settings.append(("2 hosts x 4", ["h1"] * 4 + ["h2"] * 4))
    ways = [way == "relay" for way in args.ways.split(",")]
    straggler = (args.straggler, args.straggler_seconds) if args.straggler else None
    nbytes = args.mib << 20
    hosts = max(int(h[1:]) for _, placement in settings for h in placement)
    started = time.perf_counter()
    results = {}
    with Cluster(hosts, args.mbit) as cluster:
        pool: dict = {}
        trainer_proc = Process(cluster, "t", "trainer")
        try:
            for relay in ways:
                for label, placement in settings:
                    note(f"{'relay' if relay else 'one-hop'}: {label}")
                    results[(relay, label)] = run_setting(
                        cluster,
                        pool,
                        trainer_proc,
                        placement,
                        relay,
                        nbytes,
                        args.generations,
                        straggler,
                    )
        finally:
            for proc in [trainer_proc, *pool.values()]:
                proc.stop()
    wrong = [key for key, found in results.items() if not found["exact"]]
    if wrong:
        sys.exit(f"engines held other bytes than published: {wrong}")
    if args.smoke:
        print(
            f"every engine's bytes exact in {len(results)} settings "
            f"({time.perf_counter() - started:.0f} s)"
        )
        return
    text = table(results, settings, nbytes, args)
    print(text)
    note(f"done in {time.perf_counter() - started:.0f} s")
    if not args.no_doc and (True, "2 hosts x 4") in results and (False, "2 hosts x 4") in results:
        command = "python benchmarks/fleet_relay.py" + "".join(
            f" {a}" for a in sys.argv[1:] if a != "--no-doc"
        )
        replace_section(DOC, SECTION, f"{ABOUT}\n\n`sudo {command}`, one run:\n\n{text}\n")


def table(results, settings, nbytes, args) -> str:
    rate = args.mbit * 1e6 / 8
    lines = [
        f"A generation of {args.mib} MiB, links of {args.mbit} Mbit/s each way, "
        f"median of {args.generations} generations per setting.",
        "",
        "| way | engines | s / generation | T(K)/T(1) | goodput MB/s | of link rate "
        "| trainer link carried | busiest host link in / out | copies | machine busy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for relay in sorted({relay for relay, _ in results}, reverse=True):
        first = results[(relay, settings[0][0])]["seconds"]
        for label, _ in settings:
            found = results[(relay, label)]
            goodput = nbytes / found["seconds"]
            copies = f"{found['copies']:.2f}" if relay else "-"  # one-hop: one per engine
            lines.append(
                f"| {'relay' if relay else 'one-hop'} | {label} | "
                f"{found['seconds']:.2f} | {found['seconds'] / first:.2f} | "
                f"{goodput / 1e6:.1f} | {goodput / rate:.0%} | "
                f"{found['trainer']:.2f}x | {found['host_in']:.2f}x / "
                f"{found['host_out']:.2f}x | {copies} | "
                f"{found['busy']:.0%} |"
            )
    if (True, "2 hosts x 4") not in results:  # (not the default settings: no goals)
        return "\n".join(lines)
    relay_8 = (
        results[(True, "8 on 8 hosts")]["seconds"] / results[(True, "1 on 1 hosts")]["seconds"]
    )
    two = results[(True, "2 hosts x 4")]
    alone = nbytes / results[(True, "1 on 1 hosts")]["seconds"] / rate
    lines += [
        "",
        f"- T(8 on 8 hosts) <= 1.3 T(1): {'met' if relay_8 <= 1.3 else 'NOT met'} ({relay_8:.2f})",
        f"- 2 hosts x 4: trainer link <= 1.1 times "
        f"{'met' if two['trainer'] <= 1.1 else 'NOT met'} "
        f"({two['trainer']:.2f}); each host link in once "
        f"{'met' if two['host_in'] <= 1.1 else 'NOT met'} ({two['host_in']:.2f}); "
        f"one copy per host, the other engines mapping it: "
        f"{'met' if two['copies'] <= 2.05 else 'NOT met'} ({two['copies']:.2f} copies "
        f"for 8 engines on 2 hosts)",
        f"- one engine alone >= 85% of the link: {'met' if alone >= 0.85 else 'NOT met'} "
        f"({alone:.0%})",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
