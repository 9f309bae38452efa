"""Relay soak: a long run of the relay (`WeightPublisher(transport="nixl", relay=True)`) while
engines and leaders are paused (SIGSTOP, then SIGCONT), killed and joined, every engine's bytes
checked each generation.

The trainer (this process) publishes generation after generation of seeded weights; its engines
(processes of their own on this host, UCX over TCP loopback, as the tests run them) are two
thirds `share=True` (one leads: it pulls each generation, the others map its buffers) and one
third `share=False` (a copy of their own, relayed along the chain). Each engine loops on its own:
`wait()`, a random hold (its work on the views, up to --hold seconds), `copy_into()` its own
tensors, the SHA-256 of those sent to the trainer, `ack()`. The trainer checks each digest
against the generation's. Meanwhile a thread pauses a random engine now and then, for less than
LIVENESS (it must be waited for) or for more (it is named dead, and a follower paused while it
holds a generation finds its leader overwrote it: refused), or kills one. An engine told
PeerGoneError (dropped after a long pause, or refusing overwritten bytes) subscribes again with
a new token, and a killed one is replaced by a new process: both join the chain.

A run fails on any wrong byte, any engine error other than PeerGoneError, or a publish that
fails other than by naming a dead engine (ConsumerDiedError). It prints what happened.

Usage: python benchmarks/relay_soak.py [--engines 6] [--generations 400] [--seed 0]
       [--liveness 1.5] [--stall 0.5] [--hold 0.1] [--every 1.0] [--copy]
"""

import argparse
import hashlib
import os
import random
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait

from devipc._tools._bench.common import Piped

TIMEOUT = 300.0  # seconds: an engine's start, a wait, a publish's acknowledgements
UCX_LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def digest_of(tensors) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        digest.update(name.encode() + tensor.cpu().numpy().tobytes())
    return digest.hexdigest()


def engine(commands: Connection, replies: Connection) -> None:
    """("open", token, share, stall, hold): subscribes, then loops on its own, replying
    ("took", generation, digest, counts) for each generation, until PeerGoneError: ("dropped",
    message), then waits for the next command. ("exit",) ends it."""
    import torch

    import devipc
    import devipc_openreg  # noqa: F401
    from devipc._weights import _relay

    torch.set_num_threads(1)
    rng = random.Random(os.getpid())
    while (command := commands.recv())[0] == "open":
        _, token, share, stall, hold = command
        _relay.RELAY_STALL = stall
        sub = None
        try:
            sub = devipc.WeightSubscriber(token, share=share)
            replies.send(("opened", os.getpid()))
            own = None
            while True:
                generation = sub.wait(timeout=TIMEOUT)
                time.sleep(rng.uniform(0, hold))  # the engine's own work while it holds it
                if own is None:
                    own = {name: torch.empty_like(view) for name, view in sub.tensors().items()}
                sub.copy_into(own)
                replies.send(("took", generation, digest_of(own), sub._backend.counts()))
                sub.ack()
        except devipc.PeerGoneError as error:
            replies.send(("dropped", str(error)))
        except Exception as error:  # noqa: BLE001 - the trainer counts it as a failure
            replies.send(("error", f"{type(error).__name__}: {error}"))
        finally:
            if sub is not None:
                sub.close()


class Engine(Piped):
    """An engine process of this script."""

    def __init__(self, share: bool):
        super().__init__(
            [sys.executable, os.path.abspath(__file__), "--role", "engine", "--fds"],
            "engine",
            TIMEOUT,
            {**os.environ, **UCX_LOOPBACK, "OMP_NUM_THREADS": "1", "UCX_LOG_LEVEL": "error"},
        )  # not UCX's warnings of killed peers
        self.share = share
        self.counts: dict[str, int] = {}  # its subscription's, at its last generation

    def alive(self) -> bool:
        return self.proc.poll() is None


