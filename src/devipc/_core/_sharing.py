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

import collections
import contextlib
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import _memory, _statspage, _wire
from ._background import Background
from ._devices import count_of, current_stream, name_of, present, synchronize
from ._errors import (
    DevIpcError,
    InvalidHandleError,
    ReshareError,
    UnsupportedDeviceError,
    UnsupportedTensorError,
)
from ._exports import LIMBO_WARN_BLOCKS, Exports, Hold
from ._hooks import IpcHooks, IpcMemHandle, OpenedMemory, hooks_for
from ._memory import TensorOrStorage, reap_freed, tensor_from_memory, untyped, watched
from ._received import IDLE_SECONDS, DeferredReleases, OpenedAllocations, Receipt, ReceivedStorages
from ._refcount import ConsumerCounters, check_slot

__all__ = [
    "Hold",
    "LIMBO_WARN_BLOCKS",
    "SharedStorage",
    "check_grad",
    "empty_storage",
    "hold",
    "ipc_collect",
    "keep_until_done",
    "local_device",
    "new_shared_device",
    "open_shared",
    "received_via_ipc",
    "release_hold",
    "release_ipc_counter_device",
    "requested_device",
    "revoke",
    "revoke_send",
    "send_unopened",
    "set_unopened_deadline",
    "share_device",
    "share_storage",
    "stats",
    "takes_slots",
    "unsendable",
]


def _wake_collector() -> None:
    _background.wake()


_NEWEST = 16  # storages made last that a send or an open looks at for deaths (`reap_freed`)
_exports = Exports(wake=_wake_collector)
_counters = ConsumerCounters()
_opened = OpenedAllocations()
_received = ReceivedStorages()
_deferred = DeferredReleases()
counts: collections.Counter = collections.Counter()  # what other layers shared, for stats()


def _background_round() -> bool:
    more = _deferred.poll()
    more = _opened.close_idle(IDLE_SECONDS) or more
    _exports.collect()
    # storages devipc made that still live: their deaths are seen by these rounds
    more = more or _exports.pending() or watched() > 0
    _statspage.publish(settled=not more)  # what `devipc info --pid` reads
    return more


_background = Background("devipc-collector", _background_round)


def _forget_after_fork() -> None:
    """A forked child holds none of its parent's slots or mappings (see `_refcount`)."""
    _memory.forget_after_fork()
    _counters.forget_after_fork()
    _deferred.forget_after_fork()


os.register_at_fork(after_in_child=_forget_after_fork)


def received_via_ipc(storage: TensorOrStorage) -> bool:
    """Whether `storage` (or a tensor's storage) lives in memory this process received by IPC."""
    storage = untyped(storage)
    return storage.nbytes() > 0 and _opened.contains(storage.device, storage.data_ptr())


class SharedStorage(NamedTuple):
    """What `share_device` returns: the RFC's 8-tuple, by name (torch sees a plain tuple)."""

    device: torch.device
    handle: bytes | None  # the hooks' memory handle; None for an empty storage
    size_bytes: int
    offset_bytes: int  # of the storage in its allocation
    ref_counter_handle: bytes | None
    ref_counter_offset: int  # the send's slot
    event_handle: bytes
    event_sync_required: bool


def share_device(storage: torch.UntypedStorage) -> SharedStorage:
    """Producer: the RFC's 8-tuple (device, handle, size_bytes, offset_bytes, ref_counter_handle,
    ref_counter_offset, event_handle, event_sync_required).

    Without events the producer waits for all work queued on the device (every stream: the
    pickling thread of a Queue is not the thread that queued the work). With events it records
    one on the device's current stream of the calling thread. A received storage is forwarded.
    """
    storage = untyped(storage)
    return share_storage(storage, storage.device, hooks_for(storage.device))


def share_storage(
    storage: torch.UntypedStorage, device: torch.device, hooks: IpcHooks
) -> SharedStorage:
    """`share_device`, for a caller that knows the storage's device and its hooks
    (`reduce_tensor`, at every send)."""
    nbytes = storage.nbytes()
    if nbytes == 0:
        return SharedStorage(device, None, 0, 0, None, 0, b"", False)
    sent = _exports.send_again(storage)
    if sent is None:
        _deferred.poll(_NEWEST)  # releases that are due, as an open runs them
        receipt = _received.get(storage)
        if receipt is not None:
            return _forward(storage, receipt)
        if _opened.contains(device, storage.data_ptr()):
            raise ReshareError(
                f"this {device} storage lies inside memory received from another "
                f"process without being a received storage itself; send a "
                f"clone()"
            )
        wire = IpcMemHandle.of(hooks.get_ipc_mem_handle(storage.data_ptr()))
        sent = (*_exports.send(storage, wire), wire)
    file, index, (handle, offset) = sent
    try:
        event_sync_required = bool(hooks.requires_event_sync())
        if event_sync_required:
            event_handle = hooks.get_ipc_event_handle(device)
        else:
            event_handle = b""
            synchronize(device)
    except BaseException:
        _exports.revoke_slot(file.handle, index)  # never sent: nobody will open it
        raise
    _background.wake()
    return SharedStorage(
        device, handle, nbytes, offset, file.handle, index, event_handle, event_sync_required
    )


