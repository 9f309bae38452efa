"""The relay of weight generations along a chain of engines (`WeightPublisher(transport="nixl",
relay=True)`): engines in processes of their own reach each other and the trainer through NIXL
(UCX over TCP loopback, as between hosts). Every engine's bytes are checked against the trainer's,
also when an engine of the chain is killed or frozen, and when one joins late. The emulated
cluster's smoke run (network namespaces, rate-limited links) closes the file."""

import contextlib
import gc
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import _relay_workers
import _workers
import pytest
import torch
from _support import FRESH_TIMEOUT, TIMEOUT, Children, nixl_missing, recv, use_ucx_loopback

import devipc
from devipc._core import _wire
from devipc._weights import _relay, _remote_token
from devipc._weights._relay import (
    CARD_BYTES,
    Card,
    Place,
    chain,
    chunk_size,
    host_key,
    progress_word,
    share_key,
    written,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import relay_soak

NIXL = nixl_missing()
pytestmark = pytest.mark.xdist_group("relay")  # one worker starts the engines, its tests share them
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Driven:
    """A process of _relay_workers (spawned among `children`) driven through its pipe: `send`,
    `reply` (an exception it replies is raised here), `ask`, and `stop` ("exit", then a kill
    after 10 s)."""

    def __init__(self, children: Children, target):
        self.proc, self.conn = children.start_piped(target)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def send(self, *command) -> None:
        try:
            self.conn.send(command)
        except OSError as error:  # it died: say how
            self.proc.join(TIMEOUT)
            code = self.proc.exitcode
            raise AssertionError(f"engine {self.proc.pid} is gone (exit code {code})") from error

    def reply(self):
        answer = recv(self.conn, FRESH_TIMEOUT)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def ask(self, *command):
        self.send(*command)
        return self.reply()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen one must hear "exit"
        with contextlib.suppress(OSError):
            self.conn.send(("exit",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(TIMEOUT)


@pytest.fixture(autouse=True)
def nothing_lingers():
    """What a test here dropped goes before the next test of this worker measures memory."""
    yield
    gc.collect()
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()


@pytest.fixture(scope="module")
def fleet():
    """Engine processes shared by the tests of this file; `fleet(n)` gives n live ones (a test
    that kills or freezes one leaves it to be replaced)."""
    if NIXL is not None:
        pytest.skip(f"NIXL is not installed ({NIXL})")
    import devipc_openreg  # noqa: F401 - openreg tensors in this process too

    engines: list[Driven] = []
    children = Children()
    with pytest.MonkeyPatch.context() as patch:
        use_ucx_loopback(patch)
        devipc.p2p.Endpoint(transport="nixl").close()  # NIXL's first use keeps some fds

        def give(count: int) -> list[Driven]:
            for engine in [e for e in engines if not e.alive() or e.proc.pid in frozen]:
                engines.remove(engine)
                engine.stop()
            engines.extend(
                Driven(children, _relay_workers.engine) for _ in range(count - len(engines))
            )
            return engines[:count]

        frozen: set[int] = set()
        give.frozen = frozen  # type: ignore[attr-defined]
        try:
            yield give
        finally:
            for engine in engines:
                engine.stop()
            children.reap()


def _weights(copy: bool) -> dict[str, torch.Tensor]:
    """2 MiB of weights in three tensors: several chunks of the relay."""
    weights = {
        "embed": torch.empty(300, 1024, device="openreg"),
        "proj": torch.empty(200, 1024, device="openreg"),
        "bias": torch.empty(1000, device="openreg"),
    }
    return weights if copy else devipc.pack(weights)


def _step(weights: dict[str, torch.Tensor], seed: int) -> str:
    """New values, as an optimizer step writes them; their digest as the engines take it."""
    generator = torch.Generator().manual_seed(seed)
    digest = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
        digest.update(name.encode() + tensor.cpu().numpy().tobytes())
    return digest.hexdigest()


def _publish(publisher, weights: dict[str, torch.Tensor], seed: int) -> str:
    """New values (`_step`), published without waiting for the engines: their digest."""
    digest = _step(weights, seed)
    publisher.publish(wait=False)
    return digest


def _stop(fleet, engine: Driven, how: str) -> None:
    """Kill the engine (SIGKILL) or freeze it (SIGSTOP: the fleet replaces it later)."""
    if how == "killed":
        engine.proc.kill()
        engine.proc.join(TIMEOUT)
    else:
        os.kill(engine.proc.pid, signal.SIGSTOP)
        fleet.frozen.add(engine.proc.pid)


def _open(publisher, engines, share=False) -> list[int]:
    """The engines subscribe; without `share` each holds a copy of its own, as engines of
    distinct hosts do."""
    for engine in engines:  # none goes around an engine that is only slow on a busy machine
        engine.ask("stall", 30.0, 30.0)
    pids = [engine.ask("open", publisher.token(), share) for engine in engines]
    publisher.wait_subscribers(len(engines), timeout=TIMEOUT)
    return pids


def _take(engines, generation, digest):
    """Each engine takes the generation: returns what its relay pulled from where."""
    for engine in engines:
        engine.send("take")
    counts = []
    for engine in engines:
        got, found, pulled = engine.reply()
        assert (got, found) == (generation, digest)
        counts.append(pulled)
    return counts


def _three_generations(publisher, weights, engines, seed, places):
    """Generations 0, 1 and 2, each taken by every engine while `publish` waits for their
    acknowledgements, every byte checked, each engine at its place ((upstream, leader) by
    record). The last digest, and what each engine's relay pulled from where."""
    for generation in range(3):
        digest = _step(weights, seed + generation)
        for engine in engines:
            engine.send("take")
        assert publisher.publish(timeout=TIMEOUT) == generation  # every engine acked
        assert [(r["upstream"], r["leader"]) for r in publisher.subscribers().values()] == places
        counts = []
        for engine in engines:
            got, found, pulled = engine.reply()
            assert (got, found) == (generation, digest)
            counts.append(pulled)
    return digest, counts


@pytest.mark.parametrize("copy", [False, True])
def test_every_engine_of_a_chain_holds_each_generation_exactly(fleet, copy):
    engines = fleet(3)
    weights = _weights(copy)
    nbytes = sum(t.nbytes for t in weights.values())
    with devipc.WeightPublisher(weights, copy=copy, transport="nixl", relay=True) as publisher:
        _open(publisher, engines)
        digest, counts = _three_generations(
            publisher, weights, engines, 0, [(-1, -1), (0, -1), (1, -1)]
        )
        # the trainer's memory was read once a generation, by the head of the chain
        padded = publisher._backend._nbytes
        assert padded >= nbytes and chunk_size(padded) < padded // 4  # several chunks
        assert [c["trainer"] for c in counts] == [3 * padded, 0, 0]
        assert [c["upstream"] for c in counts] == [0, 3 * padded, 3 * padded]
        assert all(c["bypassed"] == 0 for c in counts)
        fds_there = [engine.ask("close") for engine in engines]
        assert {r["state"] for r in publisher.subscribers().values()} == {"closed"}
        _open(publisher, engines)  # once more: nothing grows from one subscription to the next
        if copy:  # late subscribers take the newest generation at once
            _take(engines, 2, digest)
        digest = _publish(publisher, weights, 3)
        _take(engines, 3, digest)
        assert [engine.ask("close") for engine in engines] == fds_there


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_an_engine_killed_or_frozen_mid_chain_is_bypassed_then_named_once(fleet, monkeypatch, how):
    """B holds a generation when it is killed (SIGKILL) or frozen (SIGSTOP); C, downstream of
    it, then takes that generation from A, the engine ahead of B, not from the trainer (around
    a killed B at once: its reads of B fail; around a frozen one once A held a chunk that B
    did not pass on for RELAY_LAG) with every byte exact. The publisher names B once
    (ConsumerDiedError, after LIVENESS) and the next chain leaves it out: C then relays from
    A."""
    monkeypatch.setattr(_remote_token, "LIVENESS", 2.0)
    a, b, c = fleet(3)
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        pids = _open(publisher, [a, b, c])
        digest = _publish(publisher, weights, 10)
        first = _take([a, b, c], 0, digest)[2]
        publisher.wait_acks(0, timeout=TIMEOUT)
        digest = _publish(publisher, weights, 11)
        _take([a, b], 1, digest)
        c.ask("stall", 1.0, 0.5)  # once B is stopped: around it
        _stop(fleet, b, how)
        [counts] = _take([c], 1, digest)
        assert counts["bypassed"] == 1 and counts["trainer"] == first["trainer"] == 0
        assert counts["upstream"] == 2 * first["upstream"]  # the rest from A
        c.ask("stall", 30.0, 1.0)  # B, still frozen, is tried again and gone around once more
        publisher.wait_acks(1, timeout=TIMEOUT)  # B acknowledged before it stopped
        digest = _publish(publisher, weights, 12)
        _take([a, c], 2, digest)  # B is still in this chain: C goes around it
        with pytest.raises(devipc.ConsumerDiedError, match=f"pid {pids[1]}\\)") as dead:
            publisher.wait_acks(2, timeout=TIMEOUT)
        assert dead.value.consumers == [(1, pids[1])]
        digest = _step(weights, 13)
        for engine in (a, c):
            engine.send("take")
        assert publisher.publish(timeout=TIMEOUT) == 3  # named once: not waited for again
        before = counts["upstream"]
        counts = [engine.reply() for engine in (a, c)]
        assert [(g, d) for g, d, _ in counts] == [(3, digest)] * 2
        assert publisher.subscribers()[2]["upstream"] == 0  # C relays from A now
        assert counts[1][2]["upstream"] > before
        for engine in (a, c):
            engine.ask("close")


def _first_generation(publisher, weights, engines, seed: int) -> list[dict]:
    """The engines subscribe and take generation 0, acknowledged: what each pulled from where."""
    _open(publisher, engines)
    digest = _publish(publisher, weights, seed)
    before = _take(engines, 0, digest)
    publisher.wait_acks(0, timeout=TIMEOUT)
    return before


def _from_trainer(after: list[dict], before: list[dict]) -> list[int]:
    """The bytes each engine pulled from the trainer between two looks at its counts."""
    return [n["trainer"] - o["trainer"] for n, o in zip(after, before)]


@pytest.mark.parametrize("how", ["frozen", "late"])
def test_engines_behind_a_frozen_or_late_one_take_the_rest_from_the_engine_ahead(fleet, how):
    """A -> B -> C -> D, B frozen (SIGSTOP) or late to wait() when a generation comes: C goes
    around it to A, the nearest engine ahead that holds the chunks (once A held one that B did
    not pass on for RELAY_LAG, 1 s here), not to the trainer (RELAY_STALL is 8 s, and C does
    not wait for it); D stays on C (it gives C a RELAY_LAG more, as C's own upstream is
    silent or holds nothing). The trainer's memory is read once for that generation, by
    A, and every engine's bytes are exact (B's too, once it takes the generation late)."""
    a, b, c, d = fleet(4)
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        before = _first_generation(publisher, weights, [a, b, c, d], 70)
        for engine in (c, d):
            engine.ask("stall", 8.0, 1.0)
        if how == "frozen":
            _stop(fleet, b, how)
        digest = _publish(publisher, weights, 71)
        after = _take([a, c, d], 1, digest)
        padded = publisher._backend._nbytes
        assert _from_trainer(after, [before[0], *before[2:]]) == [padded, 0, 0]  # one copy
        assert [x["bypassed"] for x in after] == [0, 1, 0]
        assert after[1]["upstream"] - before[2]["upstream"] == padded  # what B had not: from A
        assert after[2]["upstream"] - before[3]["upstream"] == padded  # from C
        if how == "late":
            [late] = _take([b], 1, digest)
            assert late["trainer"] == 0 and late["upstream"] - before[1]["upstream"] == padded
        for engine in (a, c, d) if how == "frozen" else (a, b, c, d):
            engine.ask("close")


def test_an_engine_whose_engines_ahead_do_not_pull_the_generation_takes_it_from_the_trainer(
    fleet,
):
    """A -> B -> C, and only C takes generation 1 (A and B late to wait()): B brings nothing,
    and A, watched, does not pull it either, so it measures nothing; C passes over it after
    RELAY_STALL (1 s here) and, with no engine ahead left, takes the generation from the
    trainer (it waited for it for good before). A and B take it afterwards, every byte exact."""
    a, b, c = fleet(3)
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        before = _first_generation(publisher, weights, [a, b, c], 90)
        c.ask("stall", 1.0, 0.5)
        digest = _publish(publisher, weights, 91)
        [after] = _take([c], 1, digest)
        padded = publisher._backend._nbytes
        assert after["trainer"] - before[2]["trainer"] == padded and after["bypassed"] == 1
        late = _take([a, b], 1, digest)
        assert _from_trainer(late, before[:2]) == [padded, 0]  # B from A
        for engine in (a, b, c):
            engine.ask("close")


@contextlib.contextmanager
def _frozen_for(fleet, engine: Driven) -> Iterator[None]:
    """SIGSTOP `engine` until the `with` ends (SIGCONT then, also on failure)."""
    os.kill(engine.proc.pid, signal.SIGSTOP)
    fleet.frozen.add(engine.proc.pid)  # replaced by the fleet if it stays stopped
    try:
        yield
    finally:
        os.kill(engine.proc.pid, signal.SIGCONT)
        fleet.frozen.discard(engine.proc.pid)


def test_a_straggler_is_gone_around_for_its_generation_only(fleet):
    """A -> B -> C. Generation 1: B late to wait(), C goes around it to A. Generation 2: B on
    time and A frozen: C pulls from B again (B takes it from the trainer once A proved silent,
    within B's RELAY_STALL of 1 s, C's being 2 s), so the trainer's memory is read once. (C
    went around B for good before: it pulled from the frozen A, and then from the trainer.)"""
    a, b, c = fleet(3)
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        before = _first_generation(publisher, weights, [a, b, c], 100)
        b.ask("stall", 1.0, 0.5)
        c.ask("stall", 2.0, 0.5)
        digest = _publish(publisher, weights, 101)
        head, went_around = _take([a, c], 1, digest)
        assert went_around["bypassed"] - before[2]["bypassed"] == 1
        [late] = _take([b], 1, digest)
        publisher.wait_acks(1, timeout=TIMEOUT)
        padded = publisher._backend._nbytes
        assert _from_trainer([head, late, went_around], before) == [padded, 0, 0]
        with _frozen_for(fleet, a):
            digest = _publish(publisher, weights, 102)
            after = _take([b, c], 2, digest)
        assert _from_trainer(after, [late, went_around]) == [padded, 0]  # C from B
        for engine in (a, b, c):
            engine.ask("close")


def test_an_engine_ahead_silent_once_is_watched_again_in_the_next_generation(fleet):
    """A -> B -> C. Generation 1: B late to wait() and A frozen: C, watching A, finds it silent
    and takes the generation from the trainer; A is let run again. Generation 2: B frozen: C
    watches A again, and goes around B to it, so the trainer's memory is read once, by A. (C
    passed A over for good before, and took generation 2 from the trainer too.)"""
    a, b, c = fleet(3)
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        before = _first_generation(publisher, weights, [a, b, c], 110)
        c.ask("stall", 1.0, 0.5)
        digest = _publish(publisher, weights, 111)
        with _frozen_for(fleet, a):
            [alone] = _take([c], 1, digest)
        padded = publisher._backend._nbytes
        assert alone["trainer"] - before[2]["trainer"] == padded
        middle = _take([a, b], 1, digest)
        publisher.wait_acks(1, timeout=TIMEOUT)
        c.ask("stall", 30.0, 0.5)  # the trainer only after a minute: A is to answer
        _stop(fleet, b, "frozen")
        digest = _publish(publisher, weights, 112)
        after = _take([a, c], 2, digest)
        assert _from_trainer(after, [middle[0], alone]) == [padded, 0]  # C from A
        assert after[1]["bypassed"] - alone["bypassed"] == 1
        for engine in (a, c):
            engine.ask("close")


def test_an_upstream_as_slow_as_the_engine_ahead_of_it_is_not_gone_around(fleet):
    """A -> B -> C, A slow (its fourth chunk from the trainer comes 5 s late, as over a slow
    link: B passes each chunk on as it comes, and brings none meanwhile). C waits for B past
    its RELAY_STALL of 1 s and its RELAY_LAG of 1.5 s: B is as slow as its own source, not a
    straggler (A holds no chunk that B did not take). Nobody but A reads the trainer's memory,
    every byte exact."""
    a, b, c = fleet(3)
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        before = _first_generation(publisher, weights, [a, b, c], 80)
        a.ask("slow", 3, 5.0)
        c.ask("stall", 1.0, 1.5)
        fleet.frozen.add(a.proc.pid)  # slowed for good: the fleet replaces it afterwards
        digest = _publish(publisher, weights, 81)
        after = _take([a, b, c], 1, digest)
        padded = publisher._backend._nbytes
        assert [x["trainer"] - y["trainer"] for x, y in zip(after, before)] == [padded, 0, 0]
        assert [x["upstream"] - y["upstream"] for x, y in zip(after, before)] == [0, padded, padded]
        assert [x["bypassed"] for x in after] == [0, 0, 0]
        for engine in (a, b, c):
            engine.ask("close")


def test_a_late_engine_joins_the_chain_at_the_next_generation(fleet):
    a, b, late = fleet(3)
    weights = _weights(copy=True)
    with devipc.WeightPublisher(weights, copy=True, transport="nixl", relay=True) as publisher:
        _open(publisher, [a, b])
        for generation in range(2):
            digest = _step(weights, 20 + generation)
            for engine in (a, b):
                engine.send("take")
            publisher.publish(timeout=TIMEOUT)
            for engine in (a, b):
                assert engine.reply()[:2] == (generation, digest)
        _open(publisher, [late])  # copy=True: the newest generation at once, from the trainer
        [counts] = _take([late], 1, digest)
        assert counts["trainer"] > 0 and counts["upstream"] == 0
        digest = _step(weights, 22)
        for engine in (a, b, late):
            engine.send("take")
        publisher.publish(timeout=TIMEOUT)
        assert [r["upstream"] for r in publisher.subscribers().values()] == [-1, 0, 1]
        answers = [engine.reply() for engine in (a, b, late)]
        assert [(g, d) for g, d, _ in answers] == [(2, digest)] * 3
        assert answers[2][2]["upstream"] > 0  # the late one relays from B
        for engine in (a, b, late):
            engine.ask("close")


def test_a_relayed_pull_that_overlapped_a_write_is_dropped(fleet, monkeypatch):
    """In this process, two subscribers (two NIXL endpoints each, as across hosts): B relays
    from A. A pull is dropped, not returned, when its upstream began to overwrite the buffer
    (A's progress word names a newer generation) or the trainer did (`filling` moved)."""
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        a = devipc.WeightSubscriber(publisher.token(), share=False)
        b = devipc.WeightSubscriber(publisher.token(), share=False)
        digest = _b_waits_while_a_overwrites(publisher, weights, a, b)
        pull = b._backend._pull

        def overlapped(generation):
            pulled = pull(generation)
            publisher._backend._words[_remote_token.FILLING] = 1  # the trainer writes
            return pulled

        monkeypatch.setattr(b._backend, "_pull", overlapped)
        with pytest.raises(TimeoutError):
            b.wait(timeout=0.5)
        monkeypatch.undo()
        publisher._backend._words[_remote_token.FILLING] = 0  # generation 0 stable again
        assert b.wait(timeout=TIMEOUT) == 0
        assert b._backend.counts()["upstream"] > 0  # from A, not around it
        assert _digest(b.tensors()) == _digest(a.tensors()) == digest
        a.ack()
        b.ack()
        publisher.wait_acks(0, timeout=TIMEOUT)
        a.close()
        b.close()


@pytest.mark.parametrize("copy", [False, True])
def test_engines_of_one_host_map_the_buffers_of_the_one_that_pulls(fleet, copy):
    """Three engines of one host and device: the first pulls each generation from the trainer,
    the other two read it in its buffers, mapped: no byte is pulled for them, and every byte
    they read is exact."""
    engines = fleet(3)
    weights = _weights(copy)
    with devipc.WeightPublisher(weights, copy=copy, transport="nixl", relay=True) as publisher:
        _open(publisher, engines, share=True)
        digest, counts = _three_generations(
            publisher, weights, engines, 40, [(-1, -1), (-1, 0), (-1, 0)]
        )
        padded = publisher._backend._nbytes
        assert [c["trainer"] for c in counts] == [3 * padded, 0, 0]
        assert [c["upstream"] + c["left"] + c["bypassed"] for c in counts] == [0, 0, 0]
        assert [c["shared"] for c in counts] == [0, 3, 3]
        fds_there = []
        for again in range(2):  # subscribing again, twice: nothing grows the second time
            fds_there.append([engine.ask("close") for engine in engines])
            _open(publisher, engines, share=True)
            if copy:  # late subscribers take the newest generation at once, each its own
                _take(engines, 2 + again, digest)
            digest = _publish(publisher, weights, 43 + again)
            _take(engines, 3 + again, digest)
            publisher.wait_acks(3 + again, timeout=TIMEOUT)
        assert [engine.ask("close") for engine in engines] == fds_there[1]


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_followers_leave_a_killed_or_frozen_leader_and_the_next_engine_leads(
    fleet, monkeypatch, how
):
    """A leads B and C (one host, one device). Once A is killed (its reads fail) or frozen (no
    progress for RELAY_STALL, 1 s here), B and C pull the generation themselves, exact; A is
    named once (ConsumerDiedError) and B then leads: C maps B's buffers."""
    monkeypatch.setattr(_remote_token, "LIVENESS", 2.0)
    a, b, c = fleet(3)
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        pids = _open(publisher, [a, b, c], share=True)
        digest = _publish(publisher, weights, 50)
        _take([a, b, c], 0, digest)
        publisher.wait_acks(0, timeout=TIMEOUT)
        for engine in (b, c):
            engine.ask("stall", 1.0)  # once A is stopped: leave it after 1 s
        _stop(fleet, a, how)
        digest = _publish(publisher, weights, 51)
        counts = _take([b, c], 1, digest)
        assert all(n["left"] == 1 and n["trainer"] > 0 for n in counts), counts
        for engine in (b, c):
            engine.ask("stall", 30.0)  # A stays left
        with pytest.raises(devipc.ConsumerDiedError, match=f"pid {pids[0]}\\)"):
            publisher.wait_acks(1, timeout=TIMEOUT)
        digest = _step(weights, 52)
        for engine in (b, c):
            engine.send("take")
        assert publisher.publish(timeout=TIMEOUT) == 2  # named once: not waited for again
        answers = [engine.reply() for engine in (b, c)]
        assert [(g, d) for g, d, _ in answers] == [(2, digest)] * 2
        places = publisher.subscribers()
        assert [(places[i]["upstream"], places[i]["leader"]) for i in (1, 2)] == [(-1, -1), (-1, 1)]
        assert answers[1][2]["shared"] == 2  # generation 0 in A's buffers, 2 in B's
        for engine in (b, c):
            engine.ask("close")


def test_followers_of_a_frozen_leader_take_the_generation_from_the_engine_ahead_of_it(fleet):
    """X -> A, A leading B and C (one host, one device; X keeps a copy of its own, as on
    another host). Once A is frozen (no progress for RELAY_STALL, 1 s here), B and C leave it
    and pull the generation from X, the engine ahead of A, not from the trainer: the trainer's
    memory is read once for it, by X, and every byte is exact."""
    x, a, b, c = fleet(4)
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        _open(publisher, [x])
        _open(publisher, [a, b, c], share=True)
        digest = _publish(publisher, weights, 55)
        before = _take([x, a, b, c], 0, digest)
        places = publisher.subscribers()
        assert [(places[i]["upstream"], places[i]["leader"]) for i in range(4)] == [
            (-1, -1),
            (0, -1),
            (-1, 1),
            (-1, 1),
        ]
        publisher.wait_acks(0, timeout=TIMEOUT)
        for engine in (b, c):
            engine.ask("stall", 1.0, 30.0)  # once A is stopped: leave it after 1 s
        _stop(fleet, a, "frozen")
        digest = _publish(publisher, weights, 56)
        after = _take([x, b, c], 1, digest)
        padded = publisher._backend._nbytes
        assert _from_trainer(after, [before[0], *before[2:]]) == [padded, 0, 0]  # one copy
        assert [(n["left"], n["upstream"]) for n in after[1:]] == [(1, padded)] * 2  # from X
        for engine in (x, b, c):
            engine.ask("close")


def test_a_follower_reads_its_leaders_memory_and_drops_a_generation_it_overwrites(fleet):
    """In this process, B follows A: B's tensors are A's memory (a write into one shows in the
    other), B holds no buffer of its own, and B does not take a generation whose buffer A
    began to overwrite (A's progress word names a newer one)."""
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        a = devipc.WeightSubscriber(publisher.token())
        b = devipc.WeightSubscriber(publisher.token())
        digest = _b_waits_while_a_overwrites(publisher, weights, a, b)
        assert b.wait(timeout=TIMEOUT) == 0
        assert _digest(b.tensors()) == digest
        assert b._backend._relay is None and b._backend.counts()["shared"] == 1
        a.tensors()["proj"].fill_(3.0)
        torch.accelerator.synchronize()
        assert bool((b.tensors()["proj"] == 3.0).all())
        a.ack()
        b.ack()
        publisher.wait_acks(0, timeout=TIMEOUT)
        a.close()
        b.close()


def test_a_follower_paused_past_liveness_refuses_the_bytes_its_leader_overwrote(fleet, monkeypatch):
    """F follows A and holds generation 0 when it is frozen (SIGSTOP) past LIVENESS (2 s here):
    the publisher names it dead and publishes 1, which A pulls into the buffer F maps. Resumed,
    F's copy_into raises PeerGoneError rather than hand out generation 1's bytes as 0's (and
    nothing is acknowledged)."""
    monkeypatch.setattr(_remote_token, "LIVENESS", 2.0)
    a, f = fleet(2)
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        pids = _open(publisher, [a, f], share=True)
        digest = _publish(publisher, weights, 70)
        _take([a], 0, digest)
        assert f.ask("hold") == 0
        _stop(fleet, f, "frozen")
        with pytest.raises(devipc.ConsumerDiedError, match=f"pid {pids[1]}\\)"):
            publisher.wait_acks(0, timeout=TIMEOUT)
        publisher.wait_acks(0, timeout=TIMEOUT)  # named once: the trainer may write
        digest = _publish(publisher, weights, 71)
        [counts] = _take([a], 1, digest)
        assert counts["trainer"] > 0  # A pulled 1 into its one buffer (copy=False)
        os.kill(f.proc.pid, signal.SIGCONT)
        fleet.frozen.discard(f.proc.pid)
        with pytest.raises(devipc.PeerGoneError, match="generation 0 was overwritten"):
            f.ask("copy")
        with pytest.raises(devipc.PeerGoneError, match="dropped this subscriber"):
            f.ask("take")
        f.ask("close")
        a.ask("close")


def test_a_follower_looks_at_its_leaders_word_after_the_bytes_were_read(fleet, monkeypatch):
    """In this process, B follows A and holds generation 0; A then overwrites that buffer (its
    progress word first, as its pull of a newer generation does) after B's tensors() were
    handed and before B's copy reads them: copy_into raises PeerGoneError (a look before the
    copy would have passed), and so do the end of weights(), tensors(), verify() and ack()."""
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        a = devipc.WeightSubscriber(publisher.token())
        b = devipc.WeightSubscriber(publisher.token())
        publisher.wait_subscribers(2, timeout=TIMEOUT)
        digest = _step(weights, 60)
        publisher.publish(wait=False, checksum=True)
        assert a.wait(timeout=TIMEOUT) == b.wait(timeout=TIMEOUT) == 0
        assert b._backend.counts()["shared"] == 1
        own = {name: torch.empty_like(view) for name, view in b.tensors().items()}
        b.copy_into(own)  # A still holds 0
        assert _digest(own) == digest and dict(b.weights()).keys() == own.keys()
        b.verify()
        copy_into = devipc._weights._publisher.copy_into

        def overwritten_first(source, *args, **kwargs):
            relay = a._backend._relay
            relay.progress[0] = progress_word(1, 0)
            relay.buffers.fill_(7)
            copy_into(source, *args, **kwargs)

        monkeypatch.setattr(devipc._weights._publisher, "copy_into", overwritten_first)
        with pytest.raises(devipc.PeerGoneError, match="generation 0 was overwritten"):
            b.copy_into(own)
        assert _digest(own) != digest  # what the copy read: not generation 0
        for read in (lambda: list(b.weights()), b.tensors, b.verify, b.ack):
            with pytest.raises(devipc.PeerGoneError, match="generation 0 was overwritten"):
                read()
        a.close()
        b.close()


def test_a_follower_that_pulls_once_the_trainer_was_killed_gets_peer_gone(
    fleet, monkeypatch, children
):
    """In this process, B follows A, which does not pull; B leaves A (RELAY_STALL, 0.5 s here)
    and makes its own relay to pull generation 0 from the trainer, which was killed meanwhile:
    PeerGoneError, as every way an engine learns of a dead trainer, not NIXL's failure to
    load its metadata (InvalidHandleError)."""
    monkeypatch.setattr(_relay, "RELAY_STALL", 0.5)
    trainer = Driven(children, _relay_workers.trainer)
    try:
        a, b = (devipc.WeightSubscriber(token) for token in trainer.reply())
        assert trainer.ask("publish") == 0
        own_relay = b._backend._own_relay

        def trainer_killed_first():
            trainer.proc.kill()
            trainer.proc.join(TIMEOUT)
            return own_relay()

        monkeypatch.setattr(b._backend, "_own_relay", trainer_killed_first)
        with pytest.raises(devipc.PeerGoneError, match="cannot be reached"):
            b.wait(timeout=TIMEOUT)
        a.close()
        b.close()
    finally:
        trainer.stop()


def test_an_engine_late_to_wait_with_prefetch_does_not_hold_up_the_chain(fleet):
    """prefetch=True: the head of the chain pulls and passes on a generation while its owner is
    busy elsewhere (it has not called wait()); the engine behind it gets it from it, not from
    the trainer once its upstream stalled, and the late owner's wait() then returns it."""
    late, behind = engines = fleet(2)
    weights = _weights(copy=False)
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        for engine in engines:  # without prefetch: 30 s of stall, then the trainer
            engine.ask("stall", 30.0)
        late.ask("open", publisher.token(), False, True)
        behind.ask("open", publisher.token(), False)
        publisher.wait_subscribers(2, timeout=TIMEOUT)
        digest = _step(weights, 0)
        for engine in engines:
            engine.send("take")
        assert publisher.publish(timeout=TIMEOUT) == 0
        before = [engine.reply()[2] for engine in engines]
        assert [p["upstream"] for p in publisher.subscribers().values()] == [-1, 0]
        digest = _step(weights, 1)
        behind.send("take")  # the late engine's owner is busy: no wait()
        assert publisher.publish(wait=False) == 1
        got, found, pulled = behind.reply()
        assert (got, found) == (1, digest)
        padded = publisher._backend._nbytes
        assert (pulled["trainer"], pulled["bypassed"]) == (before[1]["trainer"], 0)
        assert pulled["upstream"] == before[1]["upstream"] + padded  # from the late engine
        got, found, pulled = late.ask("take")  # prefetched: handed over at once
        assert (got, found) == (1, digest)
        assert pulled["trainer"] == before[0]["trainer"] + padded
        publisher.wait_acks(1, timeout=TIMEOUT)
        for engine in engines:
            engine.ask("close")


@pytest.mark.slow  # 66 NIXL subscribers, each with its agents: 1.5-3 minutes on 2 cores
def test_one_publisher_relays_to_more_than_64_subscribers_every_byte_exact(children, monkeypatch):
    """The cap was 64 subscribers a publisher: 66 here, 33 in each of two processes, each
    with buffers of its own (as on hosts of their own), the chain running through all of them,
    its card slots and records past the 64th."""
    if NIXL is not None:
        pytest.skip(f"NIXL is not installed ({NIXL})")
    use_ucx_loopback(monkeypatch)
    weights = devipc.pack(
        {
            "embed": torch.empty(64, 256, device="openreg"),
            "bias": torch.empty(256, device="openreg"),
        }
    )
    with devipc.WeightPublisher(weights, transport="nixl", relay=True) as publisher:
        groups = [
            children.start_piped(
                _workers.weight_subscribers,
                [publisher.token() for _ in range(33)],
                3,
                30.0,
                {"share": False},
            )[1]
            for _ in range(2)
        ]
        for conn in groups:  # 33 subscribers opened one after the other
            assert recv(conn, 2 * FRESH_TIMEOUT) == "subscribed"
        publisher.wait_subscribers(66, timeout=TIMEOUT)
        for generation in range(3):
            _step(weights, generation)
            expected = _workers.digest(weights)
            assert publisher.publish(timeout=TIMEOUT) == generation  # all 66 acknowledged
            for conn in groups:
                assert recv(conn) == [(generation, expected)] * 33
        places = [r["upstream"] for r in publisher.subscribers().values()]
        assert places == list(range(-1, 65))  # one chain, through every record
        for conn in groups:
            assert recv(conn) == "closed"
        children.join_ok()
    children.reap()


def _b_waits_while_a_overwrites(publisher, weights, a, b) -> str:
    """Generation 0 published and taken by A; B does not take it while A's progress word says
    A overwrites that buffer with generation 1; then A holds 0 whole again. Its digest."""
    publisher.wait_subscribers(2, timeout=TIMEOUT)
    digest = _publish(publisher, weights, 30)
    assert a.wait(timeout=TIMEOUT) == 0
    relay = a._backend._relay
    held = int(relay.progress[0])
    relay.progress[0] = progress_word(1, 0)
    with pytest.raises(TimeoutError):
        b.wait(timeout=0.5)
    relay.progress[0] = held
    return digest


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        digest.update(name.encode() + tensor.cpu().numpy().tobytes())
    return digest.hexdigest()


def test_the_chain_groups_engines_by_host_and_shares_within_a_device():
    members = [(7, 0, 0), (3, 0, 1), (7, 0, 2), (3, 0, 3), (5, 0, 4)]  # (host, share, record)
    places = chain(members)
    order = [1, 3, 4, 0, 2]  # host 3's, host 5's, host 7's: each host entered once
    assert [places[i] for i in order] == [Place(up) for up in [-1, *order[:-1]]]
    assert chain([]) == {}
    assert host_key() == host_key() != 0
    # host 3: records 1 and 3 share key 9, 5 has none (0); host 7: 0, 2 and 6 share key 8
    members = [(7, 8, 0), (3, 9, 1), (7, 8, 2), (3, 9, 3), (3, 0, 5), (7, 8, 6)]
    assert chain(members) == {
        5: Place(-1),
        1: Place(5),
        3: Place(-1, 1),
        0: Place(1),
        2: Place(-1, 0),
        6: Place(-1, 0),
    }
    key = share_key(torch.device("cpu"))
    assert key == share_key(torch.device("cpu")) != share_key(torch.device("openreg", 0))
    assert key != 0


def test_a_chunk_is_a_fraction_of_a_generation_within_bounds():
    assert chunk_size(64 << 20) == 512 << 10
    assert chunk_size(1 << 20) == 128 << 10
    assert chunk_size(16 << 20) == 128 << 10  # 1/128
    assert chunk_size(100) == 100  # one chunk
    assert chunk_size(1 << 40) == 16 << 20


class _Progress:
    """A peer's progress word as a watch reads it: each read answers at once, or, while
    `answer` is clear, not until it is set (a frozen engine)."""

    def __init__(self, word: int):
        self.word, self.reads = word, 0
        self.answer, self.asked = threading.Event(), threading.Event()
        self.answer.set()

    def read(self, local: torch.Tensor, desc: bytes, offset: int) -> None:
        self.reads += 1
        self.asked.set()
        assert self.answer.wait(TIMEOUT)
        local[0] = self.word


def _watch_of(progress: _Progress) -> "_relay._Watch":
    peer = SimpleNamespace(connection=progress, card=SimpleNamespace(progress=b""))
    return _relay._Watch(b"slot", peer, torch.zeros(1, dtype=torch.int64), 3, 1)


def test_a_watch_stopped_between_reads_says_none_is_under_way(monkeypatch):
    """A watch whose thread sleeps between two reads when it is stopped (long, as a thread
    waits to run on a loaded host) reads no more and says no read is under way, so its word is
    used again (a 10 ms join took it for one under way: a word set aside and a connection made
    anew each time). One stopped in a read that has not ended says so until the read ends."""
    resting = threading.Event()

    class Slow(_relay.Backoff):
        def pause(self) -> None:
            resting.set()
            threading.Event().wait(0.5)

    monkeypatch.setattr(_relay, "Backoff", Slow)
    progress = _Progress(_relay.progress_word(3, 7))
    watch = _watch_of(progress)
    assert resting.wait(TIMEOUT) and watch.chunks == 7 and watch.pulling
    assert watch.stop() is False and not watch.busy()
    watch.thread.join(TIMEOUT)
    assert progress.reads == 1

    frozen = _Progress(_relay.progress_word(3, 0))
    frozen.answer.clear()
    watch = _watch_of(frozen)
    assert frozen.asked.wait(TIMEOUT)
    assert watch.stop() is True and watch.busy()
    frozen.answer.set()
    watch.thread.join(TIMEOUT)
    assert not watch.busy() and frozen.reads == 1


def test_a_card_reads_back_from_its_slot_and_damage_is_refused():
    card = Card(b"metadata", b"progress", (b"buffer 0", b"buffer 1"))
    slot = card.to_slot().ljust(CARD_BYTES, b"\0")
    assert Card.from_slot(slot) == card and written(slot) and not written(bytes(CARD_BYTES))
    shared = card._replace(local=b"ipc", local_progress=b"words", local_buffers=(b"0", b"1"))
    assert Card.from_slot(shared.to_slot()) == shared
    for damaged in (
        bytes(CARD_BYTES),
        slot[:20],
        slot[:8] + b"x" + slot[9:],
        (CARD_BYTES).to_bytes(8, "little") + slot[8:],
    ):
        with pytest.raises(devipc.InvalidHandleError):
            Card.from_slot(damaged)
    with pytest.raises(ValueError, match="subscribe without relay"):
        Card(b"x" * CARD_BYTES, b"", (b"",)).to_slot()
    assert _wire.KIND_NAMES[_wire.RELAY_CARD] == "relay card"


def test_relay_is_refused_on_one_host():
    with pytest.raises(ValueError, match="transport='nixl'"):
        devipc.WeightPublisher(devipc.pack({"w": torch.zeros(4)}), relay=True)


def test_the_relay_soak_smoke_run_holds_every_engines_bytes_under_pauses_and_kills(monkeypatch):
    """benchmarks/relay_soak.py, bounded: 4 engines (a leader, two followers, a copy) take 30
    generations while engines are paused within and past LIVENESS (1.5 s), killed and joined;
    every engine's copy of each generation it took is checked, none is wrong, and no engine
    fails other than with PeerGoneError."""
    if NIXL is not None:
        pytest.skip(f"NIXL is not installed ({NIXL})")
    use_ucx_loopback(monkeypatch)
    liveness = _remote_token.LIVENESS
    result = relay_soak.run(engines=4, generations=30, seed=1, every=0.5)
    assert result["wrong"] == [] and result["errors"] == [], result
    assert result["checked"] >= 20 and result["events"], result
    assert _remote_token.LIVENESS == liveness  # the run's own 1.5 s, given back


def _no_cluster() -> str | None:
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "the emulated cluster needs ip and tc (iproute2)"
    return NIXL and f"NIXL is not installed ({NIXL})"


@pytest.mark.skipif(_no_cluster() is not None, reason=str(_no_cluster()))
def test_the_emulated_cluster_smoke_run_delivers_every_engines_bytes():
    """benchmarks/fleet_relay.py --smoke: 2 hosts x 2 engines in network namespaces with
    rate-limited links, relay and one-hop, every engine's bytes checked; nothing left behind."""
    with subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "benchmarks", "fleet_relay.py"), "--smoke"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as run:
        try:
            stdout, stderr = run.communicate(timeout=4 * FRESH_TIMEOUT)
        finally:
            run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert "every engine's bytes exact in 2 settings" in stdout
    # its namespaces are named after its pid: another run's (beside this suite) are not its own
    after = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert [name for name in after if name.startswith(f"dvf{run.pid % 100000}h")] == []