class Chaos(threading.Thread):
    """Pauses (SIGSTOP, then SIGCONT after the drawn time) or kills a random live engine every
    `every` seconds on average; at most half of them paused at a time."""

    def __init__(
        self,
        engines: list[Engine],
        lock: threading.Lock,
        roles,
        rng: random.Random,
        liveness: float,
        every: float,
        kills: bool,
    ):
        super().__init__(daemon=True, name="relay-soak-chaos")
        self.engines, self.lock, self.roles, self.rng = engines, lock, roles, rng
        self.liveness, self.every, self.kills = liveness, every, kills
        self.paused: dict[int, float] = {}  # pid -> when to resume it
        self.done = threading.Event()
        self.counts: dict[str, int] = {}

    def run(self) -> None:
        while not self.done.wait(min(0.05, self.every)):
            now = time.monotonic()
            for pid, until in list(self.paused.items()):
                if until <= now:
                    self._resume(pid)
            if self.rng.random() < 0.05 / self.every:
                self._strike()

    def _strike(self) -> None:
        with self.lock:
            live = [e for e in self.engines if e.alive() and e.proc.pid not in self.paused]
        if not live or len(self.paused) >= len(self.engines) // 2:
            return
        target = self.rng.choice(live)
        role = self.roles().get(target.proc.pid, "joining")
        draw = self.rng.random()
        if self.kills and draw < 0.15:
            target.proc.kill()
            self._count(f"killed {role}")
            return
        long = draw < 0.6
        seconds = self.liveness * (
            self.rng.uniform(1.3, 2.5) if long else self.rng.uniform(0.1, 0.6)
        )
        os.kill(target.proc.pid, signal.SIGSTOP)
        self.paused[target.proc.pid] = time.monotonic() + seconds
        self._count(f"paused {role} {'past' if long else 'within'} LIVENESS")

    def _resume(self, pid: int) -> None:
        del self.paused[pid]
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # it was killed meanwhile

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def stop(self) -> None:
        self.done.set()
        self.join(TIMEOUT)
        for pid in list(self.paused):
            self._resume(pid)


def run(
    engines: int = 6,
    generations: int = 400,
    seed: int = 0,
    liveness: float = 1.5,
    stall: float = 0.5,
    hold: float = 0.1,
    every: float = 1.0,
    copy: bool = False,
    kills: bool = True,
    log=None,
) -> dict:
    """One soak (see the module's docstring); the caller sets UCX to TCP loopback. Returns the
    counts: generations, engine-generations checked, wrong ones, engine errors, events."""
    import torch

    import devipc
    import devipc_openreg  # noqa: F401
    from devipc._weights import _remote_token

    liveness_was, _remote_token.LIVENESS = _remote_token.LIVENESS, liveness
    rng = random.Random(seed)
    weights = {
        "embed": torch.empty(300, 1024, device="openreg"),
        "proj": torch.empty(200, 1024, device="openreg"),
        "bias": torch.empty(1000, device="openreg"),
    }
    if not copy:
        weights = devipc.pack(weights)
    expected: dict[int, str] = {}
    found = {
        "checked": 0,
        "wrong": [],
        "errors": [],
        "refused": 0,
        "dropped": 0,
        "named": 0,
        "joined": 0,
        "started": 0,
    }
    fleet: list[Engine] = []
    lock = threading.Lock()
    publisher = devipc.WeightPublisher(weights, copy=copy, transport="nixl", relay=True)

    def roles() -> dict[int, str]:
        """Each subscribed engine's place by pid: leader, follower, or chain (a copy)."""
        records = publisher.subscribers()
        leaders = {r["leader"] for r in records.values()}
        return {
            r["pid"]: "follower" if r["leader"] >= 0 else "leader" if index in leaders else "chain"
            for index, r in records.items()
            if r["state"] == "attached"
        }

    def start(share: bool) -> None:
        engine_ = Engine(share)
        engine_.send("open", publisher.token(), share, stall, hold)
        with lock:
            fleet.append(engine_)
        found["started"] += 1

    def handle(engine_: Engine, message: tuple) -> None:
        kind = message[0]
        if kind == "took":
            _, generation, digest, engine_.counts = message
            found["checked"] += 1
            if digest != expected.get(generation):
                found["wrong"].append((engine_.proc.pid, generation))
        elif kind == "dropped":
            if closing:
                return
            found["dropped"] += 1
            found["refused"] += "was overwritten" in message[1]
            engine_.send("open", publisher.token(), engine_.share, stall, hold)  # joins again
            found["joined"] += 1
        elif kind == "error":
            found["errors"].append(message[1])

    def drain(timeout: float = 0.0) -> None:
        with lock:
            by_conn = {e.replies: e for e in fleet}
        for conn in wait(list(by_conn), timeout):
            engine_ = by_conn[conn]
            try:
                while conn.poll():
                    handle(engine_, conn.recv())
            except (EOFError, OSError):
                pass  # killed: replaced below

    def replace_the_killed() -> None:
        with lock:
            dead = [e for e in fleet if not e.alive()]
            for engine_ in dead:
                fleet.remove(engine_)
        for engine_ in dead:
            engine_.stop()
            start(engine_.share)
            found["joined"] += 1

    def acknowledged(generation: int) -> None:
        """Every live engine acknowledged `generation`; dead ones named (ConsumerDiedError)."""
        while True:
            try:
                publisher.wait_acks(generation, timeout=TIMEOUT)
                return
            except devipc.ConsumerDiedError as error:
                found["named"] += len(error.consumers)

    closing = False
    chaos = Chaos(fleet, lock, roles, rng, liveness, every, kills)
    started = time.monotonic()
    try:
        for index in range(engines):
            start(share=index % 3 != 2)  # one leader, its followers, and copies in a chain
        publisher.wait_subscribers(engines, timeout=TIMEOUT)
        chaos.start()
        for generation in range(generations):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + generation)
            for tensor in weights.values():
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            expected[generation] = digest_of(weights)
            publisher.publish(wait=False)
            acknowledged(generation)
            drain()
            replace_the_killed()
            if log is not None and generation % 50 == 49:
                log(
                    f"generation {generation + 1}/{generations}: {found['checked']} checked, "
                    f"{len(found['wrong'])} wrong, {found['refused']} refused"
                )
    finally:
        if chaos.is_alive():
            chaos.stop()
        drain()
        closing = True
        publisher.close()  # the engines' waits end: PeerGoneError
        for engine_ in fleet:
            engine_.stop()
        _remote_token.LIVENESS = liveness_was
    counts: dict[str, int] = {}
    for engine_ in fleet:
        for key, value in engine_.counts.items():
            counts[key] = counts.get(key, 0) + value
    return {
        **found,
        "generations": generations,
        "seconds": time.monotonic() - started,
        "events": dict(sorted(chaos.counts.items())),
        "relay": counts,
    }


