"""Owner side: what a registration exports so that same-host peers can map it, made once, at
its first advertisement, and undone when the registration ends.

A device storage is exported through one devipc send, the anchor
(`devipc._core._sharing.share_device`): from then on devipc holds its memory until the storage
dies *and* every slot taken for it ended.
The anchor itself is taken back at once (the storage keeps the export alive while it lives); what
stays is its ref-counter file and the export's number in it. A peer takes a slot of its own in
that file for that export (the core's forwarding path), so the owner's code never runs for it,
and the memory can never be reused while a peer maps it. A CPU storage lives in fd-backed shared
memory: a peer maps the file itself, whose pages live while anyone maps them.
"""

import os
import threading
import weakref

import torch

from .._core import _sharing
from .._core._devices import synchronize
from .._core._errors import ReshareError
from .._core._hooks import hooks_for
from ._registry import Registration

__all__ = ["CpuExport", "DeviceExport", "export_of", "order_for_peers"]

_lock = threading.Lock()
_exports: "weakref.WeakKeyDictionary[Registration, CpuExport | DeviceExport]" = (
    weakref.WeakKeyDictionary()
)
PEER_ROOM = 64  # slots an advertisement leaves in its counter file for peers' first opens


class DeviceExport:
    __slots__ = ("mem", "mem_offset", "counter", "anchor")

    def __init__(self, storage: torch.UntypedStorage):
        if _sharing.received_via_ipc(storage):
            raise ReshareError(
                "this storage was received from another process through devipc: "
                "advertise a clone() of it, or have its owner advertise it"
            )
        while True:  # near the end of a counter file: use it up, so that a new one starts
            shared = _sharing.share_device(storage)
            self.mem, self.mem_offset = shared.handle, shared.offset_bytes
            assert shared.ref_counter_handle is not None  # registered storages are never empty
            self.counter, self.anchor = shared.ref_counter_handle, shared.ref_counter_offset
            _sharing.revoke_send(self.counter, self.anchor)
            if self.usable():
                return

    def usable(self) -> bool:
        """Whether peers can still take slots in the anchor's file: open, and PEER_ROOM left
        (a peer opening an advertisement takes one there)."""
        return _sharing.takes_slots(self.counter, PEER_ROOM)


class CpuExport:
    __slots__ = ("fd", "inode")

    def __init__(self, storage: torch.UntypedStorage):
        self.fd = storage._get_shared_fd()  # type: ignore[attr-defined]
        self.inode = os.fstat(self.fd).st_ino

    def usable(self) -> bool:
        return True


def export_of(reg: Registration) -> CpuExport | DeviceExport | None:
    """The registration's export, made on first use (again when the anchor's counter file
    filled up); None once the storage died. Kept as long as the registration object is."""
    with _lock:
        export = _exports.get(reg)
        if export is None or not export.usable():
            storage = reg.storage()
            if storage is None:
                return None
            export = _exports[reg] = (CpuExport if storage.device.type == "cpu" else DeviceExport)(
                storage
            )
        return export


def order_for_peers(device: torch.device) -> bytes:
    """Make the work queued so far on `device` visible to peers' transfers: an interprocess event
    on the current stream, when the device has them, that peers wait for; otherwise the device is
    synchronized now (b"")."""
    if device.type == "cpu":
        return b""
    hooks = hooks_for(device)
    if hooks.requires_event_sync():
        return hooks.get_ipc_event_handle(device)
    synchronize(device)
    return b""
