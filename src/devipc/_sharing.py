"""Storage sharing with the RFC's semantics: share_device, new_shared_device,
release_ipc_counter_device, the producer's sent data and the consumer's mappings.

Producer: synchronize (or record an interprocess event), get (handle, offset) from the hooks, take a
ref-counter slot, and keep the storage alive until the slot reads 0 (`ipc_collect`).
Consumer: map each base allocation once per process, make a storage at base + offset whose death
releases the slot and, with the last storage of that allocation, the mapping.
"""
import threading
import warnings

import torch

from ._errors import InvalidHandleError, ReshareError
from ._hooks import OpenedMemory, hooks_for
from ._memory import storage_from_memory
from ._refcount import ConsumerCounters, ProducerCounters, ProducerSlot, check_index

LIMBO_WARN_BLOCKS = 1_000

_pool = ProducerCounters()
_counters = ConsumerCounters(_pool)


class _SentData:
    """Sent storages, each kept alive until its consumer released the slot."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: list[tuple[torch.UntypedStorage, ProducerSlot]] = []
        self._collect_at = 64  # amortizes the scan: grows with what is really held
        self._warned = False

    def add(self, storage: torch.UntypedStorage, slot: ProducerSlot) -> None:
        with self._lock:
            self._entries.append((storage, slot))
            crowded = len(self._entries) >= self._collect_at
        if crowded:
            self.collect()

    def collect(self) -> int:
        """Free what consumers released; returns how many storages were let go."""
        with self._lock:
            held, released = [], []
            for entry in self._entries:
                (released if entry[1].value() == 0 else held).append(entry)
            self._entries = held
            self._collect_at = max(64, 2 * len(held))
            warn = len(held) > LIMBO_WARN_BLOCKS and not self._warned
            self._warned = len(held) > LIMBO_WARN_BLOCKS
        for _storage, slot in released:
            slot.free()
        if warn:
            warnings.warn(f"devipc: {len(held)} shared storages are still held by consumers; "
                          f"their memory stays allocated until the consumers drop the tensors they "
                          f"received", ResourceWarning, stacklevel=3)
        return len(released)

    def __len__(self):
        with self._lock:
            return len(self._entries)


_sent = _SentData()


class _OpenedAllocations:
    """The consumer's opened base allocations (the hooks' OpenedMemory): each opened once per
    process, closed with its last storage."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_handle: dict[bytes, list] = {}  # handle -> [OpenedMemory, live storages]

    def acquire(self, hooks, handle: bytes) -> OpenedMemory:
        with self._lock:
            entry = self._by_handle.get(handle)
            if entry is not None:
                entry[1] += 1
                return entry[0]
            # Opening under the lock: two threads must not map the same allocation twice.
            memory = hooks.open_ipc_mem_handle(handle)
            self._by_handle[handle] = [memory, 1]
            return memory

    def release(self, handle: bytes) -> None:
        with self._lock:
            entry = self._by_handle[handle]
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._by_handle[handle]
        entry[0].close()

    def contains(self, device: torch.device, ptr: int) -> bool:
        with self._lock:
            return any(m.device.type == device.type and m.ptr <= ptr < m.ptr + max(m.size, 1)
                       for m, _ in self._by_handle.values())

    def __len__(self):
        with self._lock:
            return len(self._by_handle)


_opened = _OpenedAllocations()


def received_via_ipc(storage) -> bool:
    """Whether `storage` (or a tensor's storage) lives in memory this process received by IPC."""
    if isinstance(storage, torch.Tensor):
        storage = storage.untyped_storage()
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    return storage.nbytes() > 0 and _opened.contains(storage.device, storage.data_ptr())


def share_device(storage: torch.UntypedStorage) -> tuple:
    """Producer: the RFC's 8-tuple (device, handle, size_bytes, offset_bytes, ref_counter_handle,
    ref_counter_offset, event_handle, event_sync_required).

    Without events the producer waits for all work queued on the device (every stream: the
    pickling thread of a Queue is not the thread that queued the work). With events it records
    one on the device's current stream of the calling thread.
    """
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    device = storage.device
    hooks = hooks_for(device)
    if received_via_ipc(storage):
        raise ReshareError(f"this {device} storage was received from another process; sending it "
                           f"on is not supported yet. Send a clone() instead.")
    if storage.nbytes() == 0:
        return (device, None, 0, 0, None, 0, b"", False)
    event_sync_required = bool(hooks.requires_event_sync())
    if event_sync_required:
        event_handle = hooks.get_ipc_event_handle(device)
    else:
        event_handle = b""
        torch.get_device_module(device).synchronize(device)
    handle, offset = hooks.get_ipc_mem_handle(storage.data_ptr())
    slot = _pool.allocate()
    _sent.add(storage, slot)
    return (device, handle, storage.nbytes(), offset, slot.handle, slot.index, event_handle,
            event_sync_required)


def new_shared_device(device, handle: bytes, size_bytes: int, offset_bytes: int,
                      ref_counter_handle: bytes, ref_counter_offset: int, event_handle: bytes,
                      event_sync_required: bool) -> torch.UntypedStorage:
    """Consumer: a storage over the producer's memory, zero-copy. Its device is the local device
    that owns the memory, whatever index the producer used for it."""
    hooks = hooks_for(torch.device(device))
    if not isinstance(handle, bytes) or not isinstance(size_bytes, int) \
            or not isinstance(offset_bytes, int) or size_bytes < 0 or offset_bytes < 0:
        raise InvalidHandleError(f"malformed shared storage: handle {type(handle).__name__}, "
                                 f"size {size_bytes!r}, offset {offset_bytes!r}")
    index = check_index(ref_counter_offset)
    _counters.hold(ref_counter_handle)
    try:
        memory = _opened.acquire(hooks, handle)
        try:
            if offset_bytes + size_bytes > memory.size:
                raise InvalidHandleError(f"shared storage of {size_bytes} bytes at offset "
                                         f"{offset_bytes} exceeds its allocation of {memory.size}")
            if event_sync_required:
                wait_for_producer(memory.device, event_handle)

            def on_free():
                _counters.release(ref_counter_handle, index)
                _opened.release(handle)

            return storage_from_memory(memory.ptr + offset_bytes, size_bytes, memory.device,
                                       on_free)
        except BaseException:
            _opened.release(handle)
            raise
    except BaseException:
        _counters.release(ref_counter_handle, index)  # the producer must not wait for us forever
        raise


def wait_for_producer(device: torch.device, event_handle: bytes) -> None:
    """Make the current stream of (local) `device` wait for the producer's event."""
    stream = torch.get_device_module(device).current_stream(device)
    hooks_for(device).wait_ipc_event(event_handle, stream)


def release_ipc_counter_device(ref_counter_handle: bytes, ref_counter_offset: int,
                               device=None) -> None:
    """Consumer: release a slot without opening the memory (the shared-cache hit path)."""
    index = check_index(ref_counter_offset)
    _counters.hold(ref_counter_handle)
    _counters.release(ref_counter_handle, index)


def ipc_collect() -> int:
    """Producer: free sent storages whose consumers have released them; returns how many."""
    return _sent.collect()


def stats() -> dict:
    """Counts for tests and diagnostics: what this process holds for IPC right now."""
    return {"sent": len(_sent), "mapped": len(_opened),
            "counter_files": _pool.open_files(), "mapped_counter_files": _counters.mapped_files()}