def report(result: dict, args) -> str:
    rows = [
        ("generations published", result["generations"]),
        ("engine-generations checked (SHA-256 of the engine's copy)", result["checked"]),
        ("wrong bytes", len(result["wrong"])),
        ("engine errors other than PeerGoneError", len(result["errors"])),
        ("engines named dead (ConsumerDiedError)", result["named"]),
        ("PeerGoneError: dropped after a pause", result["dropped"] - result["refused"]),
        ("PeerGoneError: a follower refused bytes its leader overwrote", result["refused"]),
        ("joins (subscribed again, or a new process for a killed one)", result["joined"]),
        *((event, count) for event, count in result["events"].items()),
        ("seconds", f"{result['seconds']:.0f}"),
    ]
    lines = ["| | |", "|---|---:|", *(f"| {what} | {value} |" for what, value in rows)]
    relay = result["relay"]
    lines.append(
        f"\nWhat the engines alive at the end pulled, their last subscriptions: "
        f"{relay.get('shared', 0)} generations read in a leader's buffers, "
        f"{relay.get('upstream', 0) >> 20} MiB from upstreams, "
        f"{relay.get('trainer', 0) >> 20} MiB from the trainer, "
        f"{relay.get('bypassed', 0)} upstreams bypassed, {relay.get('left', 0)} "
        f"leaders left."
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=6)
    parser.add_argument("--generations", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--liveness", type=float, default=1.5, help="LIVENESS, seconds (10 in devipc)"
    )
    parser.add_argument(
        "--stall", type=float, default=0.5, help="RELAY_STALL, seconds (2 in devipc)"
    )
    parser.add_argument(
        "--hold",
        type=float,
        default=0.1,
        help="an engine holds each generation up to this long before its copy",
    )
    parser.add_argument(
        "--every", type=float, default=1.0, help="seconds between two pauses or kills, on average"
    )
    parser.add_argument("--copy", action="store_true", help="WeightPublisher(copy=True)")
    parser.add_argument("--role", choices=("engine",), help=argparse.SUPPRESS)
    parser.add_argument("--fds", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        engine(Connection(args.fds[0]), Connection(args.fds[1]))
        return 0
    os.environ.update(UCX_LOOPBACK)
    result = run(
        args.engines,
        args.generations,
        args.seed,
        args.liveness,
        args.stall,
        args.hold,
        args.every,
        args.copy,
        log=lambda text: print(text, file=sys.stderr, flush=True),
    )
    print(report(result, args))
    for error in result["errors"]:
        print(f"engine error: {error}", file=sys.stderr)
    if result["wrong"]:
        print(f"wrong bytes (pid, generation): {result['wrong']}", file=sys.stderr)
    return 1 if result["wrong"] or result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
