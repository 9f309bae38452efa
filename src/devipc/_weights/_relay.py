"""The relay of a generation along a chain of subscribers across hosts (`WeightPublisher(...,
transport="nixl", relay=True)`), so that each byte leaves the trainer's host once.

The publisher arranges its attached subscribers in a chain grouped by host (`chain`,
`host_key`) and writes each one's upstream into its record before it publishes: the first pulls
from the trainer, every other one from the subscriber before it. A generation moves in chunks:
one word of a subscriber's registered memory per buffer (`progress`) says which generation the
buffer holds and how many of its chunks, and its downstream polls that word with one-sided
reads and pulls each chunk as soon as it is there. The time to K engines is about one copy's
plus a few chunks', not K copies'.

Every read lands in a staging area and is copied into the buffer only once it is known good: a
chunk read from an upstream once the upstream's progress word, read after it, still names the
generation (an upstream overwrites a buffer only for a newer generation, and says so first; the
pull is then dropped, as a torn one would be). A read that did not end (an upstream frozen,
Ctrl-C) may land later: its staging area is set aside for good, never reused.

An upstream whose connection fails (it died or closed), or whose card cannot be read, is
bypassed at once; one that brings no new chunk is judged against the engine ahead of it in the
chain (`_Watch`): it is a straggler once that engine has held a chunk it did not pass on for
RELAY_LAG seconds, and is bypassed then; an upstream whose own source holds no more is as slow
as the chain and is waited for. The rest of the generation comes from the nearest engine ahead
that answers (the publisher's records name each one's upstream), and from the trainer only when
none does: after RELAY_STALL seconds without a new chunk for each hop to the trainer. An
upstream that failed is not used again until the publisher names another; a straggler, or an
engine ahead that did not answer, is gone around in that pull, and in later ones only while a
read of it has not ended. Whichever way the chunks came, the subscriber's own look at the
trainer's header after the pull says whether the trainer overwrote the generation meanwhile.

Engines of one host and device (`share_key`) hold one copy: the first of them in the chain
pulls (its leader), the others (`Follower`) map its buffers through devipc's same-host path and
read each generation there once the leader's progress word says it is whole. They leave a leader
as a relay leaves an upstream (dead, closed, or RELAY_STALL without progress) and pull that
generation themselves. An engine makes buffers of its own only when it first pulls. A leader
overwrites a buffer only for a newer generation, which is published only once its followers
acknowledged what they hold there or were named dead (a follower paused past LIVENESS): a
follower looks at the leader's progress word again after the bytes were read (`Follower.holds`),
and refuses them if the word moved meanwhile, as a seqlock does.

A subscriber's card (its endpoint's metadata, the descriptors of its progress words and of its
buffers, for NIXL and for the same-host path) lies in a slot of the publisher's registered
memory, written before it first pulls and read by its downstream and its followers at each
generation they take from it.
"""

import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Generic, NamedTuple, Protocol, TypeVar

import torch

from .. import p2p
from .._core import _wire
from .._core._backoff import SLICE, Backoff, polling
from .._core._devices import synchronize
from .._core._errors import InvalidHandleError, PeerGoneError
from .._core._hooks import sharing_hooks
from .._core._memfd import host_identity

__all__ = [
    "CARD_BYTES",
    "RELAY_LAG",
    "RELAY_STALL",
    "Card",
    "Follower",
    "Member",
    "Moved",
    "Place",
    "Relay",
    "chain",
    "chunk_size",
    "chunks_of",
    "host_key",
    "progress_word",
    "share_key",
    "written",
]

# seconds an upstream may leave untaken a chunk that the engine ahead of it holds: then it is a
# straggler, gone around to that engine (and an engine ahead that does not answer a read of
# its progress word for as long is passed over)
RELAY_LAG = 0.5
# seconds without a new chunk, for each hop to the trainer, after which an engine whose every
# engine ahead is silent goes to the trainer (a leader's followers leave it after this too)
RELAY_STALL = 2.0
CARD_BYTES = 16 << 10  # a card's slot in the publisher's memory
DEPTH = 4  # chunks in flight from the trainer (and staging slots)
# chunks in flight from an upstream: one; two in parallel share the link and each lands later
# (measured: 8 engines on 8 emulated hosts, 1.85 s a generation with one, 1.98 with three)
AHEAD = 1
_NEWER = b"newer"  # `Relay._follow`: an engine ahead holds a newer generation
_CHUNKS = 1 << 24  # a progress word is (generation + 1) * _CHUNKS + the chunks held; 0: none


