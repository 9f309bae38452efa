"""Storage sharing with the RFC's semantics: share_device, new_shared_device,
release_ipc_counter_device, ipc_collect — and what CUDA lacks: forwarding, reclaiming the sends of
dead consumers, revoking unopened sends.

Producer: synchronize (or record an interprocess event), get (handle, offset) from the hooks, take a
ref-counter slot, and keep the sent memory allocated until its slots end (`_exports`).
Consumer: map each base allocation once per process, make a storage at base + offset whose death
releases the slot — after the device work queued on it — and, with the last storage of that
allocation, the mapping (`_received`). A received storage sent on takes a new slot in the
original producer's file, so the memory outlives the forwarder.
"""
import torch

from ._background import Background
from ._errors import InvalidHandleError, ReshareError
from ._exports import LIMBO_WARN_BLOCKS, Exports
from ._hooks import hooks_for
from ._memory import storage_from_memory
from ._received import DeferredReleases, OpenedAllocations, ReceivedStorages, Receipt
from ._refcount import ConsumerCounters, check_slot

__all__ = ["LIMBO_WARN_BLOCKS", "ipc_collect", "new_shared_device", "received_via_ipc",
           "release_ipc_counter_device", "revoke", "set_unopened_deadline", "share_device",
           "stats"]

_exports = Exports()
_counters = ConsumerCounters()
_opened = OpenedAllocations()
_received = ReceivedStorages()
_deferred = DeferredReleases()


def _background_round() -> bool:
    _exports.collect()
    more = _deferred.poll()
    return more or _exports.pending()


_background = Background("devipc-collector", _background_round)


def _untyped(storage) -> torch.UntypedStorage:
    if isinstance(storage, torch.Tensor):
        storage = storage.untyped_storage()
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    return storage


def received_via_ipc(storage) -> bool:
    """Whether `storage` (or a tensor's storage) lives in memory this process received by IPC."""
    storage = _untyped(storage)
    return storage.nbytes() > 0 and _opened.contains(storage.device, storage.data_ptr())


def share_device(storage: torch.UntypedStorage) -> tuple:
    """Producer: the RFC's 8-tuple (device, handle, size_bytes, offset_bytes, ref_counter_handle,
    ref_counter_offset, event_handle, event_sync_required).

    Without events the producer waits for all work queued on the device (every stream: the
    pickling thread of a Queue is not the thread that queued the work). With events it records
    one on the device's current stream of the calling thread. A received storage is forwarded.
    """
    storage = _untyped(storage)
    device = storage.device
    hooks = hooks_for(device)
    if storage.nbytes() == 0:
        return (device, None, 0, 0, None, 0, b"", False)
    receipt = _received.get(storage)
    if receipt is not None:
        return _forward(storage, receipt)
    if _opened.contains(device, storage.data_ptr()):
        raise ReshareError(f"this {device} storage lies inside memory received from another "
                           f"process without being a received storage itself; send a clone()")
    event_sync_required = bool(hooks.requires_event_sync())
    if event_sync_required:
        event_handle = hooks.get_ipc_event_handle(device)
    else:
        event_handle = b""
        torch.get_device_module(device).synchronize(device)
    handle, offset = hooks.get_ipc_mem_handle(storage.data_ptr())
    file, index = _exports.send(storage)
    _background.wake()
    return (device, handle, storage.nbytes(), offset, file.handle, index, event_handle,
            event_sync_required)


def _forward(storage: torch.UntypedStorage, receipt: Receipt) -> tuple:
    """Send on a received storage: the next consumer maps the original producer's memory under a
    slot of its own in the producer's file, so the memory outlives this process."""
    torch.get_device_module(storage.device).synchronize(storage.device)  # our writes first
    index = _counters.forward(receipt.counter_handle, receipt.slot)
    return (storage.device, receipt.mem_handle, storage.nbytes(), receipt.offset,
            receipt.counter_handle, index, b"", False)


def new_shared_device(device, handle: bytes, size_bytes: int, offset_bytes: int,
                      ref_counter_handle: bytes, ref_counter_offset: int, event_handle: bytes,
                      event_sync_required: bool) -> torch.UntypedStorage:
    """Consumer: a storage over the producer's memory, zero-copy. Its device is the local device
    that owns the memory, whatever index the producer used for it."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidHandleError(f"malformed shared storage: device {device!r}") from None
    hooks = hooks_for(device)
    if not isinstance(handle, bytes) or type(size_bytes) is not int \
            or type(offset_bytes) is not int or size_bytes < 0 or offset_bytes < 0:
        raise InvalidHandleError(f"malformed shared storage: handle {type(handle).__name__}, "
                                 f"size {size_bytes!r}, offset {offset_bytes!r}")
    counter_handle, index = check_slot(ref_counter_handle, ref_counter_offset)
    _counters.hold(counter_handle, index)
    try:
        memory = _opened.acquire(hooks, handle)
        try:
            if offset_bytes + size_bytes > memory.size:
                raise InvalidHandleError(f"shared storage of {size_bytes} bytes at offset "
                                         f"{offset_bytes} exceeds its allocation of {memory.size}")
            if event_sync_required:
                wait_for_producer(memory.device, event_handle)
            receipt = Receipt(handle, offset_bytes, counter_handle, index)
            key = (str(memory.device), memory.ptr + offset_bytes, size_bytes)

            def release():
                _counters.release(counter_handle, index)
                _opened.release(handle)

            def on_free():
                _received.forget(key, receipt)
                if _deferred.after_queued_work(memory.device, release):
                    _background.wake()

            storage = storage_from_memory(memory.ptr + offset_bytes, size_bytes, memory.device,
                                          on_free)
            _received.add(key, receipt)
            return storage
        except BaseException:
            _opened.release(handle)
            raise
    except BaseException:
        _counters.release(counter_handle, index)  # the producer must not wait for us forever
        raise


def wait_for_producer(device: torch.device, event_handle: bytes) -> None:
    """Make the current stream of (local) `device` wait for the producer's event."""
    if not isinstance(event_handle, bytes):
        raise InvalidHandleError(f"an event handle is bytes, got {type(event_handle).__name__}")
    stream = torch.get_device_module(device).current_stream(device)
    hooks_for(device).wait_ipc_event(event_handle, stream)


def release_ipc_counter_device(ref_counter_handle: bytes, ref_counter_offset: int,
                               device=None) -> None:
    """Consumer: give a send back without opening its memory (the shared-cache hit path)."""
    _counters.release_unopened(ref_counter_handle, ref_counter_offset)


def ipc_collect() -> int:
    """Producer: free sent memory whose consumers released it or died; consumer: run the
    releases whose device work is done, and close what it kept of producers that died. Returns
    how many sends ended."""
    _deferred.poll()
    _counters.prune()
    return _exports.collect()


def revoke(storage) -> int:
    """Producer: take back every send of this storage's memory that no consumer opened yet
    (opening one later raises); returns how many. Sends already opened are not affected."""
    return _exports.revoke(_untyped(storage))


def set_unopened_deadline(seconds: float | None) -> None:
    """Producer: revoke sends that no consumer opened within `seconds` (None: keep them until
    revoked, as CUDA does). A message that sits in a queue nobody reads pins memory otherwise."""
    if seconds is not None and not seconds > 0:
        raise ValueError(f"the deadline is a positive number of seconds or None, got {seconds!r}")
    _exports.deadline = seconds
    _background.wake()


def stats() -> dict:
    """What this process holds for IPC right now."""
    return {**_exports.stats(), "mapped": len(_opened),
            "mapped_counter_files": _counters.mapped_files(),
            "pending_releases": len(_deferred)}