def _forward(storage: torch.UntypedStorage, receipt: Receipt) -> SharedStorage:
    """Send on a received storage: the next consumer maps the original producer's memory under a
    slot of its own in the producer's file, so the memory outlives this process."""
    synchronize(storage.device)  # our writes first
    index = _counters.forward(receipt.counter_handle, receipt.slot)
    return SharedStorage(
        storage.device,
        receipt.mem_handle,
        storage.nbytes(),
        receipt.offset,
        receipt.counter_handle,
        index,
        b"",
        False,
    )


def new_shared_device(
    device: torch.device | str | int,
    handle: bytes | None,
    size_bytes: int,
    offset_bytes: int,
    ref_counter_handle: bytes | None,
    ref_counter_offset: int,
    event_handle: bytes,
    event_sync_required: bool,
    *,
    target: torch.device | str | int | None = None,
) -> torch.UntypedStorage:
    """Consumer: a storage over the producer's memory, zero-copy. Its device is the local device
    that owns the memory, whatever index the producer used for it; or `target` (or the device a
    caller wrote over a wrapped handle's, see `requested_device`) when the hooks can map it there.
    """
    handle, origin, requested = requested_device(device, handle)
    target = local_device(target, origin.type) if target is not None else requested
    return open_shared(
        origin,
        handle,
        size_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
        target,
    ).untyped_storage()


