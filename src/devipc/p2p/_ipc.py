"""devipc.p2p's same-host path (`Endpoint(transport="ipc")`, the default): the device's IPC
hooks and devipc's core. The owner's side (`_export`) hands out the export of a registration's
storage; a peer (`_remote`) maps it once per registration and copies with the device's own copy
path (one `copy_batch` call where the hooks have it), host memory by memmove.
"""
import ctypes
from collections.abc import Iterable

import torch

from .._errors import NotRegisteredError, TransferSizeError, UnsupportedDeviceError
from .._hooks import hooks_for
from .._sharing import wait_for_producer
from ._descriptor import CPU, DEVICE, Descriptor, Metadata, host_identity
from ._export import CpuExport, DeviceExport, export_of, order_for_peers
from ._registry import Registration
from ._remote import Peer, RemoteEntry
from ._transfer import Transfer, record_events, run_on_host

__all__ = ["IpcLink", "IpcTransport"]

READ = "READ"
_BATCH_MIN = 2  # pairs from which a post hands the device one batch (hooks' copy_batch)


class IpcTransport:
    """The same-host transport: descriptors carry the memory's IPC handles."""

    name = "ipc"

    def metadata(self) -> bytes:
        return b""

    def describe(self, reg: Registration, offset: int, nbytes: int) -> dict:
        export = export_of(reg)
        if export is None or not reg.alive:
            raise NotRegisteredError(f"tensor id {reg.id} is not registered any more")
        if reg.device.type == "cpu":
            assert isinstance(export, CpuExport)  # export_of: a CPU storage's export
            where: dict = dict(kind=CPU, fd=export.fd, anchor=export.inode)
        else:
            assert isinstance(export, DeviceExport)
            where = dict(kind=DEVICE, mem=export.mem, mem_offset=export.mem_offset,
                         counter=export.counter, anchor=export.anchor)
        where["event"] = order_for_peers(reg.device)
        return where

    def connect(self, meta: Metadata) -> "IpcLink":
        if meta.host != host_identity() or not meta.host:
            raise UnsupportedDeviceError(
                f"peer process {meta.pid} runs on another host or PID namespace: the device's "
                f"IPC hooks cannot reach its memory. Use Endpoint(transport='nixl') on both sides")
        return IpcLink(Peer(meta))

    def close(self) -> None:
        pass


class IpcLink:
    """One peer's mapped registrations, and the copies into and out of them."""

    def __init__(self, peer: Peer):
        self._peer = peer

    def mapped(self) -> int:
        return self._peer.mapped()

    def close(self) -> None:
        self._peer.close()

    def post(self, op: str, locals_: list, descs: list, wait: bool) -> Transfer:
        peer = self._peer
        peer.check_alive()
        peer.sweep()
        entries = peer.open_all(descs)  # pinned: no other thread unmaps them under the copies
        try:
            distinct = list({id(entry): entry for entry in entries}.values())  # few, many ranges
            devices = {entry.device for entry in distinct if entry.device.type != "cpu"}
            devices.update(local.device for local in locals_ if not local.is_cpu)
            batch = _batch(op, locals_, entries, descs, devices)
            pairs: list | tuple = batch if batch is not None else [
                _pair(op, local, entry, desc) for local, entry, desc in
                zip(locals_, entries, descs)]
        except BaseException:
            peer.unpin(entries)
            raise
        if not devices and not wait:
            return self._on_host(pairs, entries, locals_)
        try:
            if devices:
                _wait_for_owner(entries, descs, devices)
            if batch is None:
                _copy(pairs)
            else:
                copy_batch, index, table = batch
                copy_batch(index, table)
            remote = [entry.data for entry in distinct]  # kept: their memory outlives the copies
            transfer = Transfer(record_events(devices), keep=(pairs, remote, locals_))
            if any(entry.device.type == "cpu" for entry in distinct):
                transfer.wait()  # a CPU mapping must outlive the device copy: finish it here
        finally:
            peer.unpin(entries)
        return transfer

    def _on_host(self, pairs: Iterable[tuple], entries: list[RemoteEntry],
                 locals_: list[torch.Tensor]) -> Transfer:
        """Host copies off the calling thread (the async calls). The job holds the local tensors:
        the pairs may be bare addresses."""
        peer = self._peer

        def copy() -> None:
            try:
                _copy(pairs)
            finally:
                peer.unpin(entries)
                locals_.clear()

        try:
            return Transfer(future=run_on_host(copy))
        except BaseException:
            peer.unpin(entries)
            raise


