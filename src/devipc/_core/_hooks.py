"""The IPC hook contract a device implements, and the registry from device type to hooks.

Mirrors the six methods of the RFC "Adding IPC Support for Third-Party Devices". The core calls
only these; it never imports a device. A device registers itself with `register_ipc_hooks`.

The bottom layer of the core: it imports no other layer (the reductions subscribe to registrations
with `on_register`), and not even torch, so that a device that torch autoloads while `devipc` is
still importing can already register through `devipc`'s public names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ._devices import type_of
from ._errors import UnsupportedDeviceError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OpenedMemory:
    """A consumer's mapping of a producer's base allocation. `close` unmaps it; call it once."""

    ptr: int
    size: int
    device: torch.device  # local device: its index may differ from the producer's numbering
    close: Callable[[], None]


class IpcMemHandle(NamedTuple):
    """What `get_ipc_mem_handle` returns: the handle naming a base allocation, and the pointer's
    byte offset inside it. A plain `(handle, offset)` tuple is the same thing."""

    handle: bytes
    offset: int

    @classmethod
    def of(cls, result: Any) -> IpcMemHandle:
        """A hook's answer as an IpcMemHandle: a `(handle, offset)` pair, or any record with
        `handle` and `offset` fields (the spelling of the RFC's pull requests, whose C++ struct
        is IpcMemHandle{offset, handle})."""
        if hasattr(result, "handle") and hasattr(result, "offset"):
            return cls(result.handle, result.offset)
        try:
            handle, offset = result
        except (TypeError, ValueError):
            raise TypeError(
                f"get_ipc_mem_handle must return (handle, offset) or a record with "
                f"handle and offset, got {type(result).__name__}"
            ) from None
        return cls(handle, offset)


class IpcHooks:
    """Base class of a device's IPC hooks. Every default says "no IPC": override all six.

    Producer side: `get_ipc_mem_handle`, `get_ipc_event_handle`.
    Consumer side: `open_ipc_mem_handle`, `wait_ipc_event`.
    """

    def supports_ipc(self) -> bool:
        """Whether this device can share memory between processes. Never raises."""
        return False

    def get_ipc_mem_handle(self, ptr: int) -> IpcMemHandle | tuple[bytes, int]:
        """(handle, offset): plain bytes naming the base allocation holding `ptr`, and `ptr`'s
        byte offset inside it; an IpcMemHandle or a plain pair."""
        raise NotImplementedError(f"{type(self).__name__} needs get_ipc_mem_handle")

    def get_ipc_event_handle(self, device: torch.device) -> bytes:
        """Bytes of an interprocess event recorded on `device`'s current stream; b"" when
        `ipc_event_handle_size()` is 0."""
        return b""

    def open_ipc_mem_handle(self, handle: bytes) -> OpenedMemory:
        """Map the base allocation a producer's handle names into this process."""
        raise NotImplementedError(f"{type(self).__name__} needs open_ipc_mem_handle")

    def wait_ipc_event(self, event_handle: bytes, stream: torch.Stream) -> None:
        """Make `stream` wait for the producer's event. No-op on empty bytes."""

    def ipc_event_handle_size(self) -> int:
        """0: no events, the producer synchronizes the device before handing out a handle. The
        RFC's first spelling; `requires_event_sync` is the later one: override either."""
        return 0

    def requires_event_sync(self) -> bool:
        """Whether consumers wait on the producer's interprocess event (`get_ipc_event_handle`)
        rather than the producer synchronizing before each send. The core asks only this;
        default: `ipc_event_handle_size() > 0`."""
        return self.ipc_event_handle_size() > 0

    # Optional, beyond the RFC's six: the defaults are safe for any device.

    def can_map_on(self, memory: OpenedMemory, device: torch.device) -> bool:
        """Whether a consumer may use opened `memory` as memory of local `device`, when a caller
        asks for a device (devipc.open(..., device=), or args[6] of reduce_tensor overwritten).
        Default: only the device that owns it."""
        return device == memory.device

    def device_identity(self, device: torch.device) -> bytes:
        """Stable identity of `device` (a UUID), the same in every process; b"": none."""
        return b""

    def reusable_mappings(self) -> bool:
        """Whether a consumer may keep a mapping open a short while after its last storage died,
        and use it again when the same handle comes back (a caching allocator's block reused for
        a new tensor, the traffic of a DataLoader): true when a handle names one allocation for
        good and a mapping keeps its memory valid after the producer freed it (openreg: a memfd
        named by a random token). Default False: a mapping closes with its last storage."""
        return False

    def memory_kind(self, device_index: int) -> str | None:
        """What this device's memory is to a network engine (NIXL): "DRAM" (host-addressable),
        "VRAM" (device memory the engine reaches itself), or None: not registrable, so the NIXL
        path refuses it with a clear error. Default None: a device must say so to be sent."""
        return None

    def make_resizable(self, storage: torch.UntypedStorage) -> None:
        """Give `storage` the device's allocator back and make it resizable. devipc calls it once
        it took over a sent (or registered) allocation: the producer's storage then reaches that
        memory through a DataPtr that keeps it alive for consumers, and with the allocator back,
        resize_ (FSDP's resize_(0) and regrowth included) gives the storage new memory while the
        old block stays for those who may still reach it, as CUDA's sender does. Default:
        nothing, so a sent or registered storage cannot be resized (resize_ raises)."""

    # copy_batch(device_index, table) -> None, a method of a device that has it. Default None:
    # none, and devipc copies pair by pair with `Tensor.copy_` (`_copies.batch_copier`).
    #     Queue the byte copies of `table`, an int64 CPU tensor of shape (N, 3) whose rows are
    #     (destination address, source address, bytes), on the device's current stream of the
    #     calling thread as ONE stream operation, ordered with the caller's other work there (as
    #     CUDA's cudaMemcpyBatchAsync). Every copy has at least one side in this device's memory;
    #     the other may be host memory. Raises for an address outside the device's memory.
    copy_batch: Callable[[int, torch.Tensor], None] | None = None


