"""Endpoints and connections: one-sided reads and writes of registered tensors of other processes.

`Endpoint(transport)`: "auto" or "ipc" reaches peers on the same host through the device's IPC
hooks and devipc's core (`_export` on the owner's side, `_remote` on the peer's); "nixl" goes
through NIXL even on one host (`_nixl.NixlTransport`, imported only then); an object with the
same methods may be passed instead. The owner's Python code takes no part in a transfer: its
metadata and descriptors are all a peer needs.
"""
import ctypes
import os
import secrets
import threading
import weakref

import torch

from .. import _wire
from .._errors import (
    InvalidHandleError,
    NotRegisteredError,
    TransferSizeError,
    UnsupportedDeviceError,
)
from .._handles import identity_of
from .._hooks import hooks_for
from ._descriptor import CPU, DEVICE, NONE, Descriptor, Metadata, host_identity
from ._export import export_of, order_for_peers
from ._registry import Registration, registry
from ._remote import Peer, RemoteEntry
from ._transfer import Transfer, record_events, run_on_host

__all__ = ["Connection", "Endpoint"]

READ, WRITE = "READ", "WRITE"
_DECODED_KEPT = 4096  # decoded descriptors a connection remembers, by their bytes
_BATCH_MIN = 2  # pairs from which readv/writev hand the device one batch (hooks' copy_batch)


