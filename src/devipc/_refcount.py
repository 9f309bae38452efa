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


class ProducerPool:
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
    """The consumer's mappings of producers' counter files, kept while a slot is outstanding."""

    def __init__(self, producer: ProducerPool):
        self._producer = producer
        self._lock = threading.Lock()
        self._mapped: dict[bytes, list] = {}  # handle -> [mmap, outstanding slots]

    def hold(self, handle: bytes) -> None:
        """Map (once) the file of a slot the caller will `release` later."""
        if self._producer.own_buffer(handle) is not None:
            return
        with self._lock:
            entry = self._mapped.get(handle)
            if entry is not None:
                entry[1] += 1
                return
        buffer = open_shared_file(handle, _MAGIC)
        with self._lock:
            entry = self._mapped.setdefault(handle, [buffer, 0])
            entry[1] += 1
        if entry[0] is not buffer:
            buffer.close()

    def release(self, handle: bytes, index: int) -> None:
        """Decrement the slot and drop the mapping once no held slot of it is left."""
        own = self._producer.own_buffer(handle)
        if own is not None:
            _decrement(own, index)
            return
        with self._lock:
            buffer, held = self._mapped[handle]
            _decrement(buffer, index)
            if held == 1:
                del self._mapped[handle]
                buffer.close()
            else:
                self._mapped[handle][1] = held - 1

    def mapped_files(self) -> int:
        with self._lock:
            return len(self._mapped)


def check_index(index) -> int:
    """Slot indices come from the wire: refuse anything that would write out of the file."""
    if not isinstance(index, int) or not 0 <= index < SLOTS_PER_FILE:
        raise InvalidHandleError(f"ref-counter offset {index!r} is outside 0..{SLOTS_PER_FILE - 1}")
    return index

