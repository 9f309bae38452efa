"""openreg's implementation of the six IPC hooks: the reference for a vendor's own.

Memory handles name a runtime segment (a memfd); opening maps the very same pages, so writes cross
both ways. By default the producer synchronizes (event size 0); OPENREG_IPC_EVENTS=1 switches to
real interprocess events, read at each share so a process can change modes.
"""

import os

import torch

# devipc binds these names before it imports torch, so this works also when torch's autoload runs
# it while `devipc` itself is still importing.
from devipc import InvalidHandleError
from devipc.hooks import IpcHooks, OpenedMemory, register_ipc_hooks

from . import _runtime


def _events_enabled() -> bool:
    """OPENREG_IPC_EVENTS: "1" interprocess events, "0" or unset a synchronization per send."""
    value = os.environ.get("OPENREG_IPC_EVENTS", "0")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"OPENREG_IPC_EVENTS={value!r} is not understood: set it to 1 "
            f"(interprocess events) or 0 (the producer synchronizes), or unset it"
        )
    return value == "1"


def _runtime_stream(stream: torch.Stream) -> int:
    return _runtime.stream_from_id(stream.device_index, stream.stream_id)


class OpenRegIpcHooks(IpcHooks):
    def supports_ipc(self) -> bool:
        return True

    def get_ipc_mem_handle(self, ptr: int) -> tuple[bytes, int]:
        return _runtime.ipc_get_mem_handle(ptr)

    def get_ipc_event_handle(self, device: torch.device) -> bytes:
        if not _events_enabled():
            return b""
        event = _runtime.event_create(interprocess=True, timing=False)
        try:
            _runtime.event_record(event, _runtime_stream(torch.openreg.current_stream(device)))  # type: ignore[attr-defined]
            return _runtime.ipc_get_event_handle(event)
        finally:
            # The handle names the event; destroyed, it keeps its slot until this record has run,
            # so a consumer that opens the handle later finds nothing left to wait for.
            _runtime.event_destroy(event)

    def open_ipc_mem_handle(self, handle: bytes) -> OpenedMemory:
        try:
            base, size, device = _runtime.ipc_open_mem_handle(handle)
        except _runtime.OpenRegError as error:
            if error.code != _runtime.INVALID_DEVICE:
                raise
            # a device hidden here (or a forged one): a handle this process cannot open
            raise InvalidHandleError(str(error)) from None
        return OpenedMemory(
            base, size, torch.device("openreg", device), lambda: _runtime.ipc_close_mem_handle(base)
        )

    def wait_ipc_event(self, event_handle: bytes, stream: torch.Stream) -> None:
        if not event_handle:
            return
        event = _runtime.ipc_open_event_handle(event_handle)
        try:
            _runtime.stream_wait_event(_runtime_stream(stream), event)
        finally:
            _runtime.event_destroy(event)

    def ipc_event_handle_size(self) -> int:
        return _runtime.IPC_HANDLE_SIZE if _events_enabled() else 0

    def can_map_on(self, memory: OpenedMemory, device: torch.device) -> bool:
        # Every openreg device's memory is host memory: any visible openreg device can use it.
        if device.type != "openreg" or device.index is None:
            return False
        return 0 <= device.index < torch.openreg.device_count()  # type: ignore[attr-defined]

    def reusable_mappings(self) -> bool:
        # a handle names its memfd by a random token; a mapping keeps the pages, freed or not
        return True

    def device_identity(self, device: torch.device) -> bytes:
        return _runtime.device_uuid(device.index).encode()

    def copy_batch(self, device_index: int, table: torch.Tensor) -> None:
        stream = _runtime.stream_from_id(device_index, _runtime.current_stream_id(device_index))
        _runtime.memcpy_batch_async(table, stream)

    def make_resizable(self, storage: torch.UntypedStorage) -> None:
        _runtime.make_resizable(storage)

    def memory_kind(self, device_index: int) -> str:
        return "DRAM"  # runtime segments are host shared memory: any engine can address them


def register() -> None:
    register_ipc_hooks("openreg", OpenRegIpcHooks())
