"""`WeightPublisher(..., transport="nixl")` and its subscribers: the publisher's API across hosts,
every byte moved by one-sided NIXL transfers (`devipc.p2p`), the publisher's code taking no part.

The publisher registers two things with a NIXL endpoint: the weights (the packed allocation
itself with `copy=False`, two staging buffers with `copy=True`) and a small host control block
of int64 words:

    header: published generation | filling | the CRC-32s of the last two generations
            (generation | CRC-32, -1: none), each pair rewritten only once nobody holds its
            generation
    record per subscriber: state | pid | host key | share key | serial |
            acknowledged generation | heartbeat | upstream (with relay: the record it pulls
            from, -1: the trainer) | leader (with relay: the record whose buffers it maps, -1:
            none)

With `relay=True` (`_relay`) the subscribers pass each generation on along a chain, engines of
one host and device map the buffers of the one among them that pulls, and a third thing is
registered: one slot per record where its subscriber writes how it is reached.

A token carries the endpoint's metadata, the descriptors of the header, of the subscriber's
record and of the weights, and the table (names, dtypes, shapes, offsets: fixed for the
publisher's life). A subscriber reads the header with small NIXL reads (polling with a backoff
of 0.1 to 2 ms: nothing wakes a process across hosts), pulls a new generation's whole range into
its own memory with one read, then reads the header again: `filling` says whether the publisher
(copy=True) or the trainer (copy=False, once the acks arrived) may have begun to overwrite that
buffer meanwhile; if so the pull is dropped and done again (a seqlock). It writes its claim, its
acks and a heartbeat (a counter, every HEARTBEAT seconds, from a thread) into its record with
one-sided NIXL writes. The publisher waits by looking at its own memory; a subscriber whose
heartbeat stood still for LIVENESS seconds is dead: named once (ConsumerDiedError), then dropped.
A subscriber that attached while the trainer may be writing (copy=False) is not waited for the
published generation, which it cannot get: its first is the next one.

A token is checked whole (every descriptor decoded, its sizes against the weights descriptors it
carries, all of one publisher) before a subscriber allocates or claims anything: a refused token
leaves the genuine one openable. Both objects are thread-safe as on one host: publishes take
turns, and close() from another thread ends the waits under way there with ValueError.
"""
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple, TypeVar

import torch

from . import _handles, _relay, p2p
from ._arena import Calls, counted
from ._backoff import Backoff
from ._checksum import NO_SUM, SUM_WORDS, crc32, pair, published_sum
from ._errors import (
    ChecksumError,
    DevIpcError,
    InvalidHandleError,
    NotRegisteredError,
    PeerGoneError,
    RemoteTensorFreedError,
)
from ._host import share_host, shared_host_storage
from ._readers import (
    ATTACHED,
    CLOSED,
    FREE,
    GONE,
    MAX_READERS,
    PENDING,
    PUBLISHER_WORDS,
    Records,
    acks_timeout,
    attach_timeout,
    attached,
    label,
    unacknowledged,
)
from ._received import synchronize
from ._relay import (
    CARD_BYTES,
    Follower,
    Moved,
    Relay,
    chain,
    chunk_size,
    chunks_of,
    host_key,
    share_key,
    written,
)
from ._table import ALIGNMENT, Table
from ._weights import (
    ACK_TIMEOUT,
    InPlace,
    engine_device,
    fill,
    named_weights,
    token_reader,
    token_writer,
)
from .p2p._descriptor import Descriptor, Metadata
from .p2p._nixl_wire import Remote, agent_metadata_from_bytes

__all__ = ["NixlPublisher", "NixlSubscriber", "RemoteToken"]

_T = TypeVar("_T")

HEARTBEAT = 0.5  # seconds between a subscriber's heartbeats
LIVENESS = 10.0  # seconds of a still heartbeat after which a subscriber counts as dead
_JOIN = 5.0  # seconds a closing subscriber waits for its heartbeat thread
_DESCRIPTOR_BYTES = 1 << 20
_METADATA_BYTES = 1 << 20  # a NIXL agent's metadata
_SLICE = 0.01  # seconds: a pull is waited for in slices, so that close() ends the wait
_PUBLISHED, _FILLING, _SUMS = 0, 1, 2  # header words; from _SUMS, the CRC-32s (`_checksum`)
_HEADER = _SUMS + SUM_WORDS  # words
# a record: what its subscriber writes (state, pid, host key, share key, ack, heartbeat), what
# the publisher writes (serial; the relay's upstream and leader: a record's index, or -1)
_STATE, _PID, _HOST, _SHARE, _SERIAL, _ACK, _BEAT, _UP, _LEADER = range(9)
_FIELDS = 9
_WORDS = _HEADER + MAX_READERS * _FIELDS
# a subscriber's words: where the header and its record land, what it writes
_HEAD, _RECORD = slice(0, _HEADER), slice(_HEADER, _HEADER + _FIELDS)
_CLAIM = slice(_HEADER + _FIELDS, _HEADER + _FIELDS + 4)  # state, pid, host and share keys
_ACKED, _BEATS = slice(_CLAIM.stop, _CLAIM.stop + 1), slice(_CLAIM.stop + 1, _CLAIM.stop + 2)


