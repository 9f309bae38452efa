"""Ref-counter slots: how a producer learns that a consumer let go of what it was sent.

Each send takes one int64 slot, set to 1, in a producer-owned shared file of 10,000 slots (as
CUDA IPC does). The consumer that rebuilds the tensor decrements it when its storage dies (or at
once on a cache hit); the producer frees the sent storage when the slot reads 0. A slot has one
writer at a time, so an aligned 8-byte store is enough: no cross-process atomics are needed.
"""
import threading

from ._errors import InvalidHandleError
from ._memfd import SharedFile, open_shared_file

SLOTS_PER_FILE = 10_000
_MAGIC = b"RCNT"


def _decrement(mapping, index: int) -> None:
    slot = mapping.int64(index)
    slot.value = max(0, slot.value - 1)


class _CounterFile:
    __slots__ = ("file", "used", "live")

    def __init__(self):
        self.file = SharedFile(_MAGIC, SLOTS_PER_FILE * 8)
        self.used = 0  # slots handed out, never reused: a stale handle can't hit a new send
        self.live = 0  # handed out and not yet freed


class ProducerSlot:
    """One send's counter, owned by the producer's sent-data entry."""

    __slots__ = ("_pool", "_counter", "index")

    def __init__(self, pool, counter: _CounterFile, index: int):
        self._pool, self._counter, self.index = pool, counter, index

    @property
    def handle(self) -> bytes:
        return self._counter.file.handle

    def value(self) -> int:
        return self._counter.file.buffer.int64(self.index).value

    def free(self) -> None:
        self._pool._free(self._counter)


class ProducerCounters:
    """The producer's counter files. Thread-safe: Queue feeder threads share tensors too."""

    def __init__(self):
        self._lock = threading.Lock()
        self._current: _CounterFile | None = None
        self._by_handle: dict[bytes, _CounterFile] = {}

    def allocate(self) -> ProducerSlot:
        with self._lock:
            counter = self._current
            if counter is None or counter.used == SLOTS_PER_FILE:
                counter = self._current = _CounterFile()
                self._by_handle[counter.file.handle] = counter
            index = counter.used
            counter.used += 1
            counter.live += 1
            counter.file.buffer.int64(index).value = 1
            return ProducerSlot(self, counter, index)

    def _free(self, counter: _CounterFile) -> None:
        with self._lock:
            counter.live -= 1
            if counter.live == 0 and counter.used == SLOTS_PER_FILE:
                del self._by_handle[counter.file.handle]
                counter.file.close()

    def own_buffer(self, handle: bytes):
        """This process's own buffer for `handle`, so a same-process consumer maps nothing."""
        with self._lock:
            counter = self._by_handle.get(handle)
            return None if counter is None else counter.file.buffer

    def open_files(self) -> int:
        with self._lock:
            return len(self._by_handle)


class ConsumerCounters:
    """The consumer's mappings of producers' counter files.

    A file stays mapped while one of its slots is held, then joins a few idle mappings kept for
    the next send of the same producer: mapping costs more than the rest of a receive. Keys are
    whole handles, random token included, so an idle mapping can never be taken for another file.
    """

    IDLE_KEPT = 8

    def __init__(self, producer: ProducerCounters):
        self._producer = producer
        self._lock = threading.Lock()
        self._held: dict[bytes, list] = {}  # handle -> [mapping, held slots]
        self._idle: dict[bytes, object] = {}  # handle -> mapping, oldest first

    def hold(self, handle: bytes) -> None:
        """Map (once) the file of a slot the caller will `release` later."""
        if self._producer.own_buffer(handle) is not None:
            return
        with self._lock:
            if self._take(handle):
                return
        mapping = open_shared_file(handle, _MAGIC)
        with self._lock:
            if not self._take(handle):
                self._held[handle] = [mapping, 1]
                return
        mapping.close()  # another thread mapped it meanwhile

    def _take(self, handle: bytes) -> bool:
        entry = self._held.get(handle)
        if entry is not None:
            entry[1] += 1
            return True
        mapping = self._idle.pop(handle, None)
        if mapping is not None:
            self._held[handle] = [mapping, 1]
        return mapping is not None

    def release(self, handle: bytes, index: int) -> None:
        """Decrement the slot; a file with no held slot left becomes idle."""
        own = self._producer.own_buffer(handle)
        if own is not None:
            _decrement(own, index)
            return
        evicted = None
        with self._lock:
            entry = self._held[handle]
            _decrement(entry[0], index)
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[handle]
                self._idle[handle] = entry[0]
                if len(self._idle) > self.IDLE_KEPT:
                    evicted = self._idle.pop(next(iter(self._idle)))
        if evicted is not None:
            evicted.close()

    def mapped_files(self) -> int:
        with self._lock:
            return len(self._held) + len(self._idle)


def check_index(index) -> int:
    """Slot indices come from the wire: refuse anything that would write out of the file."""
    if not isinstance(index, int) or not 0 <= index < SLOTS_PER_FILE:
        raise InvalidHandleError(f"ref-counter offset {index!r} is outside 0..{SLOTS_PER_FILE - 1}")
    return index

