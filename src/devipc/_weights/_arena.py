"""A reusable arena for streaming weight syncs: one device allocation shared once, refilled chunk
after chunk, reused only once every consumer acknowledged what it read from it.

A trainer that sends its weights through fresh buckets allocates, shares, opens and frees once per
sync; through an arena it does so once per consumer and then only copies. The arena holds
`buffers` equal buffers: generation g goes into buffer g % buffers, so with two the producer fills
chunk k + 1 while the consumer still works on chunk k.

Acknowledgements live in a small control file (a memfd) that the producer owns and each consumer
maps: a header whose first word is the newest generation the producer started to fill, then one
record per consumer, (state, acknowledged generation, pid, attachment serial). A consumer keeps an
OFD lock (`_locks`) on its record while attached, so a record that says ATTACHED and whose lock is
free belongs to a consumer that died: the producer's wait ends there and names it. Every wait is
bounded by a timeout. Chunk tables travel as devipc wire bytes (`_wire`) by whatever transport
the user picks.

Only consumers that opened their attachment are waited for: one that never opens it (it died, the
bytes were lost, the send was revoked) cannot hold the producer. A consumer that opens late starts
after the chunks whose buffers may already be refilled (the header word tells which); the header
lock orders its "attached" against the producer's next fill. Records of closed, dead and revoked
attachments are reused, each time under a new serial, so stale attachment bytes never open one.

Two more header words are futexes (`_futex`) that processes sleep on instead of polling: the
newest generation published (`ArenaReader.wait` sleeps on it) and a count of acknowledgements
(`Arena.wait_for` sleeps on it, waking every few milliseconds to look for dead consumers).
"""

import functools
import itertools
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Concatenate, NamedTuple, ParamSpec, TypeVar

import torch

from .._core import _futex, _handles, _locks, _sharing, _wire
from .._core._devices import synchronize
from .._core._errors import ChecksumError, InvalidHandleError, PeerGoneError
from .._core._hooks import hooks_for
from .._core._host import HostSend, as_host, host_addressable, not_host_memory, shared_host_storage
from .._core._memfd import (
    MappedFile,
    SharedFile,
    WordTable,
    handle_pid,
    open_shared_file,
    pid_alive,
)
from .._core._table import ALIGNMENT, Table
from ._checksum import NO_SUM, SUM_WORDS, crc32, pair, published_sum
from ._readers import (
    ARENA_WORDS,
    ATTACHED,
    CLOSED,
    FREE,
    GONE,
    MAX_READERS,
    PENDING,
    Records,
    Words,
    acks_timeout,
    attach_timeout,
    attached,
    label,
    unacknowledged,
)

__all__ = ["Arena", "ArenaReader", "Attachment", "Chunk", "open_arena"]

_MAGIC = b"ACKS"
MAX_BUFFERS = 16
_FIELDS = 4  # a record's words: state, acknowledged generation, pid, attachment serial
_CONTROL_BYTES = WordTable.size(MAX_READERS, _FIELDS)
_FILLING, _PUBLISHED, _ACKS, _CLOSED = 0, 1, 2, 3  # header words
_SUMS = 4  # header words 4-7: the CRC-32s of the last two generations (`_checksum`)
_DEATH_CHECK = 0.02  # seconds between looks for dead peers while a wait sleeps


