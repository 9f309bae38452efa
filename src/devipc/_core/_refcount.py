"""Ref-counter slots: how a producer learns that its consumers let go of what it sent, also when
they die without saying so.

Each send takes one slot in a producer-owned shared file (a memfd) of 10,000 slots, as CUDA IPC
does. The file starts with a header whose first int64 is the cursor (slots handed out so far; a
slot is never reused), then holds the slots, two int64 each: (state, export). `export` names what
the producer exported, so that a slot taken by a forwarding consumer still counts for it.

States: SENT until a consumer opens the slot, HELD while it holds it, then RELEASED; REVOKED when
the producer took an unopened send back. Every change of a slot happens under an OFD write lock
(`_locks`) on the slot's bytes, and a consumer keeps that lock while the slot is HELD: the kernel
drops it when the consumer dies, so a HELD slot whose lock is free belongs to a dead consumer. The
cursor is taken under a lock on the header, so a consumer can take a slot in the producer's file
to forward what it received.
"""

import collections
import threading
from collections.abc import Callable
from typing import TypeVar

from . import _locks
from ._backoff import Backoff
from ._errors import InvalidHandleError, SpentHandleError
from ._memfd import (
    MappedFile,
    SharedFile,
    WordTable,
    handle_pid,
    open_shared_file,
    pid_exists,
    producer_alive,
)

SLOTS_PER_FILE = 10_000
RESERVED_SLOTS = 32  # slots a producer takes from its file's cursor at once
SLOT_FIELDS = 2  # state, export
FILE_BYTES = WordTable.size(SLOTS_PER_FILE, SLOT_FIELDS)
RELEASED, SENT, HELD, REVOKED = 0, 1, 2, -1
_MAGIC = b"RCNT"
T = TypeVar("T")
_BUSY_SECONDS = 1.0  # how long an open waits for a slot another party locks for an instant
_CURSOR = (0, 8)  # the header word counting the slots handed out, and its lock range