def _word(index: int, field: int) -> int:
    return _HEADER + index * _FIELDS + field


def _count(words: list[int]) -> int:
    """How many records a copy of the control words (`_known()`) holds."""
    return (len(words) - _HEADER) // _FIELDS


class RemoteToken(NamedTuple):
    """A subscriber's way in across hosts: the publisher's endpoint, its device, a buffer's
    size, the token's serial, its record's index, the relay's chunk (0: no relay), descriptors
    of the control words (the header; the record whole, its claim, its ack, its heartbeat), of
    the relay's cards (empty without relay) and of each buffer, and the tensors' table."""

    metadata: bytes
    device: torch.device
    nbytes: int
    serial: int
    record: int
    chunk: int
    control: tuple[bytes, ...]
    data: tuple[bytes, ...]
    table: Table

    def to_bytes(self) -> bytes:
        writer = token_writer("nixl").bytes(self.metadata, _METADATA_BYTES)
        writer.device(self.device).int(self.nbytes).int(self.serial).int(self.record)
        writer.int(self.chunk)
        for desc in self.control:
            writer.bytes(desc, _DESCRIPTOR_BYTES)
        writer.int(len(self.data))
        for desc in self.data:
            writer.bytes(desc, _DESCRIPTOR_BYTES)
        self.table.write(writer)
        return writer.done()

    @classmethod
    def from_bytes(cls, token: bytes | bytearray | memoryview) -> "RemoteToken":
        _, reader = token_reader(token, "nixl")
        metadata = reader.bytes("publisher endpoint metadata", _METADATA_BYTES)
        device = reader.device()
        nbytes = reader.int("buffer size", 1)
        serial = reader.int("token serial", 1)
        record = reader.int("record index", 0, MAX_READERS - 1)
        chunk = reader.int("relay chunk", 0, max(nbytes, 1))
        control = tuple(reader.bytes("control descriptor", _DESCRIPTOR_BYTES) for _ in range(6))
        data = tuple(reader.bytes("weights descriptor", _DESCRIPTOR_BYTES)
                     for _ in range(reader.int("buffer count", 1, 2)))
        table = Table.read(reader, nbytes)
        reader.end()
        return cls(metadata, device, nbytes, serial, record, chunk, control, data, table)