def host_key() -> int:
    """This host as the chain groups subscribers (never 0): its boot id and this process's
    network namespace, so that namespaces with links of their own (an emulated cluster, a
    container's network) count as hosts."""
    parts = []
    for read in (
        lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        lambda: os.readlink("/proc/self/ns/net"),
    ):
        try:
            parts.append(read())
        except OSError:
            parts.append("")
    digest = hashlib.blake2b("|".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2 | 1


def share_key(device: torch.device) -> int:
    """The engines that may map each other's buffers: same host and PID namespace (devipc's
    same-host path reaches them), same device; 0 (none) for a device whose memory other
    processes cannot map (no IPC hooks)."""
    if device.type != "cpu" and sharing_hooks(device.type) is None:
        return 0
    try:
        namespace = os.readlink("/proc/self/ns/net")
    except OSError:
        namespace = ""
    digest = hashlib.blake2b(
        host_identity() + f"|{namespace}|{device}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> 2 | 1


def chunk_size(nbytes: int) -> int:
    """The relay's chunk for a generation of `nbytes`: about 1/128 of it (each hop of a chain
    adds about a chunk's time, and a little per chunk), 128 KiB to 16 MiB, in whole pages."""
    chunk = min(16 << 20, max(128 << 10, nbytes // 128))
    return min(-(-chunk // 4096) * 4096, max(nbytes, 1))


class Member(NamedTuple):
    """An attached subscriber as the chain places it (ordered by host, then share key)."""

    host: int  # its `host_key`
    share: int  # its `share_key` (0: it maps no other engine's buffers)
    record: int  # its record's index


class Place(NamedTuple):
    """A subscriber's place in the relay: the record it pulls from (-1: the trainer), or the
    record whose buffers it maps instead (its leader; -1: none, it pulls)."""

    upstream: int
    leader: int = -1


def chain(members: Iterable[Member]) -> dict[int, Place]:
    """Each member's place, by its record's index: grouped by host, so that a host's link
    carries a generation in once and out at most once; of those that may map each other's
    buffers (one share key, not 0), the first pulls and the others map its buffers."""
    places: dict[int, Place] = {}
    leaders: dict[tuple[int, int], int] = {}
    previous = -1
    for host, share, index in sorted(members):
        leader = leaders.get((host, share), -1) if share else -1
        if leader >= 0:
            places[index] = Place(-1, leader)
            continue
        leaders[(host, share)] = index
        places[index] = Place(previous)
        previous = index
    return places


def progress_word(generation: int, chunks: int) -> int:
    return (generation + 1) * _CHUNKS + chunks


def chunks_of(nbytes: int, chunk: int) -> int:
    """How many chunks a generation of `nbytes` moves in."""
    return max(1, -(-nbytes // chunk))


class Card(NamedTuple):
    """How a downstream reaches a subscriber: its endpoint, its progress words, its buffers;
    and how an engine of its host and device maps them (an endpoint of devipc's same-host path
    and its descriptors of the same words and buffers; empty where they cannot be mapped)."""

    metadata: bytes
    progress: bytes
    buffers: tuple[bytes, ...]
    local: bytes = b""
    local_progress: bytes = b""
    local_buffers: tuple[bytes, ...] = ()

    def to_slot(self) -> bytes:
        """The card as its slot holds it: its length (8 bytes), then the card."""
        writer = _wire.Writer(_wire.RELAY_CARD)
        for part in (self.metadata, self.progress, self.local, self.local_progress):
            writer.bytes(part, CARD_BYTES)
        for descs in (self.buffers, self.local_buffers):
            writer.int(len(descs))
            for desc in descs:
                writer.bytes(desc, CARD_BYTES)
        data = writer.done()
        if len(data) > CARD_BYTES - 8:
            raise ValueError(
                f"this subscriber's relay card takes {len(data)} bytes, more than "
                f"the {CARD_BYTES - 8} of its slot (its NIXL endpoint's metadata "
                f"is that large: it lists every devipc registration of this process, "
                f"and each subscriber adds a few): subscribe without relay, or hold "
                f"fewer subscribers in one process (about 50 fit)"
            )
        return len(data).to_bytes(8, "little") + data

    @classmethod
    def from_slot(cls, slot: bytes | bytearray | memoryview) -> "Card":
        length = int.from_bytes(slot[:8], "little")
        if not 0 < length <= len(slot) - 8:
            raise InvalidHandleError(f"no relay card in this slot (length {length})")
        reader = _wire.Reader(bytes(slot[8 : 8 + length]), (_wire.RELAY_CARD,), "relay card")
        metadata, progress, local, local_progress = [
            reader.bytes(what, CARD_BYTES)
            for what in (
                "endpoint metadata",
                "progress descriptor",
                "same-host endpoint metadata",
                "same-host progress descriptor",
            )
        ]
        buffers = _descriptors(reader, "buffer", 1)
        local_buffers = _descriptors(reader, "same-host buffer", 0)
        reader.end()
        return cls(metadata, progress, buffers, local, local_progress, local_buffers)


def _descriptors(reader: _wire.Reader, what: str, least: int) -> tuple[bytes, ...]:
    """A card's count of buffer descriptors (`least` to 2), then the descriptors."""
    count = reader.int(f"{what} count", least, 2)
    return tuple(reader.bytes(f"{what} descriptor", CARD_BYTES) for _ in range(count))


def written(slot: bytes | bytearray | memoryview) -> bool:
    """Whether a card slot holds anything yet (its subscriber writes it before it first
    pulls)."""
    return int.from_bytes(slot[:8], "little") != 0


class _Peer(Protocol):
    """What `_ByCard` keeps of a peer: the card slot it was opened from, its connection."""

    @property
    def slot(self) -> bytes: ...

    @property
    def connection(self) -> p2p.Connection: ...


_P = TypeVar("_P", bound=_Peer)


class _Source(NamedTuple):
    """An upstream a relay pulls from: its card slot, the connection, its card."""

    slot: bytes
    connection: p2p.Connection
    card: Card


class _Leader(NamedTuple):
    """A leader a follower maps: its card slot, the connection, its card, its buffers and
    progress words mapped."""

    slot: bytes
    connection: p2p.Connection
    card: Card
    buffers: list[torch.Tensor]
    progress: torch.Tensor


class _ByCard(Generic[_P]):
    """The peer whose card a slot holds, opened by `get`'s `open_(slot)` (a `_Peer`: the slot,
    its connection, what else the opener keeps) and kept while the slot the publisher names
    stays the same; a slot whose card could not be opened, or whose peer failed (`avoid`), is
    not opened again until the publisher names another. (The opener is not kept: its owner
    would be in a reference cycle, its memory freed only by the garbage collector.)"""

    def __init__(self, avoided: set[bytes] | None = None) -> None:
        self.held: _P | None = None
        self._avoided: set[bytes] = set() if avoided is None else avoided  # may be shared

    def get(self, slot: bytes, open_: Callable[[bytes], _P]) -> _P | None:
        if self.held is not None and self.held.slot == slot:
            return self.held
        if slot in self._avoided:
            return None
        self.drop()
        try:
            self.held = open_(slot)
        except Exception:  # noqa: BLE001 - a card unreadable, a peer unreachable: avoided
            self._avoided.add(slot)
            return None
        return self.held

    def avoid(self, slot: bytes) -> None:
        """The peer of `slot` failed: let go of it, and do not open it again."""
        self._avoided.add(slot)
        self.drop()

    def abandon(self, slot: bytes) -> None:
        """Let go of the peer of `slot` without closing its connection (a read of it may still
        be in flight; its endpoint's end closes it)."""
        if self.held is not None and self.held.slot == slot:
            self.held = None

    def drop(self) -> None:
        """Let go of the peer held now (its connection closed)."""
        if self.held is not None:
            self.held.connection.close()
            self.held = None


class Moved(Exception):
    """The upstream (or leader) overwrites the buffer with a newer generation: this one is no
    longer the newest, the pull is dropped."""


class _Stopped(Exception):
    """The relay stopped waiting for this upstream."""


class _Upstream:
    """One generation's pull from an upstream, in a thread of its own: an upstream that stopped
    answering (frozen: a read of it never ends) holds up nothing, as the relay stops waiting
    for it after RELAY_STALL seconds without a new chunk.
    It commits under `lock` only while not `stopped`, so nothing lands once the relay took
    over."""

    def __init__(
        self,
        relay: "Relay",
        connection: p2p.Connection,
        card: Card,
        generation: int,
        buffer: int,
        start: int,
    ):
        self._relay, self._connection, self._card = relay, connection, card
        self._generation, self._buffer = generation, buffer
        self._staging, self._word = relay.staging()  # set aside by the relay if abandoned
        self.lock = threading.Lock()
        self.done = start  # chunks committed (those before `start` came from elsewhere)
        self.news = time.monotonic()  # when the last chunk came (or the pull began)
        self.stopped = self.moved = self.ended = self.failed = False
        self.endpoint: p2p.Endpoint | None = None  # handed over: closed when the thread ends
        self.thread = threading.Thread(target=self._run, daemon=True, name="devipc-relay-upstream")
        self.thread.start()

    def _run(self) -> None:
        try:
            self._pull()
        except Moved:
            self.moved = True
        except _Stopped:
            pass
        except Exception:  # noqa: BLE001 - the upstream failed (died, closed): bypassed
            self.failed = True
        finally:
            with self.lock:
                self.ended, endpoint = True, self.endpoint
            if endpoint is not None:
                endpoint.close()

    def _pull(self) -> None:
        """Reads of the chunks the upstream holds, AHEAD in flight; a chunk that landed is
        committed once a progress word read after it still names the generation."""
        relay, card, buffer, generation = self._relay, self._card, self._buffer, self._generation
        in_flight: deque = deque()  # the reads, in chunk order
        landed, after = 0, self.done  # chunks landed and not yet committed; the next to read
        backoff = polling()
        while not self.stopped:
            while in_flight and in_flight[0].done():
                in_flight.popleft()
                landed += 1
            known = landed  # these landed before the word below is read
            self._read(self._word, card.progress, buffer * 8)
            held, chunks = divmod(int(self._word[0]), _CHUNKS)
            if held - 1 > generation:
                raise Moved
            if held - 1 == generation:
                with self.lock:
                    if self.stopped:
                        return
                    for index in range(self.done, self.done + known):
                        slot = (index % DEPTH) * relay.chunk
                        relay.commit(generation, buffer, index, self._staging[slot:], "upstream")
                    if known:
                        self.done, self.news, landed = (
                            self.done + known,
                            time.monotonic(),
                            landed - known,
                        )
                if self.done == relay.chunks:
                    return
                while after < chunks and after - self.done < AHEAD:
                    low, high = relay.span(after)
                    slot = (after % DEPTH) * relay.chunk
                    in_flight.append(
                        self._connection.read_async(
                            self._staging[slot : slot + high - low], card.buffers[buffer], low
                        )
                    )
                    after += 1
            if in_flight:  # nothing to do before it lands: then a word read after it
                _finish(in_flight[0], self._check)
                continue
            if known:  # the upstream's next chunk is due soon: look again soon
                backoff = Backoff(None, first=0.0001, longest=0.001)
            backoff.pause()

    def _check(self) -> None:
        if self.stopped:
            raise _Stopped

    def _read(self, local: torch.Tensor, desc: bytes, offset: int) -> None:
        _finish(self._connection.read_async(local, desc, offset), self._check)

    def stop(self, endpoint: p2p.Endpoint | None) -> bool:
        """Stop it; True if its thread still runs: it then closes `endpoint` (the one its reads
        went through, where one may still land) when it ends."""
        with self.lock:
            self.stopped = True
            if self.ended:
                return False
            self.endpoint = endpoint
            return True


class _Watch:
    """The progress word of an engine ahead of the upstream, read over and over in a thread of
    its own (a read of a frozen engine never ends): what it holds of the generation pulled, to
    judge the upstream against."""

    def __init__(
        self, slot: bytes, peer: "_Source", word: torch.Tensor, generation: int, buffer: int
    ):
        self.slot, self._peer, self._word = slot, peer, word
        self._generation, self._buffer = generation, buffer
        self.chunks = -1  # of the generation, that engine holds (-1: not read yet)
        self.newer = False  # it holds a newer generation there
        self.pulling = False  # its word names the generation (it pulls it, or holds it)
        self.began = self.answered = time.monotonic()  # (answered: when a read last ended)
        self.stopped = self.failed = self.reading = False
        self._lock = threading.Lock()  # `stopped` and `reading` change together
        self.thread = threading.Thread(target=self._run, daemon=True, name="devipc-relay-watch")
        self.thread.start()

    def _run(self) -> None:
        backoff = Backoff(None, first=0.001, longest=0.005)
        try:
            while True:
                with self._lock:
                    if self.stopped:
                        return
                    self.reading = True
                try:
                    self._peer.connection.read(
                        self._word, self._peer.card.progress, self._buffer * 8
                    )
                finally:
                    with self._lock:
                        self.reading = False
                held, chunks = divmod(int(self._word[0]), _CHUNKS)
                self.newer = held - 1 > self._generation
                self.pulling = held - 1 == self._generation
                self.chunks = chunks if self.pulling else 0
                self.answered = time.monotonic()
                backoff.pause()
        except Exception:  # noqa: BLE001 - it died or closed: passed over
            self.failed = True

    def silent(self) -> bool:
        """Whether it failed, or a read of it has not ended for RELAY_LAG seconds."""
        return self.failed or time.monotonic() - self.answered > RELAY_LAG

    def stop(self) -> bool:
        """Stop it; True if a read into its word is under way (it may still land). A thread
        between reads (asleep, or not yet run on a busy host) reads no more."""
        with self._lock:
            self.stopped = True
            return self.reading

    def busy(self) -> bool:
        """Whether a read of it is still under way (it has not answered since it was stopped)."""
        with self._lock:
            return self.reading


class Relay:
    """A subscriber's part in the relay: it pulls each generation in chunks, from its upstream
    or the trainer, into `buffers` (registered, `count` of `nbytes` bytes) and says how far it
    got in `progress`, which its downstream reads through `endpoint`. It reads through an
    endpoint of its own (one agent that both receives and serves at the link's rate fell
    behind). Its registrations are added to `ids`, the endpoints it makes to `endpoints` (ended
    with the subscriber's)."""

    def __init__(
        self,
        endpoint: p2p.Endpoint,
        trainer: bytes,
        device: torch.device,
        count: int,
        nbytes: int,
        chunk: int,
        ids: list[int],
        endpoints: list[p2p.Endpoint],
        share: bool,
    ):
        if chunk <= 0:
            raise ValueError(f"a relay's chunk is positive, not {chunk}")
        self._ids, self._endpoints = ids, endpoints
        self.count, self.nbytes, self.chunk = count, nbytes, chunk
        self.chunks = chunks_of(nbytes, chunk)
        self.device = torch.device(device)
        self.buffers, buffers_id = p2p.create_tensor((count * nbytes,), torch.uint8, device)
        ids.append(buffers_id)
        self.progress = self._tensor((count,), torch.int64, "cpu").zero_()
        self._staging, self._word = self._new_staging()
        self._set_aside: list[torch.Tensor] = []  # reads may land there: never used again
        self.card = Card(
            endpoint.metadata(),
            endpoint.advertise(self.progress),
            self._advertised(endpoint, buffers_id),
        )
        if share:  # engines of this host and device map the buffers (`Follower`)
            local = p2p.Endpoint(transport="ipc")
            endpoints.append(local)
            self.card = self.card._replace(
                local=local.metadata(),
                local_progress=local.advertise(self.progress),
                local_buffers=self._advertised(local, buffers_id),
            )
        self._trainer_metadata = trainer
        self._reader: p2p.Endpoint | None = None  # reads from the trainer and upstreams
        self._trainer: p2p.Connection | None = None
        self._fresh_reader()
        avoided: set[bytes] = set()  # the cards of peers that failed (died, closed)
        self._upstream: _ByCard[_Source] = _ByCard(avoided)  # the engine pulled from now
        self._ahead: _ByCard[_Source] = _ByCard(avoided)  # the engine ahead of it, watched
        # the cards of peers gone around in this pull (a straggler, one silent), and of those
        # a read of which has not ended since: whether it still has not
        self._passed: dict[bytes, Callable[[], bool]] = {}
        self._watch_word = self._tensor((1,), torch.int64, "cpu")
        # what this process pulled: bytes from the trainer, from upstreams; upstreams bypassed
        self.counts = {"trainer": 0, "upstream": 0, "bypassed": 0}

    def _advertised(self, endpoint: p2p.Endpoint, buffers_id: int) -> tuple[bytes, ...]:
        return tuple(
            endpoint.advertise(buffers_id, b * self.nbytes, self.nbytes) for b in range(self.count)
        )

    def _tensor(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        tensor, reg_id = p2p.create_tensor(shape, dtype, device)
        self._ids.append(reg_id)
        return tensor

    def _new_staging(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self._tensor((DEPTH * self.chunk,), torch.uint8, self.device),
            self._tensor((1,), torch.int64, "cpu"),
        )

    def _fresh_reader(self) -> None:
        """An endpoint to read through, and its connection to the trainer. The trainer's
        metadata reached it when the subscriber opened its token: NIXL failing to load it now
        says that the trainer is gone."""
        self._reader = p2p.Endpoint(transport="nixl")
        self._endpoints.append(self._reader)
        try:
            self._trainer = self._reader.connect(self._trainer_metadata)
        except InvalidHandleError as error:
            raise PeerGoneError(
                f"the trainer's endpoint cannot be reached any more ({error})"
            ) from None

    def staging(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The staging area (chunks, a progress word) for reads now."""
        return self._staging, self._word

    def _aside(self) -> None:
        """Reads into the staging area may still land: it is never used again."""
        self._set_aside += [self._staging, self._word]
        self._staging, self._word = self._new_staging()

    def pull(
        self,
        generation: int,
        trainer_buffer: bytes,
        sources: Iterator[bytes],
        check: Callable[[], None],
    ) -> bool:
        """Pull `generation` into its buffer from the engines whose card slots `sources` gives
        (its upstream, then the engines ahead of it, nearest first; none: the trainer), each
        left when it fails or is a straggler for the next that answers, and from the trainer
        once none is left. False if an engine pulled from or watched holds a newer generation
        (this one is no longer the newest). `check()` runs between waits (it raises once the
        subscriber closes)."""
        buffer = generation % self.count
        self.progress[buffer] = progress_word(generation, 0)  # before the buffer is written
        self._passed = {slot: busy for slot, busy in self._passed.items() if busy()}
        done, slot = 0, next(sources, None)
        while slot is not None and done < self.chunks:
            upstream = None if slot in self._passed else self._upstream.get(slot, self._connect)
            if upstream is None:
                slot = next(sources, None)
                continue
            job = _Upstream(self, upstream.connection, upstream.card, generation, buffer, done)
            try:
                slot = self._follow(job, generation, buffer, sources, check)
            finally:
                if job.stop(self._reader):  # still waiting on the upstream: reads may land
                    self._aside()
                    self._reader = self._trainer = self._upstream.held = self._ahead.held = None
            if job.moved or slot is _NEWER:  # so is its downstream's, which reads this word
                self.progress[buffer] = progress_word(generation + self.count, 0)
                return False
            done = job.done
            if done < self.chunks:
                self.counts["bypassed"] += 1
                if job.failed:  # not used again until the publisher names another
                    self._upstream.avoid(upstream.slot)
                else:  # a straggler: gone around in this pull, and while its pull's thread
                    # runs (it ends once its reads did, as it closes their endpoint)
                    self._passed[upstream.slot] = job.thread.is_alive
        if done < self.chunks:
            self._from_trainer(trainer_buffer, generation, buffer, done, check)
        return True

    def _follow(
        self,
        job: _Upstream,
        generation: int,
        buffer: int,
        sources: Iterator[bytes],
        check: Callable[[], None],
    ) -> bytes | None:
        """Wait for `job` to end, or for its upstream to prove a straggler: quiet for RELAY_LAG
        while the nearest engine ahead that answers (watched) held a chunk it did not pass on
        for RELAY_LAG for each hop between them (an upstream whose own source is silent may be
        going around it: it is given that much longer). The card slot to pull the rest from:
        that engine's, or the next of `sources` once the upstream failed; None (the trainer)
        once no engine ahead answers and the upstream stayed quiet RELAY_STALL for each hop to
        the trainer; _NEWER if the watched engine holds a newer generation. A watched engine
        whose word does not name the generation RELAY_STALL a hop after it was first watched
        (late, or past it) measures nothing: the next one ahead is watched instead."""
        watch: _Watch | None = None
        hops, behind, last = 1, None, job.done  # behind: since when the watched one held more
        try:
            while job.thread.is_alive():
                job.thread.join(SLICE)
                check()
                if job.done != last:
                    last, behind = job.done, None
                if time.monotonic() - job.news <= RELAY_LAG:
                    continue
                if watch is not None and watch.silent():
                    self._unwatch(watch, silent=True)
                    watch, hops = None, hops + 1
                if watch is None:
                    watch = self._watch(sources, generation, buffer)
                    if watch is None:  # none ahead answers: the trainer, after RELAY_STALL a hop
                        if time.monotonic() - job.news > hops * RELAY_STALL:
                            return None
                        continue
                if watch.newer:
                    return _NEWER
                if (
                    watch.chunks >= 0  # (read: not pulling it, not merely not read yet)
                    and not watch.pulling
                    and time.monotonic() - watch.began > hops * RELAY_STALL
                ):
                    # it does not pull this generation (late, or it took a newer one only
                    # where the relay's buffer holds another): no measure, the next one ahead
                    self._unwatch(watch, silent=False)
                    watch, hops = None, hops + 1
                    continue
                if watch.chunks <= job.done:
                    behind = None
                elif behind is None:
                    behind = time.monotonic()
                elif time.monotonic() - behind > hops * RELAY_LAG:
                    return watch.slot
            if job.moved or job.done == self.chunks:
                return None
            if watch is None or watch.silent():  # it failed: the next one ahead that answers
                return next(sources, None)
            return watch.slot
        finally:
            if watch is not None:
                self._unwatch(watch, silent=False)

    def _watch(self, sources: Iterator[bytes], generation: int, buffer: int) -> "_Watch | None":
        """A watch of the next engine of `sources` that can be reached; None once none is
        left."""
        for slot in sources:
            peer = None if slot in self._passed else self._ahead.get(slot, self._connect)
            if peer is not None:
                return _Watch(slot, peer, self._watch_word, generation, buffer)
        return None

    def _unwatch(self, watch: _Watch, silent: bool) -> None:
        """Stop `watch`. An engine that failed is not watched or pulled from again until the
        publisher names another; one that did not answer (`silent`) is passed over in this
        pull, and in later ones while that read has not ended."""
        reading = watch.stop()
        if reading:  # it may still land: the word is never used again
            self._set_aside.append(self._watch_word)
            self._watch_word = self._tensor((1,), torch.int64, "cpu")
            self._ahead.abandon(watch.slot)
        if watch.failed:
            self._ahead.avoid(watch.slot)
        elif silent:
            self._passed[watch.slot] = watch.busy

    def _connect(self, slot: bytes) -> _Source:
        """A connection to the upstream whose card `slot` holds (`_ByCard` keeps it)."""
        card = Card.from_slot(slot)
        if len(card.buffers) != self.count:
            raise InvalidHandleError(
                f"an upstream card of {len(card.buffers)} buffers where this relay has {self.count}"
            )
        if self._reader is None:
            self._fresh_reader()
        assert self._reader is not None
        # an upstream's registrations live as long as its endpoint
        return _Source(slot, self._reader.connect(card.metadata, liveness=False), card)

    def _from_trainer(
        self, desc: bytes, generation: int, buffer: int, start: int, check: Callable[[], None]
    ) -> None:
        """Chunks `start`... from the trainer, DEPTH in flight, each exposed once it landed."""
        if self._trainer is None:
            self._fresh_reader()
        trainer = self._trainer
        assert trainer is not None
        in_flight: deque = deque()
        after = start
        try:
            for index in range(start, self.chunks):
                while after < self.chunks and len(in_flight) < DEPTH:
                    low, high = self.span(after)
                    slot = (after % DEPTH) * self.chunk
                    in_flight.append(
                        (
                            slot,
                            trainer.read_async(self._staging[slot : slot + high - low], desc, low),
                        )
                    )
                    after += 1
                slot, transfer = in_flight[0]
                _finish(transfer, check)
                in_flight.popleft()
                self.commit(generation, buffer, index, self._staging[slot:], "trainer")
        finally:
            if in_flight:
                self._aside()

    def span(self, index: int) -> tuple[int, int]:
        """The bytes of chunk `index`."""
        return index * self.chunk, min(self.nbytes, (index + 1) * self.chunk)

    def commit(
        self, generation: int, buffer: int, index: int, staged: torch.Tensor, source: str
    ) -> None:
        """Chunk `index`, staged from the start of `staged`, into the buffer, then exposed to
        the downstream."""
        low, high = self.span(index)
        self.counts[source] += high - low
        base = buffer * self.nbytes
        self.buffers[base + low : base + high].copy_(staged[: high - low])
        synchronize(self.device)
        self.progress[buffer] = progress_word(generation, index + 1)


class Follower:
    """A subscriber's way to hold generations without pulling them: it maps the buffers of its
    leader (an engine of its host and device that pulls each generation), waits until the
    leader's progress word says the generation is whole there, and reads it in place. A leader
    that died or closed, whose card cannot be mapped, or that brings no new chunk for
    RELAY_STALL seconds is left (`take` returns None: the subscriber pulls that generation
    itself), and is not mapped again until the publisher names another."""

    def __init__(self, endpoints: list[p2p.Endpoint], count: int, nbytes: int, chunks: int):
        # what `take` returned last: its leader's progress words (mapped), the buffer, the word
        # that says the buffer holds the generation whole
        self._held: tuple[torch.Tensor, int, int] | None = None
        self._endpoint = p2p.Endpoint(transport="ipc")
        endpoints.append(self._endpoint)
        self._count, self._nbytes, self._chunks = count, nbytes, chunks
        self._word = torch.zeros(1, dtype=torch.int64)
        # the leader followed now (its card slot, connection, card, mapped buffers); those left
        self._leader: _ByCard[_Leader] = _ByCard()
        self.counts = {"shared": 0, "left": 0}  # generations read in place; leaders left

    def take(self, generation: int, slot: bytes, check: Callable[[], None]) -> torch.Tensor | None:
        """`generation`'s buffer in the leader's memory (its card in `slot`), once the leader
        holds it whole; None if this subscriber is to pull it itself. Moved if the leader
        overwrites that buffer with a newer generation. `check()` runs between looks."""
        leader = self._leader.get(slot, self._connect)
        if leader is None:
            return None
        buffer = generation % self._count
        whole, seen = progress_word(generation, self._chunks), -1
        news = time.monotonic()
        backoff = polling()
        while True:
            check()
            try:
                leader.connection.read(self._word, leader.card.local_progress, buffer * 8)
            except Exception:  # noqa: BLE001 - the leader died or closed: left
                self._leave(slot)
                return None
            word = int(self._word[0])
            if word == whole:
                self.counts["shared"] += 1
                self._held = (leader.progress, buffer, whole)
                return leader.buffers[buffer]
            if word // _CHUNKS - 1 > generation:
                raise Moved
            if word != seen:
                seen, news = word, time.monotonic()
                backoff = polling()
            elif time.monotonic() - news > RELAY_STALL:
                self._leave(slot)
                return None
            backoff.pause()

    def _connect(self, slot: bytes) -> _Leader:
        """The leader whose card `slot` holds, its buffers mapped (`_ByCard` keeps it)."""
        card = Card.from_slot(slot)
        if len(card.local_buffers) != self._count:
            raise InvalidHandleError(
                f"a leader's card maps {len(card.local_buffers)} buffers "
                f"where this subscriber holds {self._count}"
            )
        connection = self._endpoint.connect(card.local)
        try:
            buffers = [connection.map(desc) for desc in card.local_buffers]
            progress = connection.map(card.local_progress)
            if any(b.nbytes != self._nbytes for b in buffers) or progress.nbytes != 8 * self._count:
                raise InvalidHandleError("a leader's buffers are not this publisher's size")
        except BaseException:
            connection.close()
            raise
        return _Leader(slot, connection, card, buffers, progress.view(torch.int64))

    def holds(self) -> bool:
        """Whether the leader's buffer that `take` returned last still holds that generation
        whole: its progress word, mapped (it outlives the leader), still names it. A leader
        names the newer generation in that word before it writes the buffer, so this look,
        after the bytes were read (their device work done), says whether they were all of the
        generation taken."""
        assert self._held is not None, "holds() before take() returned a buffer"
        progress, buffer, whole = self._held
        return int(progress[buffer]) == whole

    def _leave(self, slot: bytes) -> None:
        self.counts["left"] += 1
        self._leader.avoid(slot)

    def drop(self) -> None:
        """Let go of the leader followed now (views handed out keep what they map)."""
        self._leader.drop()
        self._held = None


def _finish(transfer: p2p.Transfer, check: Callable[[], object]) -> None:
    """Wait for `transfer`, sleeping between looks (a spinning wait would take a core from the
    other engines of a host), `check()` every few milliseconds."""
    backoff, looked = Backoff(None, first=0.00005, longest=0.0005), time.monotonic()
    while not transfer.done():
        backoff.pause()
        if time.monotonic() - looked > SLICE:
            check()
            looked = time.monotonic()