def open_shared(
    origin: torch.device,
    handle: bytes | None,
    size_bytes: int,
    offset_bytes: int,
    ref_counter_handle: bytes | None,
    ref_counter_offset: int,
    event_handle: bytes,
    event_sync_required: bool,
    target: torch.device | None,
    view: tuple[torch.dtype, tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """new_shared_device once the devices are known: `origin` the sender's, `target` a local
    device asked for, or None for the one that owns the memory. Returns a tensor over the whole
    storage: of `view`'s (dtype, contiguous shape), made in the same call, else its bytes."""
    hooks = hooks_for(origin)
    if (
        not isinstance(handle, bytes)
        or type(size_bytes) is not int
        or type(offset_bytes) is not int
        or size_bytes < 0
        or offset_bytes < 0
    ):
        raise InvalidHandleError(
            f"malformed shared storage: handle {type(handle).__name__}, "
            f"size {size_bytes!r}, offset {offset_bytes!r}"
        )
    counter_handle, index = check_slot(ref_counter_handle, ref_counter_offset)

    def open_memory() -> tuple[OpenedMemory, torch.device, torch.Stream]:
        """Runs under the slot's lock, before the slot is taken."""
        memory = _opened.acquire(hooks, handle)
        try:
            if offset_bytes + size_bytes > memory.size:
                raise InvalidHandleError(
                    f"shared storage of {size_bytes} bytes at offset "
                    f"{offset_bytes} exceeds its allocation of {memory.size}"
                )
            placed = memory.device if target is None else _placement(hooks, memory, target)
            stream = current_stream(placed)  # the stream its users will queue on
            if event_sync_required:
                _wait_for_producer(hooks, stream, event_handle)
        except BaseException:
            _opened.release(handle)
            raise
        return memory, placed, stream

    try:
        memory, placed, stream = _counters.hold(counter_handle, index, open_memory)
    except InvalidHandleError:
        raise  # bytes refused: the send is left to the genuine ones
    except BaseException:
        # genuine bytes this process cannot open (the device, the target, the producer): the
        # send ends, or its producer would keep the memory for nobody
        with contextlib.suppress(Exception):
            _counters.release_unopened(counter_handle, index)
        raise
    try:
        receipt = Receipt(handle, offset_bytes, counter_handle, index)
        key = (name_of(placed), memory.ptr + offset_bytes, size_bytes)

        def release() -> None:
            _received.forget(key, receipt)
            _counters.release(counter_handle, index)
            _opened.release(handle)

        def on_free() -> None:  # from reap_freed: no lock here (see DeferredReleases)
            _deferred.add(stream, release)
            _background.wake()

        tensor = tensor_from_memory(
            memory.ptr + offset_bytes, size_bytes, placed, on_free, *(view or ())
        )
    except BaseException:
        _opened.release(handle)
        _counters.release(counter_handle, index)  # the producer must not wait for us forever
        raise
    # From here on the tensor's death releases its slot and mapping (`on_free`), nothing else.
    _received.add(key, receipt)
    _background.wake()  # its rounds see the storage die
    # Pending releases run after the acquire: an allocation sent again (weights synced every
    # step) stays mapped, rather than unmapped and mapped again, pages re-faulted. Here rather
    # than in the collector: every slot a process holds makes the kernel's next lock of the
    # counter file slower. Only the newest storages are looked at: what a loop received and
    # dropped; the collector sees the others.
    _deferred.poll(_NEWEST)
    return tensor


def _placement(hooks: IpcHooks, memory: OpenedMemory, target: torch.device) -> torch.device:
    if target == memory.device or hooks.can_map_on(memory, target):
        return target
    raise UnsupportedDeviceError(
        f"memory of {memory.device} cannot be mapped on {target}: "
        f"the {target.type} hooks do not support it (can_map_on); open "
        f"it on its own device and copy"
    )


def requested_device(
    device: torch.device | str | int,
    handle: bytes | None,
) -> tuple[bytes | None, torch.device, torch.device | None]:
    """(the hooks' handle, the sender's device, the device the caller asked for or None) from
    args[6] and args[7] of reduce_tensor. The sender wraps args[7] with the device it wrote into
    args[6] (`_wire.wrap_storage_handle`): args[6] still equal to it means "the local device that
    owns the memory" (found by identity); anything else (an int index, as in CUDA's args, or
    another device) means that local device, as rebuild_cuda_tensor does. An unwrapped handle
    (share_device's 8-tuple) is taken as is: device is the sender's."""
    try:
        if not _wire.is_wrapped(handle):
            return handle, torch.device(device), None
        sender, raw = _wire.unwrap_storage_handle(handle)
        if isinstance(device, torch.device) and device == sender:
            return raw, sender, None
        return raw, sender, local_device(device, sender.type)
    except (RuntimeError, TypeError, ValueError) as error:
        if isinstance(error, DevIpcError):
            raise
        raise InvalidHandleError(f"malformed shared storage: device {device!r} ({error})") from None


def local_device(device: torch.device | str | int, device_type: str) -> torch.device:
    """A local device of `device_type` from an index, a name or a torch.device; no index: the
    current one."""
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device(device_type, device)
    elif isinstance(device, (str, torch.device)):
        device = torch.device(device)
    else:
        raise TypeError(f"a device is an index, a name or a torch.device, not {device!r}")
    if device.type != device_type:
        raise UnsupportedDeviceError(
            f"memory of a {device_type} device cannot be mapped on {device}"
        )
    if device.index is None:
        device = torch.device(device_type, torch.get_device_module(device_type).current_device())
    return device


def empty_storage(device: torch.device) -> torch.UntypedStorage:
    """The storage of an empty tensor a handle names: it travels without memory, but its device
    must exist here."""
    if not present(device):
        raise InvalidHandleError(
            f"this empty tensor's handle names {device}, which this process "
            f"does not see ({count_of(device.type)} {device.type} devices "
            f"visible)"
        )
    try:
        return torch.UntypedStorage(0, device=device)
    except RuntimeError as error:
        raise InvalidHandleError(f"this empty tensor's handle names {device}: {error}") from None


def check_grad(dtype: object, requires_grad: object) -> None:
    """A handle's requires_grad flag: a bool, and True only for dtypes autograd supports."""
    if not isinstance(dtype, torch.dtype) or not isinstance(requires_grad, bool):
        raise InvalidHandleError(
            f"malformed tensor: dtype {dtype!r}, requires_grad {requires_grad!r}"
        )
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise InvalidHandleError(f"a {dtype} tensor cannot require grad: the handle is forged")


def wait_for_producer(device: torch.device, event_handle: bytes) -> None:
    """Make the current stream of (local) `device` wait for the producer's event."""
    _wait_for_producer(hooks_for(device), current_stream(device), event_handle)


def _wait_for_producer(hooks: IpcHooks, stream: torch.Stream, event_handle: bytes) -> None:
    if not isinstance(event_handle, bytes):
        raise InvalidHandleError(f"an event handle is bytes, got {type(event_handle).__name__}")
    hooks.wait_ipc_event(event_handle, stream)


def release_ipc_counter_device(
    ref_counter_handle: bytes | None,
    ref_counter_offset: int,
    device: torch.device | str | int | None = None,
) -> None:
    """Consumer: give a send back without opening its memory (the shared-cache hit path)."""
    _counters.release_unopened(ref_counter_handle, ref_counter_offset)


def ipc_collect() -> int:
    """Producer: free sent memory whose consumers released it or died; consumer: run the
    releases whose device work is done, and close what it kept of producers that died. Returns
    how many sends ended. Mappings kept open for reuse are closed too."""
    _deferred.poll()
    _opened.close_idle()
    _counters.prune()
    return _exports.collect()


def revoke(storage: TensorOrStorage) -> int:
    """Producer: take back every send of this storage's memory that no consumer opened yet
    (opening one later raises); returns how many. Sends already opened are not affected."""
    return _exports.revoke(untyped(storage))


def revoke_send(counter_handle: bytes, slot: int) -> bool:
    """Producer: take back the one send named by (counter handle, slot) if nobody opened it."""
    return _exports.revoke_slot(counter_handle, slot)


def keep_until_done(events: list[torch.Event], keep: object) -> None:
    """Keep `keep` until the device work before `events` ran (`ipc_collect` or the collector's
    rounds let go of it then); callable from a finalizer."""
    _deferred.keep_until(events, keep)
    _background.wake()


def hold(storage: TensorOrStorage, on_moved: Callable[[], object]) -> Hold:
    """Keep `storage`'s memory allocated until `release_hold`, whatever becomes of the storage
    (see `_exports`); `on_moved()` runs once if the storage stops pointing at that memory."""
    return _exports.hold(untyped(storage), on_moved)


def release_hold(held: Hold) -> None:
    _exports.release(held)


def takes_slots(counter_handle: bytes, room: int = 1) -> bool:
    """Producer: whether peers can still take `room` slots in this process's counter file."""
    return _exports.takes_slots(counter_handle, room)


def send_unopened(counter_handle: bytes, slot: int) -> bool:
    """Producer: whether the send named by (counter handle, slot) may still be opened."""
    return _exports.unopened(counter_handle, slot)


def set_unopened_deadline(seconds: float | None) -> None:
    """Producer: revoke sends that no consumer opened within `seconds` (None: keep them until
    revoked, as CUDA does). A message that sits in a queue nobody reads pins memory otherwise."""
    if seconds is not None and not seconds > 0:
        raise ValueError(f"the deadline is a positive number of seconds or None, got {seconds!r}")
    _exports.deadline = seconds
    _background.wake()


def unsendable(tensor: torch.Tensor, what: str) -> UnsupportedTensorError:
    """The one-line error for a tensor devipc cannot send as it is, saying what to send instead
    (torch's own attempt would end in a dispatcher error naming an internal backend)."""
    if tensor.is_nested:
        kind, instead = (
            f"a nested tensor of layout {tensor.layout}",
            "use the jagged layout (torch.nested.nested_tensor(..., "
            "layout=torch.jagged)), or send its components (tensor.unbind())",
        )
    elif tensor.is_sparse or tensor.layout in _SPARSE_COMPRESSED:
        kind, instead = (
            f"a sparse tensor ({tensor.layout})",
            "send its component tensors (indices() and values(), or the "
            "compressed indices and values()) and rebuild it on the other side",
        )
    else:
        kind, instead = f"a tensor of layout {tensor.layout}", "send tensor.to_dense()"
    return UnsupportedTensorError(
        f"{what}: devipc cannot share {kind} on {tensor.device}: {instead}"
    )


_SPARSE_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def stats() -> dict:
    """What this process holds for IPC right now."""
    reap_freed()  # storages that died count as released, pending their device work
    return {
        **_exports.stats(),
        "mapped": len(_opened),
        "mapped_idle": _opened.idle(),
        "mapped_counter_files": _counters.mapped_files(),
        "pending_releases": len(_deferred),
        "buckets_shared": counts["buckets_shared"],
        "bucket_tensors_shared": counts["bucket_tensors_shared"],
    }


def _page_numbers() -> dict:
    """The stats page's JSON: `stats()`, and this process's torch CPU threads (`devipc doctor`
    adds those of the processes it sees: several engines on one host must share the cores)."""
    return {**stats(), "torch_threads": torch.get_num_threads()}


_statspage.start(_page_numbers)