class CounterFile:
    """One open of a counter file: its mapping and the descriptor its locks are taken through."""

    __slots__ = ("mapping", "fd", "_words")

    def __init__(self, mapping: MappedFile, fd: int):
        self.mapping, self.fd = mapping, fd
        self._words = WordTable(mapping, SLOT_FIELDS)

    # -- layout --
    def cursor(self) -> int:
        return self._words.load_header()

    def state(self, index: int) -> int:
        return self._words.load(index, 0)

    def export(self, index: int) -> int:
        return self._words.load(index, 1)

    def _set(self, index: int, state: int) -> None:
        self._words.store(index, 0, state)

    # -- transitions --
    def take(self, export: int) -> int | None:
        """A new SENT slot for `export`, or None when the file is full."""
        slots = self.reserve(1, export)
        return slots[0] if slots else None

    def reserve(self, count: int, export: int | None = None) -> range:
        """Up to `count` fresh slots (empty: the file is full): for this process to `assign`
        later, reading RELEASED until then so that no consumer can open them; or, with `export`,
        SENT slots for it, assigned before the cursor moves past them: the producer lists the
        slots others took, once each, by the export they name (`ProducerCounters.new_slots`),
        and a slot it saw unassigned would never keep its export's memory."""
        _locks.lock(self.fd, *_CURSOR)
        try:
            start = self.cursor()
            if not 0 <= start < SLOTS_PER_FILE:
                return range(0)
            end = min(start + count, SLOTS_PER_FILE)
            if export is not None:
                for index in range(start, end):
                    self.assign(index, export)
            self._words.store_header(0, end)
            return range(start, end)
        finally:
            _locks.unlock(self.fd, *_CURSOR)

    def assign(self, index: int, export: int) -> None:
        """A reserved slot becomes a SENT one for `export`."""
        self._words.store(index, 1, export)
        self._words.store(index, 0, SENT)

    def _lock_slot(self, index: int) -> tuple[int, int]:
        """Lock a slot that nobody holds, and return its lock range; SpentHandleError if a consumer
        holds it."""
        start, length = self._words.lock_range(index)
        if _locks.try_lock(self.fd, start, length):
            return start, length
        # the producer or a forwarder holds it for a few instructions
        backoff = Backoff(_BUSY_SECONDS, first=0.0001, longest=0.0001)
        while not _locks.try_lock(self.fd, start, length):
            if self.state(index) == HELD or backoff.expired():
                raise SpentHandleError(
                    "this send was already opened by another process: each "
                    "send may be opened once. Send the tensor again for "
                    "every consumer."
                )
            backoff.pause()
        return start, length

    def acquire(self, index: int, opening: Callable[[], T]) -> T:
        """Consumer: SENT -> HELD, keeping the lock until `release`. `opening` runs under the
        lock, before the slot is taken: if it raises, the send stays for genuine bytes."""
        start, length = self._lock_slot(index)
        words = self._words
        state = words.load(index, 0)
        if state != SENT:
            _locks.unlock(self.fd, start, length)
            raise SpentHandleError(
                {
                    RELEASED: "this send was already opened and released: each send may be opened "
                    "once",
                    HELD: "this send was already opened by another process",
                    REVOKED: "the producer revoked this send before it was opened "
                    "(see devipc.revoke and devipc.set_unopened_deadline)",
                }.get(state, f"ref-counter slot in unknown state {state}")
            )
        try:
            opened = opening()
        except BaseException:
            _locks.unlock(self.fd, start, length)
            raise
        words.store(index, 0, HELD)
        return opened

    def release(self, index: int) -> None:
        """Consumer: HELD -> RELEASED, and the lock goes."""
        self._words.store(index, 0, RELEASED)
        _locks.unlock(self.fd, *self._words.lock_range(index))

    def release_unopened(self, index: int) -> None:
        """Consumer that already holds the memory (cache hit): SENT -> RELEASED."""
        start, length = self._lock_slot(index)
        try:
            if self.state(index) == SENT:
                self._set(index, RELEASED)
        finally:
            _locks.unlock(self.fd, start, length)

    def reclaim_if_holder_died(self, index: int) -> bool:
        """Producer: HELD -> RELEASED when the consumer's lock is gone (it died)."""
        start, length = self._words.lock_range(index)
        if not _locks.try_lock(self.fd, start, length):
            return False  # held: the consumer lives
        try:
            if self.state(index) != HELD:
                return self.state(index) in (RELEASED, REVOKED)
            self._set(index, RELEASED)
            return True
        finally:
            _locks.unlock(self.fd, start, length)

    def revoke(self, index: int) -> bool:
        """Producer: SENT -> REVOKED unless a consumer is opening it right now."""
        start, length = self._words.lock_range(index)
        if not _locks.try_lock(self.fd, start, length):
            return False
        try:
            if self.state(index) != SENT:
                return False
            self._set(index, REVOKED)
            return True
        finally:
            _locks.unlock(self.fd, start, length)


class ProducerFile:
    """A counter file this process owns, and what it knows of the slots in it."""

    __slots__ = ("shared", "counter", "seen", "own", "listed", "reserved")

    def __init__(self) -> None:
        self.shared = SharedFile(_MAGIC, FILE_BYTES)
        self.counter = CounterFile(self.shared.buffer, self.shared.fd)
        self.seen = 0  # slots below this index have been looked at by `new_slots`
        self.own: set[int] = set()  # slots at or above `seen` that this process took itself
        self.listed = 0  # slots of this file an export still tracks (kept by the caller)
        self.reserved: collections.deque[int] = collections.deque()  # taken, not assigned yet

    @property
    def handle(self) -> bytes:
        return self.shared.handle