class _Records(WordTable):
    """The control file's consumer records, through one mapping of it."""

    def __init__(self, mapping: MappedFile):
        super().__init__(mapping, _FIELDS)

    def state(self, index: int) -> int:
        return self.load(index, 0)

    def set_state(self, index: int, state: int) -> None:
        self.store(index, 0, state)

    def ack(self, index: int) -> int:
        return self.load(index, 1)

    def set_ack(self, index: int, generation: int) -> None:
        self.store(index, 1, generation)

    def pid(self, index: int) -> int:
        return self.load(index, 2)

    def set_pid(self, index: int, pid: int) -> None:
        self.store(index, 2, pid)

    def serial(self, index: int) -> int:
        return self.load(index, 3)

    def set_serial(self, index: int, serial: int) -> None:
        self.store(index, 3, serial)

    def filling(self) -> int:
        """The newest generation the producer started to fill (-1: none). Under the header lock."""
        return self.load_header(0)

    def set_filling(self, generation: int) -> None:
        self.store_header(0, generation)

    def published(self) -> int:
        """The newest generation complete and visible (-1: none)."""
        return self.load_header(_PUBLISHED)

    def set_published(self, generation: int) -> None:
        self.store_header(_PUBLISHED, generation)
        _futex.wake(self.address(_PUBLISHED))

    def acks(self) -> int:
        """A count of acknowledgements (and closes): it changes whenever one lands."""
        return self.load_header(_ACKS)

    def bump_acks(self) -> None:
        """After an acknowledgement: wake a producer waiting for it. Racing bumps may count
        one: the word changes all the same, which is all a waiter looks at."""
        self.store_header(_ACKS, self.load_header(_ACKS) + 1)
        _futex.wake(self.address(_ACKS))

    def closed(self) -> bool:
        return self.load_header(_CLOSED) != 0

    def set_closed(self) -> None:
        self.store_header(_CLOSED, 1)
        _futex.wake(self.address(_PUBLISHED))

    def address(self, header_word: int) -> int:
        return self.mapping.address + 8 * header_word

    def set_checksum(self, generation: int, crc: int) -> None:
        """Before `generation` is published: its CRC-32 (or NO_SUM)."""
        word = _SUMS + pair(generation)
        self.store_header(word + 1, crc)
        self.store_header(word, generation)

    def checksum(self, generation: int) -> int | None:
        """The CRC-32 published with `generation`, or None: published without one."""
        return published_sum([self.load_header(_SUMS + i) for i in range(SUM_WORDS)], generation)


_HEADER_LOCK = (0, 8)  # the `filling` word


class Calls:
    """The calls under way on an object that another thread may close: `close` marks it closed
    at once (later calls, and waits that wake, raise ValueError naming `what`), and its mappings
    go when the last call under way leaves, so that no thread reads or sleeps on unmapped
    memory."""

    __slots__ = ("what", "_lock", "_count", "_closed", "_release")

    def __init__(self, what: str):
        self.what = what
        self._lock = threading.Lock()
        self._count = 0
        self._closed = False
        self._release: Callable[[], object] | None = None

    def enter(self) -> None:
        with self._lock:
            if self._closed:
                raise ValueError(f"this {self.what} is closed")
            self._count += 1

    def leave(self) -> None:
        with self._lock:
            self._count -= 1
            release = self._release if self._count == 0 else None
            if release is not None:
                self._release = None
        if release is not None:
            release()

    def check(self) -> None:
        """Inside a call's loop: ValueError once another thread closed the object."""
        if self._closed:
            raise ValueError(f"this {self.what} was closed")

    def close(self) -> bool:
        """Mark closed: no call starts any more. False if it was closed already."""
        with self._lock:
            was, self._closed = self._closed, True
        return not was

    def release(self, release: Callable[[], object]) -> None:
        """After `close`: `release()` now, or when the last call under way leaves."""
        with self._lock:
            if self._count:
                self._release = release
                return
        release()


_P = ParamSpec("_P")
_R = TypeVar("_R")


