"""Owner side: what a registration exports so that same-host peers can map it, made once, at
its first advertisement, and undone when the registration ends.

A device storage is exported as one devipc send, the anchor (`devipc._sharing.share_device`): its
memory is then held by devipc until the storage dies *and* every slot taken for it ended. A peer
takes a slot of its own in the anchor's ref-counter file (the forwarding path of the core), so
the owner's code never runs for it, and the memory can never be reused while a peer maps it. A
CPU storage lives in fd-backed shared memory: a peer maps the file itself, whose pages live while
anyone maps them.
"""
import os
import threading

import torch

from .. import _sharing
from .._hooks import hooks_for

__all__ = ["CpuExport", "DeviceExport", "export_of", "order_for_peers"]

_lock = threading.Lock()


class DeviceExport:
    __slots__ = ("mem", "mem_offset", "counter", "anchor")

    def __init__(self, storage: torch.UntypedStorage):
        _, self.mem, _, self.mem_offset, self.counter, self.anchor, _, _ = \
            _sharing.share_device(storage)

    def close(self) -> None:
        """The anchor is taken back; slots peers hold keep the memory until they let go."""
        _sharing.revoke_send(self.counter, self.anchor)


class CpuExport:
    __slots__ = ("fd", "inode")

    def __init__(self, storage: torch.UntypedStorage):
        self.fd = storage._get_shared_fd()
        self.inode = os.fstat(self.fd).st_ino

    def close(self) -> None:
        pass  # the fd belongs to the storage; peers' mappings keep their pages


def export_of(reg):
    """The registration's export, made on first use; None once the storage died."""
    with _lock:
        if reg.export is None:
            storage = reg.storage()
            if storage is None:
                return None
            reg.export = (CpuExport if storage.device.type == "cpu" else DeviceExport)(storage)
        return reg.export


def order_for_peers(device: torch.device) -> bytes:
    """Make the work queued so far on `device` visible to peers' transfers: an interprocess event
    on the current stream, when the device has them, that peers wait for; otherwise the device is
    synchronized now (b"")."""
    if device.type == "cpu":
        return b""
    hooks = hooks_for(device)
    if hooks.requires_event_sync():
        return hooks.get_ipc_event_handle(device)
    torch.get_device_module(device).synchronize(device)
    return b""