_lock = threading.Lock()
_registry: dict[str, IpcHooks] = {}
_listeners: list[Callable[[], None]] = []

# Devices whose sharing torch already does itself: their path is never touched.
_TORCH_OWNED = frozenset({"cpu", "cuda", "meta"})


def register_ipc_hooks(device_type: str, hooks: IpcHooks, *, replace: bool = False) -> None:
    """Make `device_type` tensors share through `hooks`; installs the reductions (idempotent).
    Other hooks registered for the type already are replaced only with `replace=True`
    (ValueError otherwise): two packages registering one device would silently decide which
    hooks every send takes."""
    if not isinstance(hooks, IpcHooks):
        raise TypeError(f"hooks must be an IpcHooks instance, got {type(hooks).__name__}")
    if torch_shares(device_type):
        raise ValueError(
            f"torch shares {device_type!r} tensors itself; devipc does not take them over"
        )
    with _lock:
        previous = _registry.get(device_type)
        if previous is not None and previous is not hooks and not replace:
            raise ValueError(
                f"{device_type!r} has IPC hooks registered already "
                f"({type(previous).__module__}.{type(previous).__qualname__}): pass "
                f"replace=True to replace them, or unregister_ipc_hooks({device_type!r}) first"
            )
        _registry[device_type] = hooks
        listeners = list(_listeners)
    try:
        for listener in listeners:
            listener()
    except BaseException:  # e.g. the reductions refused this torch: the registration is undone
        with _lock:
            if previous is None:
                _registry.pop(device_type, None)
            else:
                _registry[device_type] = previous
        raise


def on_register(listener: Callable[[], None]) -> None:
    """Call `listener` after every registration, and now if hooks are registered already."""
    with _lock:
        _listeners.append(listener)
        registered = bool(_registry)
    if registered:
        listener()


def unregister_ipc_hooks(device_type: str) -> None:
    with _lock:
        _registry.pop(device_type, None)


def get_ipc_hooks(device_type: str) -> IpcHooks | None:
    return _registry.get(device_type)


def device_supports_ipc(device_type: str) -> bool:
    """True when `device_type` has hooks that say they can share. Never raises."""
    return sharing_hooks(device_type) is not None


def sharing_device_types() -> list[str]:
    """The device types whose registered hooks say they can share, sorted."""
    with _lock:
        types = list(_registry)
    return sorted(t for t in types if sharing_hooks(t) is not None)


def sharing_hooks(device_type: str) -> IpcHooks | None:
    """The hooks of `device_type` when they say they can share, else None. Never raises."""
    hooks = _registry.get(device_type)
    if hooks is None:
        return None
    try:
        return hooks if hooks.supports_ipc() else None
    except Exception:  # noqa: BLE001 - hooks whose supports_ipc() raises share nothing
        return None


def hooks_for(device: torch.device) -> IpcHooks:
    """The hooks of a device that can share, or an error that says what to do."""
    hooks = sharing_hooks(type_of(device))
    if hooks is None:
        raise unsupported_device(device)
    return hooks


def unsupported_device(device: torch.device) -> UnsupportedDeviceError:
    if device.type == "cpu":
        return UnsupportedDeviceError(
            "devipc does not send CPU tensors itself: torch shares them (put them on a "
            "torch.multiprocessing queue, or call share_memory_() before a fork). A "
            "devipc.WeightPublisher publishes CPU weights, and devipc sends device tensors"
        )
    known = ", ".join(sorted(_registry)) or "none"
    return UnsupportedDeviceError(
        f"cannot share a tensor on {device} between processes: no IPC hooks able to share are "
        f"registered for device type {device.type!r} (registered: {known}). Implement "
        f"devipc.hooks.IpcHooks for the device and call "
        f"devipc.hooks.register_ipc_hooks({device.type!r}, hooks), or move the tensor to the "
        f"CPU explicitly. devipc never copies silently."
    )


def torch_shares(device_type: str) -> bool:
    """Whether torch itself shares this device's tensors (devipc leaves those alone)."""
    return device_type in _TORCH_OWNED