class Endpoint:
    """This process's side of point-to-point transfers; any number of peers `connect` to it."""

    def __init__(self, transport="auto"):
        self._token = secrets.token_hex(8)
        self.name = f"devipc-{os.getpid()}-{self._token}"
        if transport in ("auto", "ipc"):
            self.transport, self._transport = "ipc", None
        elif transport == "nixl":
            from ._nixl import NixlTransport  # the optional extra: only imported when asked

            self.transport, self._transport = "nixl", NixlTransport(self.name)
        elif all(hasattr(transport, m) for m in ("metadata", "connect", "disconnect", "post",
                                                 "descriptor_extra")):
            self.transport, self._transport = "nixl", transport
        else:
            raise ValueError(f"transport is 'auto', 'ipc', 'nixl' or a transport object, not "
                             f"{transport!r}")
        if self._transport is not None:
            registry.add_listener(self._transport)
        self._connections: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False

    def metadata(self) -> bytes:
        """What a peer passes to its `connect` (send it out of band: a socket, a store)."""
        self._check_open()
        extra = b"" if self._transport is None else bytes(self._transport.metadata())
        return Metadata(self.transport, host_identity(), os.getpid(), registry.page().handle,
                        extra).to_bytes()

    def connect(self, peer_metadata) -> "Connection":
        """A connection to the endpoint whose `metadata()` this is."""
        self._check_open()
        meta = Metadata.from_bytes(peer_metadata)
        if meta.transport != self.transport:
            raise ValueError(f"the peer's endpoint uses transport {meta.transport!r}, this one "
                             f"{self.transport!r}: make both with the same transport")
        connection = Connection(self, meta)
        with self._lock:
            self._connections.add(connection)
        return connection

    def advertise(self, tensor_or_id, offset: int = 0, nbytes: int | None = None) -> bytes:
        """A remote descriptor of a registered tensor's bytes [offset, offset + nbytes) (from the
        tensor's first byte; for an id, from its storage's). Work queued so far on the tensor's
        device is visible to the peers' transfers through it (an event, or a synchronization)."""
        self._check_open()
        reg, offset, nbytes = _resolve(tensor_or_id, offset, nbytes)
        where: dict = dict(kind=NONE, mem=b"", mem_offset=0, counter=b"", anchor=0, fd=0,
                           event=b"", extra=b"")
        if self._transport is not None:
            where["extra"] = bytes(self._transport.descriptor_extra(reg, offset, nbytes))
            if reg.device.type != "cpu":  # no events across hosts: the queued work ends now
                torch.get_device_module(reg.device).synchronize(reg.device)
        else:
            export = export_of(reg)
            if export is None or not reg.alive:
                raise _gone(reg)
            if reg.device.type == "cpu":
                where.update(kind=CPU, fd=export.fd, anchor=export.inode)
            else:
                where.update(kind=DEVICE, mem=export.mem, mem_offset=export.mem_offset,
                             counter=export.counter, anchor=export.anchor)
            where["event"] = order_for_peers(reg.device)
        identity = b"" if reg.device.type == "cpu" else identity_of(reg.device)
        return Descriptor(page=registry.page().handle, reg_id=reg.id, slot=reg.slot,
                          storage_bytes=reg.nbytes, offset=offset, nbytes=nbytes,
                          device=reg.device, identity=identity, **where).to_bytes()

    def close(self) -> None:
        """Close every connection and the transport. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections, self._connections = list(self._connections), weakref.WeakSet()
        for connection in connections:
            connection.close()
        if self._transport is not None:
            registry.remove_listener(self._transport)
            self._transport.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this endpoint is closed")

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<devipc.p2p.Endpoint {self.name} over {self.transport}>"


def _gone(reg: Registration) -> NotRegisteredError:
    return NotRegisteredError(f"tensor id {reg.id} is not registered any more")


def _int(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _resolve(tensor_or_id, offset, nbytes) -> tuple[Registration, int, int]:
    """(registration, byte offset in its storage, byte count) of what `advertise` was given."""
    offset = _int(offset, "offset")
    if isinstance(tensor_or_id, torch.Tensor):
        reg = registry.lookup(tensor_or_id)
        tensor = tensor_or_id
        if not tensor.is_contiguous():
            raise ValueError("advertise a contiguous tensor (or its registration id with a byte "
                             "range): a strided view is not one byte range")
        start = tensor.storage_offset() * tensor.element_size()
        size = tensor.numel() * tensor.element_size()
    else:
        reg = registry.get(tensor_or_id)
        start, size = 0, reg.nbytes
    if offset > size:
        raise ValueError(f"offset {offset} is past the end of {size} bytes")
    nbytes = size - offset if nbytes is None else _int(nbytes, "nbytes")
    if offset + nbytes > size:
        raise ValueError(f"bytes [{offset}, {offset + nbytes}) reach past the end of {size}")
    registry.check_current(reg)  # the descriptor matches the memory as it is now
    return reg, start + offset, nbytes


class Connection:
    """A connection to one peer endpoint: reads and writes of the tensors it advertised.
    read/write/readv/writev return when the data arrived; the `_async` variants return a
    Transfer. Device copies are queued on the current stream of the calling thread, so they are
    ordered with its other work on that stream."""

    def __init__(self, endpoint: Endpoint, meta: Metadata):
        self._endpoint, self.peer_pid = endpoint, meta.pid
        self._page_handle = meta.page
        self._decoded = _wire.Decoded(Descriptor.from_bytes, _DECODED_KEPT)
        self._peer: Peer | None = None
        self._agent = None
        self._release: weakref.finalize
        transport = endpoint._transport
        if transport is not None:
            self._agent = transport.connect(meta.extra)
            # a dropped connection unloads the peer's agent, as closing it does
            self._release = weakref.finalize(self, transport.disconnect, self._agent)
            return
        if meta.host != host_identity() or not meta.host:
            raise UnsupportedDeviceError(
                f"peer process {meta.pid} runs on another host or PID namespace: the device's "
                f"IPC hooks cannot reach its memory. Use Endpoint(transport='nixl') on both sides")
        self._peer = Peer(meta)
        self._release = weakref.finalize(self, self._peer.close)  # a dropped one lets go too
    # -- the API --
    def read(self, local: torch.Tensor, remote) -> None:
        """Copy the remote range into `local` (same byte size)."""
        self._post(READ, [local], [remote], wait=True)

    def write(self, local: torch.Tensor, remote) -> None:
        """Copy `local` into the remote range (same byte size)."""
        self._post(WRITE, [local], [remote], wait=True)

    def readv(self, locals_, remotes) -> None:
        self._post(READ, list(locals_), list(remotes), wait=True)

    def writev(self, locals_, remotes) -> None:
        self._post(WRITE, list(locals_), list(remotes), wait=True)

    def read_async(self, local: torch.Tensor, remote) -> Transfer:
        return self._post(READ, [local], [remote])

    def write_async(self, local: torch.Tensor, remote) -> Transfer:
        return self._post(WRITE, [local], [remote])

    def readv_async(self, locals_, remotes) -> Transfer:
        return self._post(READ, list(locals_), list(remotes))

    def writev_async(self, locals_, remotes) -> Transfer:
        return self._post(WRITE, list(locals_), list(remotes))

    def mapped(self) -> int:
        """How many of the peer's registrations this connection holds open."""
        return 0 if self._peer is None else self._peer.mapped()

    def close(self) -> None:
        """Release every mapping of the peer's memory, or the peer's NIXL agent. Idempotent."""
        self._release()  # runs once
        self._agent = None

    # -- the work --
    def _descriptor(self, remote) -> Descriptor:
        if isinstance(remote, Descriptor):
            desc = remote
        else:
            if not isinstance(remote, (bytes, bytearray, memoryview)):
                raise InvalidHandleError(f"a remote descriptor is bytes, got "
                                         f"{type(remote).__name__}")
            desc = self._decoded.decode(bytes(remote))
        if desc.page != self._page_handle:
            raise InvalidHandleError("this descriptor was advertised by another process than "
                                     "the one this connection reaches")
        return desc

    def _post(self, op: str, locals_: list, remotes: list, wait: bool = False) -> Transfer:
        """Queue (or, host to host, run) the copies; with `wait`, return once they are done."""
        if len(locals_) != len(remotes):
            raise ValueError(f"{len(locals_)} local tensors for {len(remotes)} remote "
                             f"descriptors")
        decoded, page, descs = self._decoded, self._page_handle, []
        for remote in remotes:  # the common case first: bytes decoded before, of this peer
            desc = decoded.get(remote) if type(remote) is bytes else None
            descs.append(desc if desc is not None and desc.page == page
                         else self._descriptor(remote))
        for local, desc in zip(locals_, descs):
            _check_local(local, desc)
        if self._agent is not None:
            transfer = self._post_network(op, locals_, descs)
        elif self._peer is None:
            raise ValueError("this connection is closed")
        else:
            transfer = self._post_ipc(op, locals_, descs, wait)
        if wait:
            transfer.wait()
        return transfer

    def _post_ipc(self, op: str, locals_: list, descs: list, wait: bool) -> Transfer:
        peer = self._peer
        assert peer is not None  # _post checked it
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
                self._wait_for_owner(entries, descs, devices)
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

    def _on_host(self, pairs, entries, locals_) -> Transfer:
        """Host copies off the calling thread (the async calls). The job holds the local tensors:
        the pairs may be bare addresses."""

        peer = self._peer
        assert peer is not None  # _post checked it

        def copy():
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

    @staticmethod
    def _wait_for_owner(entries: list[RemoteEntry], descs: list[Descriptor], devices) -> None:
        """Make the current streams wait for the events recorded when the ranges were
        advertised (once per entry and event)."""
        from .._sharing import wait_for_producer

        for entry, desc in zip(entries, descs):
            if desc.event and desc.event not in entry.waited:
                for device in devices:
                    wait_for_producer(device, desc.event)
                entry.waited.add(desc.event)

    def _post_network(self, op: str, locals_: list, descs: list[Descriptor]) -> Transfer:
        local = []
        for tensor, desc in zip(locals_, descs):
            if not desc.extra:
                raise InvalidHandleError("this descriptor carries no NIXL part: advertise it "
                                         "from an Endpoint(transport='nixl')")
            if not tensor.is_contiguous():
                raise ValueError("the NIXL path moves contiguous local tensors only")
            local.append((tensor.data_ptr(), desc.nbytes, tensor.device))
        for device in {tensor.device for tensor in locals_} - {torch.device("cpu")}:
            # NIXL moves the bytes outside the device's streams: work queued on them first
            torch.get_device_module(device).synchronize(device)
        handle = self._endpoint._transport.post(op, self._agent, local,
                                                [desc.extra for desc in descs])
        return Transfer(handle=handle, keep=(locals_,))

    def __repr__(self) -> str:
        return f"<devipc.p2p.Connection to process {self.peer_pid}>"


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


def _copy(pairs) -> None:
    """Each (destination, source, bytes): host addresses by memmove (one thread, no dispatch),
    tensors by `copy_`, the device's own copy path on the current stream."""
    with torch.no_grad():
        for dst, src, nbytes in pairs:
            if nbytes is None:
                dst.copy_(src)
            else:
                ctypes.memmove(dst, src, nbytes)


def _check_local(local, desc: Descriptor) -> None:
    if type(local) is not torch.Tensor and not isinstance(local, torch.Tensor):
        raise TypeError(f"a local tensor is a torch.Tensor, not {type(local).__name__}")
    nbytes = local.nbytes
    if nbytes != desc.nbytes:
        raise TransferSizeError(f"the local tensor has {nbytes} bytes, the remote range "
                                f"{desc.nbytes}")


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