class NixlPublisher:
    """A WeightPublisher whose subscribers may be on other hosts (`transport="nixl"`).

    Thread-safe: publishes (and tokens) from several threads take turns, each publish its own
    generation; `close()` from another thread ends a `publish`, `wait_acks` or
    `wait_subscribers` under way there with ValueError, and the memory goes once they left."""

    def __init__(self, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor], *,
                 copy: bool = False, relay: bool = False):
        self._source = model_or_state_dict
        items = _handles.named_items(named_weights(model_or_state_dict), "WeightPublisher",
                                     host=True)
        self.copy = bool(copy)
        if self.copy:
            self._table, end = Table.packed(items)
            self._nbytes = -(-max(end, 1) // ALIGNMENT) * ALIGNMENT
            self._buffers = 2
            device = items[0][1].device
            self._storage: torch.UntypedStorage | None = shared_host_storage(
                2 * self._nbytes) if device.type == "cpu" else torch.empty(
                2 * self._nbytes, dtype=torch.uint8, device=device).untyped_storage()
        else:
            self._storage, self._table = _handles.in_place(items)
            self._nbytes, self._buffers = self._storage.nbytes(), 1
            if self._storage.device.type == "cpu":
                share_host(self._storage)  # NIXL's peers map it; moved before InPlace looks
        self._in_place = None if self.copy else InPlace(model_or_state_dict, items,
                                                        self._storage)
        self.device = self._storage.device
        self.generation = -1
        self._calls = Calls("WeightPublisher")
        self._turns = threading.Lock()  # one publish or token at a time
        self._serials = itertools.count(1)
        self._beats: dict[int, tuple[int, int, float]] = {}  # record -> (serial, beat, seen at)
        self._adopted: dict[int, int] = {}  # record -> serial of the subscriber seen attached
        self._used = 0  # records handed out so far (the first ones): those the scans look at
        self.relay = bool(relay)
        self._endpoint = p2p.Endpoint(transport="nixl")
        self._ids: list[int] = []  # registrations this publisher made, ended by close()
        self._let_go = weakref.finalize(self, _let_go, [self._endpoint], self._ids)
        try:
            self._words, control = p2p.create_tensor((_WORDS,), torch.int64, "cpu")
            self._ids.append(control)
            self._words.zero_()
            self._words[_SUMS:_HEADER] = NO_SUM
            self._words[_PUBLISHED] = -1
            self._words[_FILLING] = -1 if self.copy else 0  # copy=False: the trainer writes now
            try:
                data = p2p.get_tensor_id_by_tensor(self._storage)  # the user registered it
            except NotRegisteredError:
                data = p2p.register(self._storage)
                self._ids.append(data)
            self._data = [self._endpoint.advertise(data, b * self._nbytes, self._nbytes)
                          for b in range(self._buffers)]
            self._header = self._control(0, _HEADER)
            self._chunk = chunk_size(self._nbytes) if self.relay else 0
            self._cards, self._cards_desc = torch.empty(0, dtype=torch.uint8), b""
            if self.relay:  # one slot per record, where its subscriber writes its card
                self._cards, cards = p2p.create_tensor((MAX_READERS * CARD_BYTES,),
                                                       torch.uint8, "cpu")
                self._ids.append(cards)  # new fd-backed memory: zeros, untouched until a
                # token's slot is cleared for it (sparse: 16 KiB per subscriber, not 16 MiB)
                self._cards_desc = self._endpoint.advertise(cards)
        except BaseException:
            self._release()
            raise

    def _control(self, word: int, count: int) -> bytes:
        return self._endpoint.advertise(self._ids[0], 8 * word, 8 * count)

    def __len__(self) -> int:
        """How many tensors a generation holds."""
        return len(self._table)

    @counted
    def token(self) -> bytes:
        """One subscriber's way in, on this host or another: open it once with
        `WeightSubscriber`. A token nobody opens keeps its record until the publisher closes."""
        with self._turns:
            return self._token()

    def _token(self) -> bytes:
        words = self._known()
        states = [words[_word(i, _STATE)] for i in range(_count(words))]
        # a record of a dead subscriber last: one that was only frozen may still write into it
        free = [i for i, state in enumerate(states) if state in (FREE, CLOSED)] \
            or [self._used] * (self._used < MAX_READERS) \
            or [i for i, state in enumerate(states) if state == GONE]
        if not free:
            raise ValueError(f"a publisher across hosts has at most {MAX_READERS} tokens "
                             f"open or unopened: close subscribers, or make a new publisher")
        index, serial = free[0], next(self._serials)
        self._used = max(self._used, index + 1)
        for field, value in ((_PID, 0), (_HOST, 0), (_SHARE, 0), (_SERIAL, serial), (_ACK, -1),
                             (_BEAT, 0), (_UP, -1), (_LEADER, -1), (_STATE, PENDING)):
            self._words[_word(index, field)] = value
        if self.relay:
            self._cards[index * CARD_BYTES:(index + 1) * CARD_BYTES] = 0
        control = (self._header, self._control(_word(index, _STATE), _FIELDS),
                   self._control(_word(index, _STATE), 4), self._control(_word(index, _ACK), 1),
                   self._control(_word(index, _BEAT), 1), self._cards_desc)
        return RemoteToken(self._endpoint.metadata(), self.device, self._nbytes, serial, index,
                           self._chunk, control, tuple(self._data), self._table).to_bytes()

    def _known(self) -> list[int]:
        """The control words up to the last record handed out, read once."""
        return self._words[:_word(self._used, 0)].tolist()

    def _arrange(self) -> None:
        """The relay's places for the next generation, over the subscribers attached now (one
        that attaches later pulls it from the trainer)."""
        words = self._known()
        members = [(words[_word(i, _HOST)], words[_word(i, _SHARE)], i)
                   for i in range(_count(words)) if words[_word(i, _STATE)] == ATTACHED]
        for index, place in chain(members).items():
            for field, value in ((_UP, place.upstream), (_LEADER, place.leader)):
                if words[_word(index, field)] != value:
                    self._words[_word(index, field)] = value

    @counted
    def publish(self, *, timeout: float | None = None, checksum: bool = False) -> int:
        """As for one host: the new generation is visible once the device work that wrote it is
        done (`WeightPublisher.publish` waits for the acknowledgements); `checksum` publishes
        its CRC-32 with it."""
        with self._turns:
            if self._in_place is not None:
                self._in_place.check()
            generation = self.generation + 1
            self._wait(generation - self._buffers, ACK_TIMEOUT if timeout is None else timeout)
            if self.copy:
                assert self._storage is not None
                self._words[_FILLING] = generation  # subscribers reading it drop the pull
                fill(self._storage, (generation % 2) * self._nbytes, self._table,
                     named_weights(self._source, detach=False))
            torch.get_device_module(self.device).synchronize(self.device)
            assert self._storage is not None
            word = _SUMS + pair(generation)  # nobody holds generation - 2 any more
            self._words[word + 1] = crc32(self._storage, (generation % self._buffers)
                                          * self._nbytes, self._nbytes) if checksum else NO_SUM
            self._words[word] = generation
            self.generation = generation
            if self.relay:
                self._arrange()
            self._words[_PUBLISHED] = generation
        return generation

    @counted
    def wait_acks(self, generation: int, timeout: float | None = None) -> None:
        """As for one host; dead subscribers are those whose heartbeat stood still for
        LIVENESS seconds. With copy=False, once the newest generation is acknowledged the
        trainer may write: a subscriber still pulling it then pulls again."""
        self._wait(generation, timeout)
        if not self.copy and generation == self.generation:
            self._words[_FILLING] = generation + 1

    def _wait(self, generation: int, timeout: float | None) -> None:
        backoff = Backoff(timeout, first=0.00005, longest=0.001)
        while True:
            self._calls.check()
            records = self._records(self._adopt(), mark=True)
            waiting = unacknowledged(records, generation, PUBLISHER_WORDS)
            if not waiting:
                return
            if backoff.expired():
                raise acks_timeout(records, waiting, timeout, generation, PUBLISHER_WORDS.readers)
            backoff.pause()

    def _records(self, words: list[int], mark: bool = False) -> Records:
        """The records in `words` (the control words, read once) for the scans of `_readers`: a
        subscriber whose heartbeat stood still is dead, marked GONE with `mark`."""
        now = time.monotonic()

        def died(index: int) -> bool:
            if not self._silent(index, words, now):
                return False
            if mark:
                self._words[_word(index, _STATE)] = GONE
            return True

        used = _count(words)
        return Records(lambda i: words[_word(i, _STATE)], lambda i: words[_word(i, _ACK)],
                       lambda i: words[_word(i, _PID)], died, lambda: used)

    def _adopt(self) -> list[int]:
        """The control words, once every subscriber that attached since the last look is no
        longer waited for a generation it cannot get: with copy=False, the published one once
        the trainer may write it. (It acknowledges nothing newer before that is published.)"""
        words = self._known()
        published, filling = words[_PUBLISHED], words[_FILLING]
        for i in range(_count(words)):  # the records of this copy: token() may add one meanwhile
            serial = words[_word(i, _SERIAL)]
            if words[_word(i, _STATE)] != ATTACHED or self._adopted.get(i) == serial:
                continue
            self._adopted[i] = serial
            if filling >= published + self._buffers and words[_word(i, _ACK)] < published:
                self._words[_word(i, _ACK)] = words[_word(i, _ACK)] = published
        return words

    def _silent(self, index: int, words: list[int], now: float) -> bool:
        """Whether the record's heartbeat stood still for LIVENESS seconds of our looking."""
        serial, beat = words[_word(index, _SERIAL)], words[_word(index, _BEAT)]
        seen = self._beats.get(index)
        if seen is None or seen[:2] != (serial, beat):
            self._beats[index] = (serial, beat, now)
            return False
        return now - seen[2] > LIVENESS

    @counted
    def wait_subscribers(self, count: int, timeout: float = 60.0) -> None:
        """Return once `count` subscribers opened their tokens; TimeoutError after `timeout`."""
        backoff = Backoff(timeout, first=0.0001, longest=0.01)
        while True:
            self._calls.check()
            now = attached(self._records(self._known()))
            if now >= count:
                return
            if backoff.expired():
                raise attach_timeout(now, count, timeout, PUBLISHER_WORDS.readers)
            backoff.pause()

    def subscribers(self) -> dict[int, dict]:
        """As for one host; with relay also each one's place for the newest generation: its
        `upstream` in the chain (a record's index; -1: the trainer) and its `leader`, the record
        whose buffers it maps instead of pulling (-1: none)."""
        words = self._known()
        found = {i: {"state": label(state),
                     "acknowledged": words[_word(i, _ACK)], "pid": words[_word(i, _PID)]}
                 for i in range(_count(words)) if (state := words[_word(i, _STATE)]) != FREE}
        if self.relay:
            for index, record in found.items():
                record["upstream"] = words[_word(index, _UP)]
                record["leader"] = words[_word(index, _LEADER)]
        return found

    def close(self) -> None:
        """The registrations and the endpoint go (once calls under way in other threads left):
        subscribers' next reads fail (PeerGoneError, saying so). Idempotent."""
        if self._calls.close():
            self._calls.release(self._release)

    def _release(self) -> None:
        self._let_go()
        self._storage, self._source = None, {}
        self._cards = torch.empty(0, dtype=torch.uint8)  # its fd-backed memory goes
        if hasattr(self, "_words"):  # its fd-backed memory goes; subscribers() still answers
            self._words = self._words.clone()


class NixlSubscriber:
    """A WeightSubscriber of a `transport="nixl"` publisher: each generation is pulled into this
    process's memory, so `tensors()` stay valid until the next `wait()`, not only until `ack()`
    (with `prefetch`, until `ack()`: a thread then pulls the next generation in the background,
    once the engine acknowledged the one it holds).

    Thread-safe: its calls from several threads take turns; `close()` from another thread ends a
    `wait` under way there with ValueError (within a poll, or once the pull under way ended)."""

    def __init__(self, token: bytes | bytearray | memoryview,
                 device: torch.device | str | int | None = None, share: bool = True,
                 prefetch: bool = False):
        metadata, publisher_device, nbytes, serial, index, chunk, control, data, self._table = \
            RemoteToken.from_bytes(token)
        header, record, claim, ack, beat, self._cards = control
        self._buffers, self._data = len(data), list(data)
        cards = [(self._cards, MAX_READERS * CARD_BYTES)] if chunk else []
        _check_descriptors(metadata, [*zip((header, record, claim, ack, beat, *self._data), (
            8 * _HEADER, 8 * _FIELDS, 32, 8, 8, *[nbytes] * self._buffers)), *cards])
        self.device = engine_device(publisher_device, device)
        self.generation = -1
        self._calls = Calls("WeightSubscriber")
        self._turns = threading.Lock()
        self._torn = False  # a pull into `_local` started and did not end (Ctrl-C)
        self._cut: p2p.Transfer | None = None  # that pull's read, while it may be in flight
        self._header_seen: list[int] = []  # the header at the last poll
        self._checksum: int | None = None  # published with the held generation
        self._acked = -1  # the newest generation the engine acknowledged
        # (generation, its checksum) pulled by the prefetch thread, not yet handed to wait()
        self._prefetched: tuple[int, int | None] | None = None
        self._prefetch_error: Exception | None = None  # met there, for the next wait() to raise
        self._header, self._record, self._claim, self._ack = header, record, claim, ack
        self._nbytes, self._index, self._chunk, self._metadata = nbytes, index, chunk, metadata
        # where the held generation lies: this process's memory, or its leader's (relay:
        # `_in_leader`); the views of the places it lay (by address: each keeps its memory)
        self._held_at = torch.empty(0, dtype=torch.uint8)
        self._in_leader = False
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._relay: Relay | None = None  # made when this subscriber first pulls (`_own_relay`)
        self._follower: Follower | None = None
        # engines of one share key map the buffers of the one that pulls (0: this one pulls)
        self._share = share_key(self.device) if chunk and share else 0
        self._ids: list[int] = []
        self._stop = threading.Event()
        self._publisher_gone = False  # its words unreadable: nothing more is posted to it
        self._heart: list[threading.Thread] = []
        # two agents: a heartbeat through the one that pulls would wait for the whole pull
        self._endpoints: list[p2p.Endpoint] = []
        self._let_go = weakref.finalize(self, _let_go, self._endpoints, self._ids, self._stop,
                                        self._heart)  # dropped unclosed: its agents go too
        try:
            self._connection, beats = (_connect(self._endpoints, metadata) for _ in range(2))
            self._words, words_id = p2p.create_tensor((_BEATS.stop,), torch.int64, "cpu")
            self._ids.append(words_id)
            self._local = torch.empty(0, dtype=torch.uint8)  # one-hop pulls land here
            if not chunk:
                self._local, local_id = p2p.create_tensor((nbytes,), torch.uint8, self.device)
                self._ids.append(local_id)
            _, _, state = self._poll()
            if state != PENDING or int(self._words[_RECORD][_SERIAL]) != serial:
                raise InvalidHandleError("this weight token was already opened (one token per "
                                         "subscriber), or its record was reused")
            if chunk:
                self._card, card_id = p2p.create_tensor((CARD_BYTES,), torch.uint8, "cpu")
                self._ids.append(card_id)
                if self._share:
                    self._follower = Follower(self._endpoints, self._buffers, nbytes,
                                              chunks_of(nbytes, chunk))
                else:  # its card first: a downstream may read it once the claim is seen
                    self._own_relay()
            self._words[_CLAIM] = torch.tensor([ATTACHED, os.getpid(),
                                                host_key() if chunk else 0, self._share])
            self._remote(lambda: self._connection.write(self._words[_CLAIM], claim))
            self._heart.append(threading.Thread(
                target=_heartbeat, daemon=True, name="devipc-weights-heartbeat",
                args=(beats, self._words[_BEATS], beat, self._stop)))
            self._heart[0].start()
            if prefetch:
                self._heart.append(threading.Thread(
                    target=_prefetching, daemon=True, name="devipc-weights-prefetch",
                    args=(weakref.ref(self), self._stop)))
                self._heart[1].start()
        except BaseException:
            self._release()
            raise

    @staticmethod
    def _remote(transfer: Callable[[], _T]) -> _T:
        """One NIXL transfer, its failures said as the publisher's state."""
        try:
            return transfer()
        except RemoteTensorFreedError:
            raise PeerGoneError("the weight publisher closed: nothing more will be published "
                                "(ask a new publisher for a token)") from None
        except PeerGoneError as error:
            raise PeerGoneError(f"the weight publisher closed, exited or cannot be reached "
                                f"(its host is down or unreachable): {error}") from None
        except DevIpcError as error:
            if type(error) is not DevIpcError:  # a damaged handle, a size: not the peer's state
                raise
            # NIXL's transfer failed for no reason it names (p2p says "NIXL failed: ..."):
            # with the publisher's memory, as when its agent goes mid-transfer
            raise PeerGoneError(f"the weight publisher exited or cannot be reached: "
                                f"{error}") from None
        except Exception as error:
            if not type(error).__module__.startswith("nixl"):
                raise
            # devipc.p2p lets some of NIXL's own errors through (a peer that disconnects during
            # its liveness read): the same news
            raise PeerGoneError(f"the weight publisher exited or cannot be reached: NIXL says "
                                f"{type(error).__name__}: {error}") from None

    def _poll(self) -> tuple[int, int, int]:
        """(published, filling, this record's state), one NIXL read. A publisher found closed or
        gone is posted nothing more, no heartbeat and no unsubscribe: NIXL logs an error for
        each post to an agent that disconnected, as a closing publisher's does right after."""
        try:
            self._remote(lambda: self._connection.readv(
                [self._words[_HEAD], self._words[_RECORD]], [self._header, self._record]))
        except PeerGoneError:
            self._publisher_gone = True
            self._stop.set()
            raise
        words = self._words[:_HEADER + 1].tolist()
        self._header_seen = words[:_HEADER]
        return words[_PUBLISHED], words[_FILLING], words[_HEADER + _STATE]

    def _pull(self, generation: int) -> bool:
        """A generation held here: through the relay (False if its upstream or leader has a
        newer one) or with one NIXL read, waited for in slices (another thread's close() and
        Ctrl-C end the wait). A read cut short (Ctrl-C) may still write into its memory: the
        next pull first waits for it to end, then reads into the same memory (new memory if
        the read was cut inside its own post; the relay sets its staging area aside
        instead)."""
        data = self._data[generation % self._buffers]
        if self._chunk:
            self._torn = True
            pulled = self._relayed(generation, data)
            self._torn = False
            return pulled
        if self._torn and not self._cut_ended():
            p2p.deregister(self._ids.pop())  # the local buffer's registration is the last
            self._views.clear()
            self._local, local_id = p2p.create_tensor(self._local.shape, torch.uint8,
                                                      self.device)
            self._ids.append(local_id)
        self._torn = True
        self._cut = transfer = self._remote(
            lambda: self._connection.read_async(self._local, data))
        while True:
            try:
                self._remote(lambda: transfer.wait(_SLICE))
                break
            except TimeoutError:
                self._calls.check()
        self._torn, self._cut = False, None
        self._held_at = self._local
        return True

    def _cut_ended(self) -> bool:
        """Whether the read of the pull cut short ended (waited for here, in slices): False
        if it was cut before it was handed back, so that it cannot be waited for."""
        cut = self._cut
        if cut is None:
            return False
        while True:
            try:
                cut.wait(_SLICE)
                break
            except TimeoutError:
                self._calls.check()
            except DevIpcError:
                break  # it failed: NIXL is done with it
        self._cut = None
        return True

    def _relayed(self, generation: int, data: bytes) -> bool:
        """`generation` in its leader's buffer, mapped (where the publisher named one and it
        holds the generation in time), else pulled into this process's buffers from its
        upstream and the trainer."""
        upstream, leader = (int(self._words[_RECORD][field]) for field in (_UP, _LEADER))
        if self._follower is not None and self._other(leader):
            slot = self._card_of(leader)
            if slot is not None:
                try:
                    held = self._follower.take(generation, slot, self._calls.check)
                except Moved:
                    return False
                if held is not None:
                    self._held_at, self._in_leader = held, True
                    return True
            upstream = -1  # the leader was left: this generation from the trainer
        relay = self._own_relay()
        slot = self._card_of(upstream) if self._other(upstream) else None
        if not self._remote(lambda: relay.pull(generation, data, slot, self._calls.check)):
            return False
        buffer = generation % self._buffers
        self._held_at = relay.buffers[buffer * self._nbytes:(buffer + 1) * self._nbytes]
        self._in_leader = False
        return True

    def _other(self, record: int) -> bool:
        """Whether `record` names another subscriber's record."""
        return 0 <= record < MAX_READERS and record != self._index

    def _card_of(self, record: int) -> bytes | None:
        """The card in `record`'s slot, once its subscriber wrote it (it does before it first
        pulls); None if it did not within RELAY_STALL seconds."""
        card, backoff = self._card, Backoff(_relay.RELAY_STALL, first=0.0001, longest=0.002)
        while True:
            self._remote(lambda: self._connection.read(card, self._cards, record * CARD_BYTES))
            slot = bytes(card.numpy())
            if written(slot):
                return slot
            if backoff.expired():
                return None
            self._calls.check()
            backoff.pause()

    def _own_relay(self) -> Relay:
        """This subscriber's own buffers, and its card in its slot, made when it first pulls a
        generation itself: an engine that only maps its leader's buffers holds no copy."""
        if self._relay is None:
            relay = self._remote(lambda: Relay(
                self._endpoints[0], self._metadata, self.device, self._buffers, self._nbytes,
                self._chunk, self._ids, self._endpoints, bool(self._share)))
            slot = relay.card.to_slot()
            self._card[:len(slot)] = torch.frombuffer(bytearray(slot), dtype=torch.uint8)
            self._remote(lambda: self._connection.write(self._card[:len(slot)], self._cards,
                                                        self._index * CARD_BYTES))
            self._relay = relay
        return self._relay

    def counts(self) -> dict[str, int]:
        """What this subscriber's relay did: bytes pulled from the trainer and from upstreams,
        upstreams bypassed, generations read in a leader's buffers, leaders left."""
        found = {"trainer": 0, "upstream": 0, "bypassed": 0, "shared": 0, "left": 0}
        for part in (self._relay, self._follower):
            if part is not None:
                found.update(part.counts)
        return found

    def __len__(self) -> int:
        return len(self._table)

    @counted
    def wait(self, timeout: float | None = None) -> int:
        """Block until a generation newer than the one held is published, and pull it (one
        NIXL read of the whole range); returns it. Polls with a backoff (0.1 ms up to 2 ms).
        PeerGoneError if the publisher closed, exited or dropped this subscriber (its heartbeat
        stopped for LIVENESS seconds); TimeoutError after `timeout`."""
        with self._turns:
            return self._wait(timeout)

    def _wait(self, timeout: float | None) -> int:
        if self._prefetch_error is not None:  # the prefetch thread met it: said here, once
            error, self._prefetch_error = self._prefetch_error, None
            raise error
        if self._prefetched is not None:  # pulled while the engine was busy
            (self.generation, self._checksum), self._prefetched = self._prefetched, None
            return self.generation
        backoff = Backoff(timeout, first=0.0001, longest=0.002)
        while True:
            self._calls.check()
            fetched = self._fetch()
            if fetched is not None:
                self.generation, self._checksum = fetched
                return self.generation
            if backoff.expired():
                raise TimeoutError(f"no new generation within {timeout} s (the newest is "
                                   f"{self._header_seen[_PUBLISHED]})")
            backoff.pause()

    def _fetch(self) -> tuple[int, int | None] | None:
        """A generation newer than the one held, pulled here whole (and passed on, with a
        relay), with its checksum; None if there is none yet, or the pull was dropped (its
        upstream has a newer one, the trainer wrote meanwhile): looked at again after a pause.
        PeerGoneError if the publisher dropped this subscriber."""
        published, filling, state = self._poll()
        if state != ATTACHED:
            raise PeerGoneError(f"the weight publisher dropped this subscriber (its heartbeat "
                                f"stopped for {LIVENESS} s): open a new token")
        if published > self.generation and filling < published + self._buffers \
                and self._pull(published) \
                and self._poll()[1] < published + self._buffers:  # nobody wrote meanwhile
            return published, published_sum(self._header_seen[_SUMS:], published)
        return None

    def _prefetch(self) -> bool | None:
        """One look of the prefetch thread (`_prefetching`): whether it pulled a generation;
        None once it should end (closed, or the publisher gone or this subscriber dropped). An
        error is kept for the engine's next `wait()` to raise, as a DataLoader's worker's is;
        the thread looks again once that wait() said it."""
        try:
            self._calls.enter()
        except ValueError:
            return None
        try:
            with self._turns:
                if self._prefetch_error is not None or self._prefetched is not None \
                        or self._acked != self.generation:
                    return False  # the engine holds one, or has an error to meet
                self._prefetched = self._fetch()
                return self._prefetched is not None
        except Exception as error:  # noqa: BLE001 - any, for the engine's wait() to raise
            self._prefetch_error = error
            return None if isinstance(error, PeerGoneError) else False
        finally:
            self._calls.leave()

    @counted
    def ready(self) -> bool:
        """Whether `wait()` would pull a generation (or raise) at once: one read of the
        publisher's words."""
        with self._turns:
            if self._prefetched is not None or self._prefetch_error is not None:
                return True
            published, filling, state = self._poll()
        return state != ATTACHED or (published > self.generation
                                     and filling < published + self._buffers)

    @counted
    def tensors(self) -> dict[str, torch.Tensor]:
        """The held generation's tensors by name, in this process's memory: valid until the next
        `wait()` overwrites them."""
        if self.generation < 0:
            raise ValueError("no generation yet: wait() first")
        if self._torn:
            raise ValueError("the last wait() was cut short while it pulled a generation into "
                             "this memory: wait() again")
        held = self._held_at
        views = self._views.get(held.data_ptr())
        if views is None:
            if len(self._views) >= 4:  # places of generations held before
                self._views.clear()
            views = self._views[held.data_ptr()] = self._table.views(
                held.untyped_storage(), shift=int(held.storage_offset()))
        self._still_held(read=False)
        return views

    def check_held(self) -> None:
        """Once the held generation's bytes were read (`copy_into`, the end of `weights()`):
        PeerGoneError if they may be another generation's."""
        self._still_held(read=True)

    def _still_held(self, read: bool) -> None:
        """PeerGoneError if the leader whose buffer holds this generation (relay) began to
        overwrite it with a newer one: it may only once the publisher dropped this subscriber
        (its heartbeat stood still for LIVENESS: a pause, SIGSTOP, a debugger). Looked at after
        the bytes were `read` (their device work waited for first), as a seqlock's second look:
        a leader marks a buffer before it writes there."""
        if not self._in_leader:
            return
        assert self._follower is not None
        if read:
            synchronize(self.device)
        if not self._follower.holds():
            raise PeerGoneError(
                f"generation {self.generation} was overwritten in its leader's memory while "
                f"this subscriber held it, as happens only once the publisher dropped it (its "
                f"heartbeat stood still for {LIVENESS} s: a pause, SIGSTOP, a debugger): what "
                f"was read of it since wait() may be of a newer generation; open a new token")

    @counted
    def verify(self) -> None:
        """ChecksumError unless the held generation's bytes, as pulled here, are those
        published; ValueError if it was published without a checksum."""
        if self.generation < 0:
            raise ValueError("no generation to verify: wait() first")
        with self._turns:
            if self._checksum is None:
                raise ValueError(f"generation {self.generation} was published without a "
                                 f"checksum: the WeightPublisher publishes with checksum=True")
            if self._torn:
                raise ValueError("the last wait() was cut short while it pulled a generation "
                                 "into this memory: wait() again")
            torch.get_device_module(self.device).synchronize(self.device)
            held = self._held_at
            found = crc32(held.untyped_storage(), int(held.storage_offset()), self._nbytes)
            self._still_held(read=True)
            if found != self._checksum:
                raise ChecksumError(f"generation {self.generation} holds other bytes here than "
                                    f"the WeightPublisher published (CRC-32 {found:08x}, "
                                    f"published {self._checksum:08x})")

    @counted
    def ack(self) -> None:
        """Done with the held generation: written into this subscriber's record."""
        if self.generation < 0:
            raise ValueError("no generation to acknowledge: wait() first")
        with self._turns:
            self._still_held(read=True)  # what the engine read since wait() was of it
            self._words[_ACKED] = self.generation
            self._remote(lambda: self._connection.write(self._words[_ACKED], self._ack))
            self._acked = self.generation

    def close(self) -> None:
        """Unsubscribe (the publisher stops waiting for this engine), end the endpoint and the
        registrations, once calls under way in other threads left; returns once they went,
        unless a call of another thread of the owner's does it as it leaves. Idempotent."""
        if self._calls.close():
            self._calls.release(self._unsubscribe)
            for thread in self._heart[1:]:  # prefetch: a look under way does it as it leaves
                if thread is not threading.current_thread():
                    thread.join()

    def _unsubscribe(self) -> None:
        self._stop.set()
        self._words[_CLAIM][0] = CLOSED
        try:
            if not self._publisher_gone:  # (nothing waits for this subscriber there)
                self._remote(lambda: self._connection.write(self._words[_CLAIM], self._claim))
        except (DevIpcError, ValueError):
            pass  # the publisher is gone: nothing waits for this subscriber
        self._release()

    def _release(self) -> None:
        self._let_go()
        self._views.clear()
        self._words = self._local = self._held_at = torch.empty(0)  # the memory goes with them
        self._relay, self._in_leader = None, False
        if self._follower is not None:
            self._follower.drop()


def _let_go(endpoints: list[p2p.Endpoint], ids: list[int], stop: threading.Event | None = None,
            threads: list[threading.Thread] | None = None) -> None:
    """End what a publisher or a subscriber holds (its heartbeat, registrations, endpoints),
    also when it is dropped unclosed: a registry listener would keep its NIXL agents alive."""
    if stop is not None:
        stop.set()  # a subscriber no longer beats: the publisher finds it dead
    for thread in threads or ():
        if thread is not threading.current_thread():
            thread.join(_JOIN)  # longer only while a write hangs on a vanished publisher
    for reg_id in ids:
        p2p.deregister(reg_id)
    ids.clear()
    for endpoint in endpoints:
        endpoint.close()


def _check_descriptors(metadata: bytes, expected: Iterable[tuple[bytes, int]]) -> None:
    """A token's descriptors (with `expected` sizes) decoded, NIXL parts' digests checked, all
    of the publisher whose endpoint it names: InvalidHandleError before anything is allocated or
    claimed, so that the genuine token still opens."""
    meta = Metadata.from_bytes(metadata)
    if meta.transport != "nixl":
        raise InvalidHandleError(f"a weight token across hosts names a NIXL endpoint, not a "
                                 f"{meta.transport!r} one")
    agent, _ = agent_metadata_from_bytes(meta.extra)
    for data, nbytes in expected:
        desc = Descriptor.from_bytes(data)
        remote = Remote.from_bytes(desc.extra)
        if desc.page != meta.page or remote.agent != agent:
            raise InvalidHandleError("a descriptor of this weight token is of another process "
                                     "than its publisher: the token is damaged")
        if desc.nbytes != nbytes or remote.nbytes != nbytes:
            raise InvalidHandleError(f"this weight token is damaged: a descriptor of "
                                     f"{desc.nbytes} bytes ({remote.nbytes} for NIXL) where "
                                     f"the token says {nbytes}")


def _connect(endpoints: list[p2p.Endpoint], metadata: bytes) -> p2p.Connection:
    """A connection to the publisher through a new endpoint (added to `endpoints`)."""
    endpoints.append(p2p.Endpoint(transport="nixl"))
    try:
        return endpoints[-1].connect(metadata)
    except InvalidHandleError as error:
        raise InvalidHandleError(f"this weight token does not reach its publisher: it closed or "
                                 f"exited, or the token is damaged ({error}); ask the publisher "
                                 f"for a new token") from None


def _prefetching(subscriber: "weakref.ref[NixlSubscriber]", stop: threading.Event) -> None:
    """With prefetch: once the engine acknowledged the generation it holds, the next one is
    pulled (and passed on down the relay's chain) as soon as it is published, whether or not
    the engine is in `wait()`, which then hands it over at once. Polls as `wait()` does, until
    the subscriber closes or is dropped."""
    backoff = Backoff(None, first=0.0001, longest=0.002)
    while not stop.wait(backoff.next_pause()):
        found = (sub := subscriber()) and sub._prefetch()
        del sub  # a subscriber dropped unclosed goes (its finalizer stops this thread)
        if found is None:
            return
        if found:
            backoff = Backoff(None, first=0.0001, longest=0.002)


def _heartbeat(connection: p2p.Connection, word: torch.Tensor, desc: bytes,
               stop: threading.Event) -> None:
    """A subscriber's proof of life: a counter written into its record every HEARTBEAT s, until
    it closes, is dropped, or the publisher is gone."""
    beats = 0
    while not stop.wait(HEARTBEAT):
        beats += 1
        word[0] = beats
        try:
            connection.write(word, desc)
        except Exception:  # the publisher is gone, or this subscriber is closing: no one to tell
            return