class ProducerCounters:
    """The producer's counter files. Thread-safe: Queue feeder threads share tensors too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: ProducerFile | None = None
        self._files: dict[bytes, ProducerFile] = {}

    def allocate(self, export: int) -> tuple[ProducerFile, int]:
        """A SENT slot for `export`. Slots are reserved RESERVED_SLOTS at a time: one lock of
        the file's cursor (which forwarders and peers take too) per that many sends."""
        with self._lock:
            file = self._current
            if file is None or not (file.reserved or self._reserve(file)):
                file = self._current = ProducerFile()
                self._files[file.handle] = file
                self._reserve(file)  # a new file has every slot free
            index = file.reserved.popleft()
            file.counter.assign(index, export)
            return file, index

    @staticmethod
    def _reserve(file: ProducerFile) -> bool:
        slots = file.counter.reserve(RESERVED_SLOTS)
        file.reserved.extend(slots)
        file.own.update(slots)
        return bool(slots)

    def file(self, handle: bytes) -> ProducerFile | None:
        """One of our files, by handle; None for another process's."""
        with self._lock:
            return self._files.get(handle)

    def new_slots(self) -> list[tuple[ProducerFile, int, int]]:
        """(file, index, export) of slots others (forwarders) took in our files since the last
        call. Read the cursor after the states of the slots it is compared with: a forwarder
        takes its new slot before it lets go of its own."""
        found = []
        with self._lock:
            for file in self._files.values():
                cursor = min(file.counter.cursor(), SLOTS_PER_FILE)
                for index in range(file.seen, cursor):
                    if index in file.own:
                        file.own.discard(index)
                    else:
                        found.append((file, index, file.counter.export(index)))
                file.seen = max(file.seen, cursor)
        return found

    def close_finished(self) -> None:
        """Close full files that no export tracks a slot of any more; every slot in them was
        seen, and each ended or was not ours to track."""
        with self._lock:
            for handle, file in list(self._files.items()):
                if file is not self._current and file.seen >= SLOTS_PER_FILE and file.listed == 0:
                    del self._files[handle]
                    file.shared.close()

    def open_files(self) -> int:
        with self._lock:
            return len(self._files)

    def forget_after_fork(self) -> None:
        """A forked child owns none of its parent's files (the fds stay for the parent)."""
        self._lock = threading.Lock()
        self._current, self._files = None, {}


