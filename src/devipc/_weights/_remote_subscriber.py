"""`WeightSubscriber` of a `transport="nixl"` publisher (`_remote_publisher`): each generation
pulled into this process's memory with one-sided NIXL reads, claims, acks and heartbeats
written into the publisher's control block (`_remote_token`) with one-sided writes.

A subscriber reads the header with small NIXL reads (polling with a backoff of 0.1 to 2 ms:
nothing wakes a process across hosts), pulls a new generation's whole range into its own memory
with one read, then reads the header again: `filling` says whether the publisher (copy=True) or
the trainer (copy=False, once the acks arrived) may have begun to overwrite that buffer
meanwhile; if so the pull is dropped and done again (a seqlock). It writes its claim, its acks
and a heartbeat (a counter, every HEARTBEAT seconds, from a thread) into its record. With relay
(`_relay`) it pulls from its upstream in the chain, or maps its leader's buffers.

A token is checked whole (every descriptor decoded, its sizes against the weights descriptors it
carries, all of one publisher) before a subscriber allocates or claims anything: a refused token
leaves the genuine one openable. Thread-safe as on one host: its calls take turns, and close()
from another thread ends a wait under way there with ValueError.
"""

import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NamedTuple, TypeVar

import torch

from .. import p2p
from .._core._backoff import SLICE, polling
from .._core._devices import synchronize
from .._core._errors import (
    ChecksumError,
    DevIpcError,
    InvalidHandleError,
    PeerGoneError,
    RemoteTensorFreedError,
)
from .._core._table import Table
from ..p2p._descriptor import Descriptor, Metadata
from ..p2p._nixl_wire import Remote, agent_metadata_from_bytes
from . import _relay, _remote_token
from ._arena import Calls, counted
from ._checksum import block_size, crc32, pair, published_sum
from ._common import engine_device
from ._readers import ATTACHED, CLOSED, MAX_READERS, PENDING
from ._relay import CARD_BYTES, Follower, Moved, Relay, chunks_of, host_key, share_key, written
from ._remote_token import (
    CLAIMED,
    FIELDS,
    FILLING,
    HEADER,
    LEADER,
    PUBLISHED,
    SERIAL,
    STATE,
    SUMS,
    UP,
    RemoteToken,
    block_words,
    let_go,
)
from ._shard_layout import byte_runs

__all__ = ["NixlSubscriber"]

_T = TypeVar("_T")

# this subscriber's words: where the header and its record land, what it writes
_HEAD, _RECORD = slice(0, HEADER), slice(HEADER, HEADER + FIELDS)
_CLAIM = slice(HEADER + FIELDS, HEADER + FIELDS + CLAIMED)  # state, pid, host and share keys
_ACKED, _BEATS = slice(_CLAIM.stop, _CLAIM.stop + 1), slice(_CLAIM.stop + 1, _CLAIM.stop + 2)
_UP_OF = slice(_BEATS.stop, _BEATS.stop + 1)  # another record's upstream (the chain ahead)


class _Polled(NamedTuple):
    """What one read of the publisher's words says (`_poll`)."""

    published: int  # the newest generation
    filling: int  # the generation whose buffer may be being overwritten
    state: int  # this subscriber's record's


class _Pulled(NamedTuple):
    """A generation held here, with the checksum published with it and, for a partial pull,
    its blocks' (None: none)."""

    generation: int
    checksum: int | None
    blocks: list[int] | None