def counted(method: Callable[Concatenate[Any, _P], _R]) -> Callable[Concatenate[Any, _P], _R]:
    """A public method of an object with `_calls`: counted as under way while it runs."""

    @functools.wraps(method)
    def counted(self: Any, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self._calls.enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._calls.leave()

    return counted


def _positive(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _check_timeout(timeout: object) -> float:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class Arena:
    """Producer: `buffers` buffers of `nbytes` each (rounded up to 256, so that every buffer
    starts aligned for any dtype) on `device`, one allocation. `attach()` once per consumer, then
    `put()` chunk after chunk. Thread-safe: puts, publishes and attaches from several threads
    take their turns; `close()` from another thread ends their waits with ValueError."""

    def __init__(
        self,
        nbytes: int,
        device: torch.device | str | int,
        buffers: int = 2,
        *,
        storage: torch.UntypedStorage | None = None,
        words: Words = ARENA_WORDS,
    ):
        """With `storage`, the arena is that memory as it is (one buffer of exactly its bytes):
        what its consumers see is what its owner writes, e.g. packed weights. `words` are what
        errors call it and its parts (a WeightPublisher's arena speaks of its publisher)."""
        self._words = words
        self._calls = Calls(words.producer)
        self._turns = threading.Lock()  # one put, publish or attach at a time
        self.buffers = _positive(buffers, "buffers")
        if buffers > MAX_BUFFERS:
            raise ValueError(f"an arena has at most {MAX_BUFFERS} buffers, not {buffers}")
        device = torch.device(device)
        host = device.type == "cpu"  # torch's own shared memory (`_host`), no hooks
        if not host:
            hooks_for(device)  # UnsupportedDeviceError before anything is allocated
        self.device = torch.device("cpu") if host else _sharing.local_device(device, device.type)
        if storage is None:
            self.nbytes = -(-_positive(nbytes, "nbytes") // ALIGNMENT) * ALIGNMENT
            self._storage = (
                shared_host_storage(self.nbytes * buffers)
                if host
                else torch.empty(
                    self.nbytes * buffers, dtype=torch.uint8, device=self.device
                ).untyped_storage()
            )
        else:
            if buffers != 1 or storage.device != self.device or storage.nbytes() != nbytes:
                raise ValueError("an arena over a storage has one buffer: the storage's bytes")
            self.nbytes, self._storage = _positive(nbytes, "nbytes"), storage
        # one send for every consumer of CPU memory: the file torch keeps for the storage
        self._host_send = HostSend.of(self._storage) if host else None
        self._control = SharedFile(_MAGIC, _CONTROL_BYTES)
        self._records = _Records(self._control.buffer)
        self._records.set_filling(-1)
        self._records.set_published(-1)
        self._used = 0  # records handed out so far (the first ones): those the scans look at
        self._scanned = Records(
            self._records.state,
            self._records.ack,
            self._records.pid,
            self._died,
            lambda: self._used,
        )
        for generation in (-2, -1):
            self._records.set_checksum(generation, NO_SUM)
        self._token = secrets.token_bytes(16)
        self._sends: dict[int, _handles.Handle | HostSend] = {}  # record -> its send
        self._serials = itertools.count(1)
        self.generation = -1  # the last one put

    @counted
    def attach(self, *, from_newest: bool = False) -> bytes:
        """One consumer's way in, for `open_arena`: a send of the arena (opened once) and a
        record in the control file. Chunks put before it are not for that consumer; with
        `from_newest` (and two buffers or more) the newest one is, which is then kept for it
        until it acknowledges."""
        with self._turns:
            return self._attach(from_newest)

    def _attach(self, from_newest: bool) -> bytes:
        index = self._take_record()
        serial = next(self._serials)
        newest = from_newest and self.buffers > 1 and self.generation >= 0
        self._records.set_ack(index, self.generation - 1 if newest else self.generation)
        self._records.set_pid(index, 0)
        self._records.set_serial(index, serial)
        send = self._host_send or self._device_send()
        self._sends[index] = send
        self._records.set_state(index, PENDING)
        return Attachment(
            self._token, send, self._control.handle, index, self.nbytes, self.buffers, serial
        ).to_bytes()

    def _device_send(self) -> _handles.Handle:
        shared = _sharing.share_device(self._storage)
        return _handles.Handle(
            bucket=True,
            shared=shared,
            identity=_handles.identity_of(shared.device),
            table=Table([], [], [], [], []),
        )

    def _take_record(self) -> int:
        """A record nobody uses: free, or of a consumer that closed or died, or of an
        attachment nobody opened whose send ended (revoked, or its deadline passed). Taken
        under the record's lock, so no consumer is opening it meanwhile."""
        records = self._records
        for index in range(self._used):
            state = records.state(index)
            if state == ATTACHED:
                self._died(index)  # a dead consumer's record is free once marked
                state = records.state(index)
            if state == PENDING:
                send = self._sends.get(index)
                if send is not None and send.unopened():
                    continue  # its consumer may still open it
            elif state not in (FREE, CLOSED, GONE):
                continue
            start, length = self._records.lock_range(index)
            if not _locks.try_lock(self._control.fd, start, length):
                continue  # a consumer is in the middle of opening or closing it
            try:
                if records.state(index) == state:
                    records.set_state(index, FREE)
                    self._sends.pop(index, None)
                    return index
            finally:
                _locks.unlock(self._control.fd, start, length)
        if self._used < MAX_READERS:  # none to reuse: the next record, never used (FREE)
            self._used += 1
            return self._used - 1
        words = self._words
        raise ValueError(
            f"at most {MAX_READERS} {words.readers} attached at a time to one "
            f"{words.producer}: close one first (every {words.token} handed out "
            f"and never opened holds its place until it expires)"
        )

    def put(
        self,
        named_tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        timeout: float = 60.0,
        checksum: bool = False,
    ) -> bytes:
        """Copy a chunk of named tensors into the next buffer, packed as `share_tensors` packs
        them, once every attached consumer acknowledged the generation that used that buffer
        before (one that never opened its attachment is not waited for), with its CRC-32 if
        `checksum` (as `publish`);
        returns the chunk's bytes for `ArenaReader.read`. ConsumerDiedError if a consumer died
        meanwhile (it no longer counts: put again), AckTimeoutError after `timeout` seconds."""
        items = _handles.named_items(named_tensors, "Arena.put()", host=True)
        if items[0][1].device != self.device:
            raise ValueError(f"the arena is on {self.device}, the chunk on {items[0][1].device}")
        table, end = Table.packed(items)
        if end > self.nbytes:
            raise ValueError(
                f"the chunk needs {end} bytes, an arena buffer holds {self.nbytes}: "
                f"split it into smaller chunks"
            )
        generation = self.publish(
            lambda storage, base: _handles.fill(storage, base, table, items), timeout, checksum
        )
        writer = _wire.Writer(_wire.CHUNK).bytes(self._token).int(generation)
        writer.int(generation % self.buffers)
        table.write(writer)
        return writer.done()

    @counted
    def publish(
        self,
        fill: Callable[[torch.UntypedStorage, int], object] | None = None,
        timeout: float = 60.0,
        checksum: bool = False,
    ) -> int:
        """The next generation: announced, then (once every attached consumer acknowledged the
        generation that used its buffer before) `fill(storage, byte offset of its buffer)`,
        the device's work waited for, and the generation published: consumers sleeping in
        `ArenaReader.wait` wake. Returns it. With `checksum` (an arena of at most two buffers),
        the CRC-32 of its buffer goes with it, for `ArenaReader.verify`. Errors as `put`."""
        if checksum and self.buffers > 2:
            raise ValueError(f"checksums go with arenas of at most 2 buffers, not {self.buffers}")
        with self._turns:
            generation = self.generation + 1
            self.announce(generation)
            self._wait_for(generation - self.buffers, timeout)
            base = (generation % self.buffers) * self.nbytes
            if fill is not None:
                fill(self._storage, base)
            synchronize(self.device)  # before anyone reads
            self._records.set_checksum(
                generation, crc32(self._storage, base, self.nbytes) if checksum else NO_SUM
            )
            self.generation = generation
            self._records.set_published(generation)
            return generation

    @counted
    def announce(self, generation: int) -> None:
        """Say which generation is about to be filled, before looking at who to wait for: a
        consumer attaching meanwhile either is waited for or starts after what it overwrites.
        (The owner of an arena over its own storage announces the next generation before it
        writes again: see `WeightPublisher.wait_acks`.)"""
        fd = self._control.fd
        _locks.lock(fd, *_HEADER_LOCK)
        try:
            self._records.set_filling(max(generation, self._records.filling()))
        finally:
            _locks.unlock(fd, *_HEADER_LOCK)

    @counted
    def wait_for(self, generation: int, timeout: float | None = 60.0) -> None:
        """Return once every attached consumer (one that opened its attachment) acknowledged
        `generation`, or closed. ConsumerDiedError names the consumers found dead, which stop
        counting; AckTimeoutError after `timeout` (None: no bound but the consumers' lives)."""
        self._wait_for(generation, timeout)

    def _wait_for(self, generation: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + _check_timeout(timeout)
        while True:
            self._calls.check()
            seen = self._records.acks()  # before the records: an ack after it changes it
            waiting = unacknowledged(self._scanned, generation, self._words)
            if not waiting:
                return
            left = _DEATH_CHECK if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise acks_timeout(self._scanned, waiting, timeout, generation, self._words.readers)
            _futex.wait(self._records.address(_ACKS), seen, min(left, _DEATH_CHECK))

    @counted
    def wait_attached(self, count: int, timeout: float = 60.0) -> None:
        """Return once `count` consumers opened their attachments and are still attached;
        TimeoutError after `timeout` seconds, saying how many did."""
        deadline = time.monotonic() + _check_timeout(timeout)
        while True:
            self._calls.check()
            seen = self._records.acks()  # an attach changes it too
            now = attached(self._scanned)
            if now >= count:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise attach_timeout(now, count, timeout, self._words.readers)
            _futex.wait(self._records.address(_ACKS), seen, min(left, _DEATH_CHECK))

    def _died(self, index: int) -> bool:
        """An attached record whose lock is free: its consumer is gone. Marked GONE."""
        start, length = self._records.lock_range(index)
        if self._records.state(index) != ATTACHED or not _locks.try_lock(
            self._control.fd, start, length
        ):
            return False
        try:
            if self._records.state(index) != ATTACHED:
                return False  # it closed in between
            self._records.set_state(index, GONE)
            return True
        finally:
            _locks.unlock(self._control.fd, start, length)

    @counted
    def consumers(self) -> dict[int, dict]:
        """Each consumer record in use: state, last acknowledged generation, pid."""
        return {
            i: {
                "state": label(s),
                "acknowledged": self._records.ack(i),
                "pid": self._records.pid(i),
            }
            for i in range(self._used)
            if (s := self._records.state(i)) != FREE
        }

    def close(self) -> None:
        """Take back unopened sends and drop the producer's references: the memory is freed once
        the consumers that opened it let go (or died). Calls under way in other threads end
        with ValueError; the control file goes when the last of them has. Idempotent."""
        if not self._calls.close():
            return
        self._revoke_sends()
        self._records.set_closed()  # consumers waiting for a generation are told
        _futex.wake(self._records.address(_ACKS))  # and our own waits look again
        self._calls.release(self._let_go)

    def _revoke_sends(self) -> None:
        for index in list(self._sends):
            send = self._sends.pop(index, None)
            if send is not None:
                send.revoke()

    def _let_go(self) -> None:
        self._revoke_sends()  # an attach that was under way at the close
        self._storage = None  # type: ignore[assignment]
        self._control.close()

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<devipc.Arena {self.buffers} x {self.nbytes} bytes on {self.device}, "
            f"generation {self.generation}>"
        )


class Chunk:
    """One chunk as a consumer sees it: its generation and its tensors, views of the arena that
    stay valid until the consumer acknowledges the generation."""

    __slots__ = ("generation", "tensors")

    def __init__(self, generation: int, tensors: dict[str, torch.Tensor]):
        self.generation, self.tensors = generation, tensors

    def __repr__(self) -> str:
        return f"<devipc.Chunk {self.generation} of {len(self.tensors)} tensors>"


class Attachment(NamedTuple):
    """An arena attachment's fields, read and checked without opening anything: a caller may
    check what comes with it (a publisher token's table) before the one open is spent."""

    token: bytes
    send: _handles.Handle | HostSend  # device memory, or a CPU arena's shared memory
    control: bytes
    record: int
    nbytes: int
    buffers: int
    serial: int

    def to_bytes(self) -> bytes:
        return (
            _wire.Writer(_wire.ARENA)
            .bytes(self.token)
            .bytes(bytes(self.send))
            .bytes(self.control)
            .int(self.record)
            .int(self.nbytes)
            .int(self.buffers)
            .int(self.serial)
            .done()
        )

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, name: str = "arena attachment"
    ) -> "Attachment":
        """`name`: what errors call it (the token of a weight publisher it is part of)."""
        reader = _wire.Reader(data, (_wire.ARENA,), name)
        token = reader.bytes("identity", 64)
        send = _handles.bucket_or_host_send(reader.bytes("memory handle"), name)
        control = reader.bytes("control file handle", 1024)
        record = reader.int("reader index", 0, MAX_READERS - 1)
        nbytes = reader.int("buffer size", 1)
        buffers = reader.int("buffer count", 1, MAX_BUFFERS)
        serial = reader.int("serial")
        reader.end()
        if send.kind != "bucket" or send.nbytes != nbytes * buffers:
            raise InvalidHandleError(
                f"this {name} is damaged: its memory has {send.nbytes} "
                f"bytes, not {buffers} x {nbytes}"
            )
        return cls(token, send, control, record, nbytes, buffers, serial)


class ArenaReader:
    """Consumer: an arena opened once; `read` each chunk's bytes, then `ack` it. `close()` from
    another thread ends a `wait` under way there with ValueError."""

    def __init__(
        self,
        data: bytes | bytearray | memoryview | Attachment,
        device: torch.device | str | int | None = None,
        *,
        words: Words = ARENA_WORDS,
    ):
        """`data`: `Arena.attach()`'s bytes, or their `Attachment`. `words` are what errors
        call it and its parts."""
        attachment = data if isinstance(data, Attachment) else Attachment.from_bytes(data)
        self._words = words
        self._calls = Calls(words.reader)
        self._token, self._index = attachment.token, attachment.record
        self.nbytes, self.buffers = attachment.nbytes, attachment.buffers
        self._mapping = open_shared_file(attachment.control, _MAGIC, words.token)
        self._producer = handle_pid(attachment.control)  # a valid handle: it opened
        try:
            if self._mapping.size != _CONTROL_BYTES:
                raise InvalidHandleError(
                    f"this {words.token} is damaged: its control file has "
                    f"{self._mapping.size} bytes, not {_CONTROL_BYTES}"
                )
            self._records = _Records(self._mapping)
            if (
                not _locks.try_lock(self._mapping.fd, *self._records.lock_range(self._index))
                or self._records.state(self._index) != PENDING
                or self._records.serial(self._index) != attachment.serial
            ):
                raise InvalidHandleError(
                    f"this {words.token} was already opened "
                    f"({words.one_each}), revoked, or the "
                    f"{words.producer} is closed"
                )
            self._storage: torch.UntypedStorage | None = _open_send(
                attachment.send, device, words.token
            )
        except BaseException:
            self._mapping.close()  # the lock goes with it
            raise
        self.device = self._storage.device
        records, index = self._records, self._index
        records.set_pid(index, os.getpid())
        records.set_state(index, ATTACHED)
        _locks.lock(self._mapping.fd, *_HEADER_LOCK)  # after ATTACHED: see `Arena.announce`
        try:
            filling = records.filling()
        finally:
            _locks.unlock(self._mapping.fd, *_HEADER_LOCK)
        self.acknowledged = max(records.ack(index), filling - self.buffers)
        records.set_ack(index, self.acknowledged)
        self._read = self.acknowledged
        records.bump_acks()  # a producer waiting for consumers to attach looks again

    @counted
    def wait(self, timeout: float | None = None) -> int:
        """Sleep until a generation newer than any this reader read or waited for is published
        (`Arena.publish`, `put`); returns the newest, to read until acknowledged. PeerGoneError
        if the arena was closed or its producer exited; TimeoutError after `timeout` seconds."""
        records = self._records
        deadline = None if timeout is None else time.monotonic() + _check_timeout(timeout)
        while True:
            self._calls.check()
            published = records.published()
            if published > self._read:
                self._read = published
                return published
            if records.closed():
                raise PeerGoneError(
                    f"the {self._words.producer} was closed: nothing more will be published"
                )
            if not pid_alive(self._producer):
                raise PeerGoneError(
                    f"the {self._words.producer}'s process (pid {self._producer}) exited"
                )
            left = _DEATH_CHECK * 5 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no new generation within {timeout} s (the newest is {published})"
                )
            _futex.wait(records.address(_PUBLISHED), published, min(left, _DEATH_CHECK * 5))

    def ready(self) -> bool:
        """Whether `wait()` would return (or raise) at once: a newer generation is published,
        the arena was closed or its producer exited. Never blocks."""
        records = self._records
        return records.published() > self._read or records.closed() or not pid_alive(self._producer)

    @counted
    def views(self, generation: int, table: Table) -> dict[str, torch.Tensor]:
        """`table`'s tensors in the buffer of `generation`, read and not yet acknowledged."""
        if not self.acknowledged < generation <= self._read:
            raise ValueError(
                f"generation {generation} is not held: read or waited for up to "
                f"{self._read}, acknowledged up to {self.acknowledged}"
            )
        return table.views(self._held(), shift=(generation % self.buffers) * self.nbytes)

    @counted
    def read(self, data: bytes | bytearray | memoryview) -> Chunk:
        """The tensors of a chunk's bytes from `Arena.put`, as views of the arena (clone what
        must outlive the acknowledgement)."""
        reader = _wire.Reader(data, (_wire.CHUNK,))
        if reader.bytes("arena token", 64) != self._token:
            raise InvalidHandleError("this chunk belongs to another arena")
        generation = reader.int("generation")
        buffer = reader.int("buffer", 0, self.buffers - 1)
        table = Table.read(reader, self.nbytes)
        reader.end()
        if generation <= self.acknowledged:
            raise InvalidHandleError(
                f"chunk {generation} is older than the acknowledged "
                f"generation {self.acknowledged} (acknowledged here, or put "
                f"before this reader opened the arena): its buffer may be "
                f"reused"
            )
        if buffer != generation % self.buffers:
            raise InvalidHandleError(
                f"chunk {generation} claims buffer {buffer}, not {generation % self.buffers}"
            )
        self._read = max(self._read, generation)
        base = buffer * self.nbytes
        return Chunk(generation, table.views(self._held(), shift=base))

    @counted
    def ack(self, generation: int | Chunk) -> None:
        """Done with every chunk up to `generation` (or a Chunk): the producer may reuse their
        buffers. Waits for the device work queued on them first."""
        if isinstance(generation, Chunk):
            generation = generation.generation
        if not isinstance(generation, int) or isinstance(generation, bool):
            raise TypeError(f"acknowledge a generation (int) or a Chunk, not {generation!r}")
        if generation > self._read:
            raise ValueError(f"generation {generation} was not read yet (last read: {self._read})")
        if generation <= self.acknowledged:
            return
        synchronize(self.device)
        self._records.set_ack(self._index, generation)
        self.acknowledged = generation
        self._records.bump_acks()

    @counted
    def verify(self, generation: int) -> None:
        """Compute the CRC-32 of the held `generation`'s buffer as this reader sees it, and
        compare it with the one published with it: ChecksumError if they differ, ValueError if
        it was published without one. Before `ack`: the buffer may be refilled after."""
        if not self.acknowledged < generation <= self._read:
            raise ValueError(
                f"generation {generation} is not held: read or waited for up to "
                f"{self._read}, acknowledged up to {self.acknowledged}"
            )
        expected = self._records.checksum(generation)
        if expected is None:
            raise ValueError(
                f"generation {generation} was published without a checksum: the "
                f"{self._words.producer} publishes with checksum=True"
            )
        synchronize(self.device)
        found = crc32(self._held(), (generation % self.buffers) * self.nbytes, self.nbytes)
        if found != expected:
            raise ChecksumError(
                f"generation {generation} holds other bytes here than the "
                f"{self._words.producer} published (CRC-32 {found:08x}, "
                f"published {expected:08x})"
            )

    def _held(self) -> torch.UntypedStorage:
        assert self._storage is not None  # until the last call under way left
        return self._storage

    def close(self) -> None:
        """Detach: the producer stops waiting for this consumer. Views still held keep the
        memory mapped until they die. A `wait` under way in another thread ends with
        ValueError, and the detach happens as it leaves. Idempotent."""
        if not self._calls.close():
            return
        _futex.wake(self._records.address(_PUBLISHED))  # a wait under way looks again
        self._calls.release(self._detach)

    def _detach(self) -> None:
        synchronize(self.device)
        self._records.set_state(self._index, CLOSED)
        self._records.bump_acks()  # a producer waiting for this consumer stops
        self._mapping.close()  # the lock goes with it
        self._storage = None

    def __enter__(self) -> "ArenaReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<devipc.ArenaReader {self.buffers} x {self.nbytes} bytes on {self.device}, "
            f"acknowledged {self.acknowledged}>"
        )


def open_arena(
    data: bytes | bytearray | memoryview, device: torch.device | str | int | None = None
) -> ArenaReader:
    """Consumer: open an arena from `Arena.attach()`'s bytes, once. `device` as in `open`."""
    return ArenaReader(data, device)


def _open_send(
    send: _handles.Handle | HostSend, device: torch.device | str | int | None, what: str
) -> torch.UntypedStorage:
    """The arena's memory in this process: on `device` (None: the producer's own), the CPU
    included where the memory is host memory. Checked before the send's one open is spent."""
    cpu = device is not None and torch.device(device).type == "cpu"
    if isinstance(send, HostSend):
        if device is not None and not cpu:
            raise ValueError(
                f"this {what} is of CPU memory: open it on the CPU (device=None or "
                f"'cpu'), then copy what {torch.device(device)} needs (copy_into "
                f"a model on it copies)"
            )
        return send.open(what)
    if cpu:
        if not host_addressable(send.device):
            raise not_host_memory(send.device, what)
        return as_host(_handles.open_storage(send, None), what)
    return _handles.open_storage(send, device)