class ConsumerCounters:
    """The consumer's opens of producers' counter files, one per file, through which it holds
    slots; a file without held slots joins a few idle opens kept for the next send of the same
    producer (opening costs more than the rest of a receive), unless that producer has died: a
    dead process's file is never kept mapped here (`prune`). Keys are whole handles, random
    token included, so an idle open can never be taken for another file. A producer's own file
    is opened the same way: its own descriptor would not see its own locks as someone else's.
    """

    IDLE_KEPT = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[bytes, list] = {}  # handle -> [CounterFile, slots held]
        self._idle: dict[bytes, CounterFile] = {}  # oldest first
        self._mine: set[tuple[bytes, int]] = set()  # slots this process holds

    def _open(self, handle: bytes) -> CounterFile:
        """The file, counted as held once more; the caller must `_put` it back."""
        with self._lock:
            entry = self._held.get(handle)
            if entry is None and handle in self._idle:
                entry = self._held[handle] = [self._idle.pop(handle), 0]
            if entry is not None:
                entry[1] += 1
                return entry[0]
        self.prune()
        opened = open_counter_file(handle)
        with self._lock:
            entry = self._held.get(handle)
            spare = entry is not None  # another thread opened it meanwhile
            if entry is None:
                entry = self._held[handle] = [opened, 0]
            entry[1] += 1
        if spare:
            opened.mapping.close()
        return entry[0]

    def _put(self, handle: bytes) -> None:
        evicted = None
        with self._lock:
            entry = self._held[handle]
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[handle]
                if pid_exists(handle_pid(handle)):  # a zombie's file goes at the next `prune`
                    self._idle[handle] = entry[0]
                    if len(self._idle) > self.IDLE_KEPT:
                        evicted = self._idle.pop(next(iter(self._idle)))
                else:
                    evicted = entry[0]
        if evicted is not None:
            evicted.mapping.close()

    def prune(self) -> None:
        """Close the idle opens of producers that died since: nothing will come from them."""
        with self._lock:
            dead = [handle for handle in self._idle if not producer_alive(handle)]
            files = [self._idle.pop(handle) for handle in dead]
        for file in files:
            file.mapping.close()

    def hold(self, handle: bytes, index: int, opening: Callable[[], T]) -> T:
        """Open a sent slot (checked by `check_slot`) and hold it until `release`; returns what
        `opening` (see `CounterFile.acquire`) returns."""
        slot = (handle, index)
        with self._lock:  # the common case: one lock for the file and the slot
            if slot in self._mine:
                raise SpentHandleError(
                    "this send is already opened in this process: each send may be opened once"
                )
            self._mine.add(slot)
            entry = self._held.get(handle)
            if entry is not None:
                entry[1] += 1
        try:
            file = entry[0] if entry is not None else self._open(handle)
        except BaseException:
            with self._lock:
                self._mine.discard(slot)
            raise
        try:
            return file.acquire(index, opening)
        except BaseException:
            with self._lock:
                self._mine.discard(slot)
            self._put(handle)
            raise

    def release(self, handle: bytes, index: int) -> None:
        with self._lock:
            file = self._held[handle][0]
            self._mine.discard((handle, index))
        file.release(index)
        self._put(handle)

    def release_unopened(self, handle: bytes | None, index: int) -> None:
        """Give back a send whose memory this process already holds through an earlier one
        (nothing to give back when it is that very send, rebuilt twice here)."""
        handle, index = check_slot(handle, index)
        if (handle, index) in self._mine:
            return
        file = self._open(handle)
        try:
            file.release_unopened(index)
        finally:
            self._put(handle)

    def forward(self, handle: bytes, held_index: int) -> int:
        """A new slot, in the producer's file, for what `held_index` (held here) was sent for."""
        with self._lock:
            file = self._held[handle][0]
        index = file.take(file.export(held_index))
        if index is None:
            raise InvalidHandleError(
                "cannot forward: the producer's ref-counter file is full; send a clone() instead"
            )
        return index

    def mapped_files(self) -> int:
        with self._lock:
            return len(self._held) + len(self._idle)

    def forget_after_fork(self) -> None:
        """A forked child holds none of its parent's slots. Closing its copies of the fds keeps
        the parent's locks (they belong to the open file description the parent still has)."""
        for entry in [*self._held.values(), *([f] for f in self._idle.values())]:
            entry[0].mapping.close()
        self._lock = threading.Lock()
        self._held, self._idle, self._mine = {}, {}, set()


def open_counter_file(handle: bytes) -> CounterFile:
    """A producer's counter file by its handle, mapped and checked; `.mapping.close()` it."""
    mapping = open_shared_file(handle, _MAGIC)
    if mapping.size != FILE_BYTES:
        mapping.close()
        raise InvalidHandleError(
            f"a ref-counter file has {FILE_BYTES} bytes, this one {mapping.size}"
        )
    return CounterFile(mapping, mapping.fd)


def check_slot(handle: object, index: object) -> tuple[bytes, int]:
    """A counter handle and slot index from the wire, checked before anything is mapped."""
    if not isinstance(handle, (bytes, bytearray)):
        raise InvalidHandleError(f"a ref-counter handle is bytes, got {type(handle).__name__}")
    return bytes(handle), check_index(index)


def check_index(index: object) -> int:
    """Slot indices come from the wire: refuse anything that would reach outside the file."""
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < SLOTS_PER_FILE:
        raise InvalidHandleError(f"ref-counter offset {index!r} is outside 0..{SLOTS_PER_FILE - 1}")
    return index