class NixlSubscriber:
    """A WeightSubscriber of a `transport="nixl"` publisher: each generation is pulled into this
    process's memory, so `tensors()` stay valid until the next `wait()`, not only until `ack()`
    (with `prefetch`, until `ack()`: a thread then pulls the next generation in the background,
    once the engine acknowledged the one it holds).

    Thread-safe: its calls from several threads take turns; `close()` from another thread ends a
    `wait` under way there with ValueError (within a poll, or once the pull under way ended)."""

    def __init__(
        self,
        token: bytes | bytearray | memoryview,
        device: torch.device | str | int | None = None,
        share: bool = True,
        prefetch: bool = False,
        parts: Mapping[str, tuple[slice, ...]] | None = None,
    ):
        """`parts` (a sharded engine's, `_sharded`): pull only these boxes of these tensors,
        not the whole generation (without a relay: a relay passes generations whole)."""
        opened = RemoteToken.from_bytes(token)
        metadata, nbytes, chunk, control = (
            opened.metadata,
            opened.nbytes,
            opened.chunk,
            opened.control,
        )
        self._table, self._buffers, self._data = opened.table, len(opened.data), list(opened.data)
        # a partial pull's byte runs: its parts' own, and rounded out to whole blocks for a
        # generation published with a checksum (so that verify() checks each block pulled)
        self._runs = self._checked_runs = None
        if parts is not None and not chunk:
            self._runs = _runs_of(self._table, parts, 1, nbytes)
            self._checked_runs = _runs_of(self._table, parts, block_size(nbytes), nbytes)
        self._pulled_runs = self._runs  # those of the last pull
        # their reads, prepared once per published buffer (and checked or not: `_partial`)
        self._prepared: dict[tuple[bytes, bool], p2p.PreparedTransfer] = {}
        _check_descriptors(
            metadata,
            [
                *control.sizes(relay=bool(chunk), nbytes=nbytes),
                *((desc, nbytes) for desc in self._data),
            ],
        )
        self.device = engine_device(opened.device, device)
        self.generation = -1
        self._calls = Calls("WeightSubscriber")
        self._turns = threading.Lock()
        self._torn = False  # a pull into `_local` started and did not end (Ctrl-C)
        self._cut: p2p.Transfer | None = None  # that pull's read, while it may be in flight
        self._header_seen: list[int] = []  # the header at the last poll
        self._checksum: int | None = None  # published with the held generation
        self._block_sums: list[int] | None = None  # and its blocks', for a partial pull
        self._acked = -1  # the newest generation the engine acknowledged
        # (generation, its checksum) pulled by the prefetch thread, not yet handed to wait()
        self._prefetched: _Pulled | None = None
        self._prefetch_error: Exception | None = None  # met there, for the next wait() to raise
        self._control = control
        self._nbytes, self._index, self._chunk, self._metadata = (
            nbytes,
            opened.record,
            chunk,
            metadata,
        )
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
        self._let_go = weakref.finalize(
            self, let_go, self._endpoints, self._ids, self._stop, self._heart
        )  # dropped unclosed: its agents go too
        try:
            self._connection, beats = (_connect(self._endpoints, metadata) for _ in range(2))
            self._words, words_id = p2p.create_tensor((_UP_OF.stop,), torch.int64, "cpu")
            self._ids.append(words_id)
            if self._runs is not None:  # a row of the block sums, read with each pull
                self._sums, sums_id = p2p.create_tensor((block_words(nbytes),), torch.int64, "cpu")
                self._ids.append(sums_id)
            self._local = torch.empty(0, dtype=torch.uint8)  # one-hop pulls land here
            if not chunk:
                self._local, local_id = p2p.create_tensor((nbytes,), torch.uint8, self.device)
                self._ids.append(local_id)
            state = self._poll().state
            if state != PENDING or int(self._words[_RECORD][SERIAL]) != opened.serial:
                raise InvalidHandleError(
                    "this weight token was already opened (one token per "
                    "subscriber), or its record was reused"
                )
            if chunk:
                self._card, card_id = p2p.create_tensor((CARD_BYTES,), torch.uint8, "cpu")
                self._ids.append(card_id)
                if self._share:
                    self._follower = Follower(
                        self._endpoints, self._buffers, nbytes, chunks_of(nbytes, chunk)
                    )
                else:  # its card first: a downstream may read it once the claim is seen
                    self._own_relay()
            self._words[_CLAIM] = torch.tensor(
                [ATTACHED, os.getpid(), host_key() if chunk else 0, self._share]
            )
            self._remote(lambda: self._connection.write(self._words[_CLAIM], control.claim))
            self._heart.append(
                threading.Thread(
                    target=_heartbeat,
                    daemon=True,
                    name="devipc-weights-heartbeat",
                    args=(beats, self._words[_BEATS], control.beat, self._stop),
                )
            )
            self._heart[0].start()
            if prefetch:
                self._heart.append(
                    threading.Thread(
                        target=_prefetching,
                        daemon=True,
                        name="devipc-weights-prefetch",
                        args=(weakref.ref(self), self._stop),
                    )
                )
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
            raise PeerGoneError(
                "the weight publisher closed: nothing more will be published "
                "(ask a new publisher for a token)"
            ) from None
        except PeerGoneError as error:
            raise PeerGoneError(
                f"the weight publisher closed, exited or cannot be reached "
                f"(its host is down or unreachable): {error}"
            ) from None
        except DevIpcError as error:
            if type(error) is not DevIpcError:  # a damaged handle, a size: not the peer's state
                raise
            # NIXL's transfer failed for no reason it names (p2p says "NIXL failed: ..."):
            # with the publisher's memory, as when its agent goes mid-transfer
            raise PeerGoneError(
                f"the weight publisher exited or cannot be reached: {error}"
            ) from None
        except Exception as error:
            if not type(error).__module__.startswith("nixl"):
                raise
            # devipc.p2p lets some of NIXL's own errors through (a peer that disconnects during
            # its liveness read): the same news
            raise PeerGoneError(
                f"the weight publisher exited or cannot be reached: NIXL says "
                f"{type(error).__name__}: {error}"
            ) from None

    def _poll(self) -> _Polled:
        """(published, filling, this record's state), one NIXL read. A publisher found closed or
        gone is posted nothing more, no heartbeat and no unsubscribe: NIXL logs an error for
        each post to an agent that disconnected, as a closing publisher's does right after."""
        try:
            self._remote(
                lambda: self._connection.readv(
                    [self._words[_HEAD], self._words[_RECORD]],
                    [self._control.header, self._control.record],
                )
            )
        except PeerGoneError:
            self._publisher_gone = True
            self._stop.set()
            raise
        words = self._words[: HEADER + 1].tolist()
        self._header_seen = words[:HEADER]
        return _Polled(words[PUBLISHED], words[FILLING], words[HEADER + STATE])

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
            self._unprepare()  # (they read into the local buffer let go of here)
            p2p.deregister(self._ids.pop())  # the local buffer's registration is the last
            self._views.clear()
            self._local, local_id = p2p.create_tensor(self._local.shape, torch.uint8, self.device)
            self._ids.append(local_id)
        self._torn = True
        checked = published_sum(self._header_seen[SUMS:], generation) is not None
        runs = self._pulled_runs = self._checked_runs if checked else self._runs
        if runs is None:
            self._cut = transfer = self._remote(
                lambda: self._connection.read_async(self._local, data)
            )
        elif runs:  # only the engine's parts, each run into its own place
            self._cut = transfer = self._remote(self._partial(data, checked, runs).post)
        else:
            self._torn, self._held_at = False, self._local
            return True
        while True:
            try:
                self._remote(lambda: transfer.wait(SLICE))
                break
            except TimeoutError:
                self._calls.check()
        self._torn, self._cut = False, None
        self._held_at = self._local
        return True

    def _partial(
        self, data: bytes, checked: bool, runs: list[tuple[int, int]]
    ) -> p2p.PreparedTransfer:
        """The read of a partial pull's runs of `data`, each into its own place, prepared once
        (thousands of runs cost more to describe than to read over a fast link); the
        parts stand for the subscriber's life."""
        prepared = self._prepared.get((data, checked))
        if prepared is None:
            prepared = self._prepared[data, checked] = self._remote(
                lambda: self._connection.prepare(
                    "read",
                    [self._local[start : start + length] for start, length in runs],
                    [data] * len(runs),
                    [start for start, _ in runs],
                )
            )
        return prepared

    def _unprepare(self) -> None:
        for prepared in self._prepared.values():
            prepared.close()
        self._prepared.clear()

    def _cut_ended(self) -> bool:
        """Whether the read of the pull cut short ended (waited for here, in slices): False
        if it was cut before it was handed back, so that it cannot be waited for."""
        cut = self._cut
        if cut is None:
            return False
        while True:
            try:
                cut.wait(SLICE)
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
        upstream, leader = (int(self._words[_RECORD][field]) for field in (UP, LEADER))
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
            # the leader was left: this generation from the engine ahead of it, or the trainer
            upstream = self._upstream_of(leader)
        relay = self._own_relay()
        sources = self._chain_from(upstream)
        if not self._remote(lambda: relay.pull(generation, data, sources, self._calls.check)):
            return False
        buffer = generation % self._buffers
        self._held_at = relay.buffers[buffer * self._nbytes : (buffer + 1) * self._nbytes]
        self._in_leader = False
        return True

    def _other(self, record: int) -> bool:
        """Whether `record` names another subscriber's record."""
        return 0 <= record < MAX_READERS and record != self._index

    def _chain_from(self, upstream: int) -> Iterator[bytes]:
        """The card slots of `upstream` and of the engines ahead of it in the chain, nearest
        first (each record's upstream as the publisher wrote it), read as they are asked for;
        an engine ahead whose card is not written yet is passed over."""
        seen, record, within = {self._index}, upstream, _relay.RELAY_STALL
        while self._other(record) and record not in seen:
            seen.add(record)
            slot = self._card_of(record, within)
            if slot is not None:
                yield slot
            within = 0.0
            record = self._upstream_of(record)

    def _upstream_of(self, record: int) -> int:
        """`record`'s upstream as the publisher wrote it in that record."""
        word, offset = self._words[_UP_OF], (record * FIELDS + UP) * 8
        self._remote(lambda: self._connection.read(word, self._control.records, offset))
        return int(word[0])

    def _card_of(self, record: int, within: float | None = None) -> bytes | None:
        """The card in `record`'s slot, once its subscriber wrote it (it does before it first
        pulls); None if it did not `within` seconds (RELAY_STALL)."""
        within = _relay.RELAY_STALL if within is None else within
        card, backoff = self._card, polling(within)
        while True:
            self._remote(
                lambda: self._connection.read(card, self._control.cards, record * CARD_BYTES)
            )
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
            relay = self._remote(
                lambda: Relay(
                    self._endpoints[0],
                    self._metadata,
                    self.device,
                    self._buffers,
                    self._nbytes,
                    self._chunk,
                    self._ids,
                    self._endpoints,
                    bool(self._share),
                )
            )
            slot = relay.card.to_slot()
            self._card[: len(slot)] = torch.frombuffer(bytearray(slot), dtype=torch.uint8)
            self._remote(
                lambda: self._connection.write(
                    self._card[: len(slot)], self._control.cards, self._index * CARD_BYTES
                )
            )
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
            self.generation, self._checksum, self._block_sums = self._prefetched
            self._prefetched = None
            return self.generation
        backoff = polling(timeout, paced=True)  # an engine may wait long: its polls cost two hosts
        while True:
            self._calls.check()
            fetched = self._fetch()
            if fetched is not None:
                self.generation, self._checksum, self._block_sums = fetched
                return self.generation
            if backoff.expired():
                raise TimeoutError(
                    f"no new generation within {timeout} s (the newest is "
                    f"{self._header_seen[PUBLISHED]})"
                )
            backoff.pause()

    def _fetch(self) -> _Pulled | None:
        """A generation newer than the one held, pulled here whole (and passed on, with a
        relay), with its checksum; None if there is none yet, or the pull was dropped (its
        upstream has a newer one, the trainer wrote meanwhile): looked at again after a pause.
        PeerGoneError if the publisher dropped this subscriber."""
        published, filling, state = self._poll()
        if state != ATTACHED:
            raise PeerGoneError(
                f"the weight publisher dropped this subscriber (its heartbeat "
                f"stopped for {_remote_token.LIVENESS} s): open a new token"
            )
        if (
            published > self.generation
            and filling < published + self._buffers
            and self._pull(published)
            and self._poll().filling < published + self._buffers
        ):  # nobody wrote meanwhile
            checksum = published_sum(self._header_seen[SUMS:], published)
            blocks = None if checksum is None or self._runs is None else self._blocks_of(published)
            return _Pulled(published, checksum, blocks)
        return None

    def _blocks_of(self, generation: int) -> list[int] | None:
        """The CRC-32s of `generation`'s blocks, one NIXL read (None: not published with it).
        Its row stays until this subscriber acknowledges it, as the generation's bytes do."""
        row = pair(generation) // 2
        self._remote(
            lambda: self._connection.read(self._sums, self._control.blocks, row * self._sums.nbytes)
        )
        words = self._sums.tolist()
        return words[1:] if words[0] == generation else None

    def _prefetch(self) -> bool | None:
        """One look of the prefetch thread (`_prefetching`): whether it pulled a generation;
        None once it should end (closed, or the publisher gone or this subscriber dropped). An
        error is kept for the engine's next `wait()` to raise, as a DataLoader's worker's is;
        the thread looks again once that wait() said it."""
        try:
            self._calls.enter()
        except ValueError:  # closed: the thread ends
            return None
        try:
            with self._turns:
                if (
                    self._prefetch_error is not None
                    or self._prefetched is not None
                    or self._acked != self.generation
                ):
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
        return state != ATTACHED or (
            published > self.generation and filling < published + self._buffers
        )

    @property
    def pull_bytes(self) -> int:
        """The bytes of a generation one pull reads: all of it, or the runs of `parts` (at the
        last pull: a generation with a checksum pulls whole blocks)."""
        return self._nbytes if self._pulled_runs is None else sum(n for _, n in self._pulled_runs)

    @counted
    def tensors(self) -> dict[str, torch.Tensor]:
        """The held generation's tensors by name, in this process's memory: valid until the next
        `wait()` overwrites them."""
        if self.generation < 0:
            raise ValueError("no generation yet: wait() first")
        if self._torn:
            raise ValueError(
                "the last wait() was cut short while it pulled a generation into "
                "this memory: wait() again"
            )
        held = self._held_at
        views = self._views.get(held.data_ptr())
        if views is None:
            if len(self._views) >= 4:  # places of generations held before
                self._views.clear()
            views = self._views[held.data_ptr()] = self._table.views(
                held.untyped_storage(), shift=int(held.storage_offset())
            )
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
                f"heartbeat stood still for {_remote_token.LIVENESS} s: a pause, SIGSTOP, a "
                f"debugger): what was read of it since wait() may be of a newer generation; open "
                f"a new token"
            )

    @counted
    def verify(self) -> None:
        """ChecksumError unless the held generation's bytes, as pulled here, are those
        published; ValueError if it was published without a checksum."""
        if self.generation < 0:
            raise ValueError("no generation to verify: wait() first")
        with self._turns:
            if self._checksum is None:
                raise ValueError(
                    f"generation {self.generation} was published without a "
                    f"checksum: the WeightPublisher publishes with checksum=True"
                )
            if self._runs is not None and self._block_sums is None:
                raise ValueError(
                    f"generation {self.generation} was published without the "
                    f"checksums of its blocks, which a partial pull checks: "
                    f"WeightPublisher(..., block_checksums=True) (a "
                    f"ShardedPublisher's are)"
                )
            if self._torn:
                raise ValueError(
                    "the last wait() was cut short while it pulled a generation "
                    "into this memory: wait() again"
                )
            synchronize(self.device)
            held = self._held_at
            if self._runs is not None:
                self._verify_blocks(held)
                return
            found = crc32(held.untyped_storage(), int(held.storage_offset()), self._nbytes)
            self._still_held(read=True)
            if found != self._checksum:
                raise ChecksumError(
                    f"generation {self.generation} holds other bytes here than "
                    f"the WeightPublisher published (CRC-32 {found:08x}, "
                    f"published {self._checksum:08x})"
                )

    def _verify_blocks(self, held: torch.Tensor) -> None:
        """A partial pull's check: each block it pulled (whole ones: `_checked_runs`) against
        the CRC-32 published for it."""
        assert self._checked_runs is not None and self._block_sums is not None
        block, storage = block_size(self._nbytes), held.untyped_storage()
        bad = [
            index
            for start, length in self._checked_runs
            for index in range(start // block, -(-(start + length) // block))
            if crc32(
                storage,
                int(held.storage_offset()) + index * block,
                min(block, self._nbytes - index * block),
            )
            != self._block_sums[index]
        ]
        self._still_held(read=True)
        if bad:
            raise ChecksumError(
                f"generation {self.generation} holds other bytes here than the "
                f"WeightPublisher published: {len(bad)} of the blocks of "
                f"{block} bytes pulled differ (the first at byte "
                f"{bad[0] * block})"
            )

    @counted
    def ack(self) -> None:
        """Done with the held generation: written into this subscriber's record."""
        if self.generation < 0:
            raise ValueError("no generation to acknowledge: wait() first")
        with self._turns:
            self._still_held(read=True)  # what the engine read since wait() was of it
            self._words[_ACKED] = self.generation
            self._remote(lambda: self._connection.write(self._words[_ACKED], self._control.ack))
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
                self._remote(
                    lambda: self._connection.write(self._words[_CLAIM], self._control.claim)
                )
        except (DevIpcError, ValueError):
            pass  # the publisher is gone: nothing waits for this subscriber
        self._release()

    def _release(self) -> None:
        self._unprepare()
        self._let_go()
        self._views.clear()
        self._words = self._local = self._held_at = self._sums = torch.empty(0)  # the memory
        # goes with them
        self._relay, self._in_leader = None, False
        if self._follower is not None:
            self._follower.drop()


def _runs_of(
    table: Table, parts: Mapping[str, tuple[slice, ...]], block: int, nbytes: int
) -> list[tuple[int, int]]:
    """The byte runs of a generation of `nbytes` that hold `parts` (a box per tensor name), in
    order, rounded out to whole blocks of `block` bytes."""
    rows = {name: row for row, name in enumerate(table.names)}
    unknown = sorted(set(parts) - rows.keys())
    if unknown:
        raise KeyError(f"the publisher publishes no tensors named {unknown[:5]}")
    runs = sorted(
        run
        for name, box in parts.items()
        for run in byte_runs(
            table.offsets[rows[name]],
            table.shapes[rows[name]],
            table.strides[rows[name]],
            table.dtypes[rows[name]].itemsize,
            box,
        )
    )
    merged: list[tuple[int, int]] = []  # (start, end)
    for start, length in runs:
        if not length:
            continue
        start, end = start // block * block, min(-(-(start + length) // block) * block, nbytes)
        if merged and merged[-1][1] >= start:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return [(start, end - start) for start, end in merged]


def _check_descriptors(metadata: bytes, expected: Iterable[tuple[bytes, int]]) -> None:
    """A token's descriptors (with `expected` sizes) decoded, NIXL parts' digests checked, all
    of the publisher whose endpoint it names: InvalidHandleError before anything is allocated or
    claimed, so that the genuine token still opens."""
    meta = Metadata.from_bytes(metadata)
    if meta.transport != "nixl":
        raise InvalidHandleError(
            f"a weight token across hosts names a NIXL endpoint, not a {meta.transport!r} one"
        )
    agent, _ = agent_metadata_from_bytes(meta.extra)
    for data, nbytes in expected:
        desc = Descriptor.from_bytes(data)
        remote = Remote.from_bytes(desc.extra)
        if desc.page != meta.page or remote.agent != agent:
            raise InvalidHandleError(
                "a descriptor of this weight token is of another process "
                "than its publisher: the token is damaged"
            )
        if desc.nbytes != nbytes or remote.nbytes != nbytes:
            raise InvalidHandleError(
                f"this weight token is damaged: a descriptor of "
                f"{desc.nbytes} bytes ({remote.nbytes} for NIXL) where "
                f"the token says {nbytes}"
            )


def _connect(endpoints: list[p2p.Endpoint], metadata: bytes) -> p2p.Connection:
    """A connection to the publisher through a new endpoint (added to `endpoints`)."""
    endpoints.append(p2p.Endpoint(transport="nixl"))
    try:
        return endpoints[-1].connect(metadata)
    except InvalidHandleError as error:
        raise InvalidHandleError(
            f"this weight token does not reach its publisher: it closed or "
            f"exited, or the token is damaged ({error}); ask the publisher "
            f"for a new token"
        ) from None


def _prefetching(subscriber: "weakref.ref[NixlSubscriber]", stop: threading.Event) -> None:
    """With prefetch: once the engine acknowledged the generation it holds, the next one is
    pulled (and passed on down the relay's chain) as soon as it is published, whether or not
    the engine is in `wait()`, which then hands it over at once. Polls as `wait()` does, until
    the subscriber closes or is dropped."""
    backoff = polling(paced=True)
    while not stop.wait(backoff.next_pause()):
        found = (sub := subscriber()) and sub._prefetch()
        del sub  # a subscriber dropped unclosed goes (its finalizer stops this thread)
        if found is None:
            return
        if found:
            backoff = polling(paced=True)


def _heartbeat(
    connection: p2p.Connection, word: torch.Tensor, desc: bytes, stop: threading.Event
) -> None:
    """A subscriber's proof of life: a counter written into its record every HEARTBEAT s, until
    it closes, is dropped, or the publisher is gone."""
    beats = 0
    while not stop.wait(_remote_token.HEARTBEAT):
        beats += 1
        word[0] = beats
        try:
            connection.write(word, desc)
        except Exception:  # noqa: BLE001
            # the publisher is gone, or this subscriber is closing: no one to tell
            return