def _wait_for_owner(entries: list[RemoteEntry], descs: list[Descriptor],
                    devices: set[torch.device]) -> None:
    """Make the current streams wait for the events recorded when the ranges were advertised
    (once per entry and event)."""
    for entry, desc in zip(entries, descs):
        if desc.event and desc.event not in entry.waited:
            for device in devices:
                wait_for_producer(device, desc.event)
            entry.waited.add(desc.event)


def _batch(op: str, locals_: list, entries: list, descs: list, devices: set) -> tuple | None:
    """(copy_batch, device index, table) doing all the copies as one operation of the device's
    current stream, when its hooks have `copy_batch` and every pair is a contiguous range of one
    device's remote memory and a contiguous local tensor on that device or the CPU; else None
    (the per-pair path). Addresses come straight from the tensors: no views are made."""
    if len(descs) < _BATCH_MIN or len(devices) != 1:
        return None
    (device,) = devices
    copy_batch = getattr(hooks_for(device), "copy_batch", None)
    if copy_batch is None:
        return None
    bases: dict[int, int] = {}  # id(entry) -> its first byte's address
    rows: list[tuple[int, int, int]] = []
    add = rows.extend
    for local, entry, desc in zip(locals_, entries, descs):
        base = bases.get(id(entry))  # `entries` holds them: ids stay theirs
        if base is None:
            if entry.device != device:
                return None
            base = bases[id(entry)] = entry.data.data_ptr()
        if not local.is_contiguous() or not (local.is_cpu or local.device == device):
            return None
        if op == READ:
            add((local.data_ptr(), base + desc.offset, desc.nbytes))
        else:
            add((base + desc.offset, local.data_ptr(), desc.nbytes))
    return copy_batch, device.index, torch.tensor(rows, dtype=torch.int64).view(-1, 3)


def _copy(pairs: Iterable[tuple]) -> None:
    """Each (destination, source, bytes): host addresses by memmove (one thread, no dispatch),
    tensors by `copy_`, the device's own copy path on the current stream."""
    with torch.no_grad():
        for dst, src, nbytes in pairs:
            if nbytes is None:
                dst.copy_(src)
            else:
                ctypes.memmove(dst, src, nbytes)


def _pair(op: str, local: torch.Tensor, entry: RemoteEntry, desc: Descriptor) -> tuple:
    """(destination, source, bytes) of one copy: addresses when both sides are contiguous host
    memory; else tensors (bytes None): byte views when the local tensor is contiguous, else the
    remote range viewed with the local tensor's dtype and shape (copy_ handles strides)."""
    if entry.host is not None and local.is_cpu and local.is_contiguous():
        here, there = local.data_ptr(), entry.host + desc.offset
        return (here, there, desc.nbytes) if op == READ else (there, here, desc.nbytes)
    assert entry.data is not None  # pinned: not unmapped while this transfer uses it
    remote = entry.data[desc.offset:desc.offset + desc.nbytes]
    if local.dtype is torch.uint8 and local.dim() == 1 and local.is_contiguous():
        local_view = local
    elif local.is_contiguous():
        local_view = local.view(-1).view(torch.uint8)
    else:
        if desc.offset % local.element_size():
            raise TransferSizeError(f"a non-contiguous local tensor of {local.dtype} needs a "
                                    f"remote range aligned to {local.element_size()} bytes, "
                                    f"this one starts at byte {desc.offset}")
        remote = remote.view(local.dtype).view(local.shape)
        local_view = local
    return (local_view, remote, None) if op == READ else (remote, local_view, None)
