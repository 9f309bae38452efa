"""Endpoints and connections: one-sided reads and writes of registered tensors of other processes.

`Endpoint(transport)`: "auto" or "ipc" reaches peers on the same host through the device's IPC
hooks (`_ipc.IpcTransport`); "nixl" goes through NIXL even on one host (`_nixl.NixlTransport`,
imported only then); any object following `_transport.Transport` may be passed instead. The
endpoint validates what every transport needs (descriptors, local tensors, the registry) and
the transport moves the bytes. The owner's Python code takes no part in a transfer: its metadata
and descriptors are all a peer needs.
"""

import os
import secrets
import threading
import weakref
from collections.abc import Iterable
from typing import cast

import torch

from .._core import _wire
from .._core._errors import InvalidHandleError, TransferSizeError
from .._core._handles import identity_of
from . import _transport
from ._descriptor import NONE, Descriptor, Metadata, check_name, host_identity
from ._registry import Registration, registry
from ._transfer import Transfer
from ._transport import READ, WRITE, Link, LinkExtras, Transport, operation

__all__ = ["Connection", "Endpoint", "PreparedTransfer"]

_DECODED_KEPT = 4096  # decoded descriptors a connection remembers, by their bytes
_VECTORS_KEPT = 64  # vectors of descriptors a connection remembers, decoded, by all their bytes
_VECTOR_MIN = 16  # descriptors from which a vector is remembered whole


def _make_transport(transport: str | Transport, agent_name: str) -> Transport:
    # Each transport is imported once asked for: NIXL is an optional extra, and neither is
    # needed by a process that only registers.
    if transport in ("auto", "ipc"):
        from ._ipc import IpcTransport

        return IpcTransport()
    if transport == "nixl":
        from ._nixl import NixlTransport

        return NixlTransport(agent_name)
    if isinstance(transport, str) or not isinstance(transport, Transport):
        raise ValueError(
            f"transport is 'auto', 'ipc', 'nixl' or a Transport object (name, "
            f"metadata, describe, connect, close), not {transport!r}"
        )
    check_name(transport.name)
    return transport


class Endpoint:
    """This process's side of point-to-point transfers; any number of peers `connect` to it."""

    def __init__(self, transport: str | Transport = "auto"):
        self._token = secrets.token_hex(8)
        self.name = f"devipc-{os.getpid()}-{self._token}"
        self._transport = _make_transport(transport, self.name)
        self.transport: str = self._transport.name
        self._listens = hasattr(self._transport, "on_register")
        if self._listens:
            registry.add_listener(self._transport)
        self._connections: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False

    def metadata(self) -> bytes:
        """What a peer passes to its `connect` (send it out of band: a socket, a store)."""
        self._check_open()
        extra = bytes(self._transport.metadata())
        return Metadata(
            self.transport, host_identity(), os.getpid(), registry.page().handle, extra
        ).to_bytes()

    def connect(
        self, peer_metadata: bytes | bytearray | memoryview, *, liveness: bool = True
    ) -> "Connection":
        """A connection to the endpoint whose `metadata()` this is. `liveness=False` leaves out
        the round trip before each NIXL post that checks the peer's registrations still live:
        for a peer whose registrations live as long as its endpoint, where a transfer fails
        anyway once it is gone."""
        self._check_open()
        meta = Metadata.from_bytes(peer_metadata)
        if meta.transport != self.transport:
            raise InvalidHandleError(
                f"the peer's endpoint uses transport {meta.transport!r}, "
                f"this one {self.transport!r}: make both with the same "
                f"transport"
            )
        connection = Connection(self, meta, liveness)
        with self._lock:
            self._connections.add(connection)
        return connection

    def advertise(
        self, tensor_or_id: torch.Tensor | int, offset: int = 0, nbytes: int | None = None
    ) -> bytes:
        """A remote descriptor of a registered tensor's bytes [offset, offset + nbytes) (from the
        tensor's first byte; for an id, from its storage's). Work queued so far on the tensor's
        device is visible to the peers' transfers through it (an event, or a synchronization)."""
        self._check_open()
        reg, offset, nbytes = _resolve(tensor_or_id, offset, nbytes)
        where: dict = dict(
            kind=NONE, mem=b"", mem_offset=0, counter=b"", anchor=0, fd=0, event=b"", extra=b""
        )
        fields = self._transport.describe(reg, offset, nbytes)
        unknown = set(fields) - set(where)
        if unknown:
            raise ValueError(
                f"transport {self.transport!r} described fields a descriptor does "
                f"not have: {sorted(unknown)} (only {sorted(where)})"
            )
        where.update(fields)
        identity = b"" if reg.device.type == "cpu" else identity_of(reg.device)
        return Descriptor(
            page=registry.page().handle,
            reg_id=reg.id,
            slot=reg.slot,
            storage_bytes=reg.nbytes,
            offset=offset,
            nbytes=nbytes,
            device=reg.device,
            identity=identity,
            **where,
        ).to_bytes()

    def close(self) -> None:
        """Close every connection and the transport. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections, self._connections = list(self._connections), weakref.WeakSet()
        for connection in connections:
            connection.close()
        if self._listens:
            registry.remove_listener(self._transport)
        self._transport.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this endpoint is closed")

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<devipc.p2p.Endpoint {self.name} over {self.transport}>"


def _int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _resolve(
    tensor_or_id: torch.Tensor | int, offset: int, nbytes: int | None
) -> tuple[Registration, int, int]:
    """(registration, byte offset in its storage, byte count) of what `advertise` was given."""
    offset = _int(offset, "offset")
    if isinstance(tensor_or_id, torch.Tensor):
        reg = registry.lookup(tensor_or_id)
        tensor = tensor_or_id
        if not tensor.is_contiguous():
            raise ValueError(
                "advertise a contiguous tensor (or its registration id with a byte "
                "range): a strided view is not one byte range"
            )
        start = cast(int, tensor.storage_offset()) * tensor.element_size()
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


Remote = Descriptor | bytes | bytearray | memoryview
Offset = int | None


class Connection:
    """A connection to one peer endpoint: reads and writes of the tensors it advertised.
    read/write/readv/writev return when the data arrived; the `_async` variants return a
    Transfer; `prepare` validates a transfer once for many posts. Device copies are queued on
    the current stream of the calling thread, so they are ordered with its other work on that
    stream (a small copy the idle stream would run at once may run in the calling thread).

    `offset` (`offsets` for vectors, one per pair) asks for a sub-range: the local tensor's bytes
    from that byte of the advertised range on, never past its end (TransferSizeError). Without
    it the local tensor and the advertised range must be the same size."""

    def __init__(self, endpoint: Endpoint, meta: Metadata, liveness: bool = True):
        self._endpoint, self.peer_pid = endpoint, meta.pid
        self._page_handle = meta.page
        self._decoded = _wire.Decoded(Descriptor.from_bytes, _DECODED_KEPT)
        self._vectors: dict[tuple, list[Descriptor]] = {}  # vectors of bytes, decoded and checked
        self._link: Link | None = endpoint._transport.connect(meta)
        self._extras = LinkExtras.of(self._link)
        if not liveness and self._extras.liveness is not None:  # a NIXL link's
            self._link.liveness = False  # type: ignore[attr-defined]
        self._sub_ranges, self._again = bool(self._extras.sub_ranges), self._extras.again
        # (id(descriptor), offset, nbytes) -> (descriptor, its sub-range)
        self._narrowed: dict[tuple[int, int, int], tuple[Descriptor, Descriptor]] = {}
        self._prepared: weakref.WeakSet[PreparedTransfer] = weakref.WeakSet()
        # a dropped connection lets go of the peer (mappings, its agent) as closing it does
        self._release = weakref.finalize(self, self._link.close)

    # -- the API --
    def read(self, local: torch.Tensor, remote: Remote, offset: Offset = None) -> None:
        """Copy the remote range (or its bytes from `offset`) into `local`."""
        self._one(READ, local, remote, offset)

    def write(self, local: torch.Tensor, remote: Remote, offset: Offset = None) -> None:
        """Copy `local` into the remote range (or into its bytes from `offset`)."""
        self._one(WRITE, local, remote, offset)

    def readv(
        self,
        locals_: Iterable[torch.Tensor],
        remotes: Iterable[Remote],
        offsets: Iterable[int] | None = None,
    ) -> None:
        self._post(READ, list(locals_), list(remotes), True, offsets)

    def writev(
        self,
        locals_: Iterable[torch.Tensor],
        remotes: Iterable[Remote],
        offsets: Iterable[int] | None = None,
    ) -> None:
        self._post(WRITE, list(locals_), list(remotes), True, offsets)

    def read_async(self, local: torch.Tensor, remote: Remote, offset: Offset = None) -> Transfer:
        return self._post(READ, [local], [remote], False, None if offset is None else (offset,))

    def write_async(self, local: torch.Tensor, remote: Remote, offset: Offset = None) -> Transfer:
        return self._post(WRITE, [local], [remote], False, None if offset is None else (offset,))

    def readv_async(
        self,
        locals_: Iterable[torch.Tensor],
        remotes: Iterable[Remote],
        offsets: Iterable[int] | None = None,
    ) -> Transfer:
        return self._post(READ, list(locals_), list(remotes), False, offsets)

    def writev_async(
        self,
        locals_: Iterable[torch.Tensor],
        remotes: Iterable[Remote],
        offsets: Iterable[int] | None = None,
    ) -> Transfer:
        return self._post(WRITE, list(locals_), list(remotes), False, offsets)

    def prepare(
        self,
        op: str,
        locals_: Iterable[torch.Tensor],
        remotes: Iterable[Remote],
        offsets: Iterable[int] | None = None,
    ) -> "PreparedTransfer":
        """`op` ("read" or "write") of each local tensor and remote range, validated once:
        `post()` starts it again and again. The local tensors are held until `close()`."""
        kind = operation(op)
        locals_ = list(locals_)
        descs = self._descs(locals_, list(remotes), offsets)
        prepared = PreparedTransfer(
            self, self._extras.prepared(self._open_link(), kind, locals_, descs)
        )
        self._prepared.add(prepared)
        return prepared

    def map(self, remote: Remote) -> torch.Tensor:
        """The remote range itself, mapped into this process: a uint8 tensor over the owner's
        memory, no copy (same host, `transport="ipc"`). It sees the owner's writes, and keeps
        that memory for as long as it lives, also once the owner freed its tensor or exited.
        ValueError for a transport that cannot map (NIXL: `read` a copy)."""
        self._open_link()
        map_range = self._extras.map
        if map_range is None:
            raise ValueError(
                f"transport {self._endpoint.transport!r} cannot map a peer's "
                f"memory into this process: read a copy instead"
            )
        return map_range(self._descriptor(remote))

    def mapped(self) -> int:
        """How many of the peer's registrations this connection holds open."""
        link = self._link
        return 0 if link is None else link.mapped()

    def close(self) -> None:
        """Release every mapping of the peer's memory, or the peer's NIXL agent, and every
        prepared transfer. Idempotent."""
        self._link = None
        for prepared in list(self._prepared):
            prepared.close()
        self._release()  # runs once

    # -- the work --
    def _open_link(self) -> Link:
        link = self._link
        if link is None:
            raise ValueError("this connection is closed: connect again")
        return link

    def _descriptor(self, remote: Remote) -> Descriptor:
        if isinstance(remote, Descriptor):
            desc = remote
        else:
            if not isinstance(remote, (bytes, bytearray, memoryview)):
                raise InvalidHandleError(
                    f"a remote descriptor is bytes, got {type(remote).__name__}"
                )
            desc = self._decoded.decode(bytes(remote))
        if desc.page != self._page_handle:
            raise InvalidHandleError(
                "this descriptor was advertised by another process than "
                "the one this connection reaches"
            )
        return desc

    def _descs(
        self, locals_: list, remotes: list, offsets: Iterable[int] | None
    ) -> list[Descriptor]:
        """The descriptors of `remotes`, narrowed to `offsets`, checked against `locals_`."""
        if len(locals_) != len(remotes):
            raise ValueError(f"{len(locals_)} local tensors for {len(remotes)} remote descriptors")
        whole, tensor = offsets is None, torch.Tensor
        key = tuple(remotes) if len(remotes) >= _VECTOR_MIN and type(remotes[0]) is bytes else None
        try:
            known = None if key is None else self._vectors.get(key)
        except TypeError:  # unhashable remotes (a bytearray): decoded one by one
            key = known = None
        if known is not None:  # a vector seen before (bytes hash once): only the locals change
            if whole:
                for local, desc in zip(locals_, known):
                    if type(local) is not tensor or local.nbytes != desc.nbytes:
                        _check_local(local, desc)
                return known
            return self._narrow(locals_, known, list(offsets or ()))
        decoded, page = self._decoded, self._page_handle
        descs: list[Descriptor] = []
        append = descs.append
        for local, remote in zip(locals_, remotes):
            # the common case first: bytes decoded before, of this peer, the whole range
            found = decoded.get(remote) if type(remote) is bytes else None
            desc = found if found is not None and found.page == page else self._descriptor(remote)
            if whole and (type(local) is not tensor or local.nbytes != desc.nbytes):
                _check_local(local, desc)  # says what is wrong (or takes a subclass)
            append(desc)
        if key is not None and all(type(remote) is bytes for remote in key):
            if len(self._vectors) >= _VECTORS_KEPT:
                self._vectors.clear()
            self._vectors[key] = descs
        if whole:
            return descs
        return self._narrow(locals_, descs, list(offsets or ()))

    def _narrow(
        self, locals_: list, descs: list[Descriptor], offsets: list[int]
    ) -> list[Descriptor]:
        """The sub-ranges of `descs` at `offsets`, as long as the local tensors."""
        if len(offsets) != len(descs):
            raise ValueError(f"{len(offsets)} offsets for {len(descs)} remote descriptors")
        narrowed, kept = [], self._narrowed
        for local, desc, offset in zip(locals_, descs, offsets):
            _check_local(local, None)
            offset = _int(offset, "offset")
            key = (id(desc), offset, local.nbytes)
            known = kept.get(key)
            if known is not None and known[0] is desc:
                narrowed.append(known[1])
                continue
            sub = desc.narrow(offset, local.nbytes)
            if sub is not desc and not self._sub_ranges:
                raise ValueError(
                    f"transport {self._endpoint.transport!r} does not move "
                    f"sub-ranges: ask the owner to advertise the range itself"
                )
            if len(kept) >= _DECODED_KEPT:
                kept.clear()
            kept[key] = (desc, sub)  # the same object each time: the link's caches know it
            narrowed.append(sub)
        return narrowed

    def _one(self, op: str, local: torch.Tensor, remote: Remote, offset: Offset) -> None:
        """A synchronous read or write of one pair: what `_post` does, the common case (a
        descriptor seen before, the whole range) checked inline (it is most of a small copy)."""
        desc = self._decoded.get(remote) if type(remote) is bytes else None
        link = self._link
        if (
            desc is None
            or offset is not None
            or link is None
            or desc.page != self._page_handle
            or type(local) is not torch.Tensor
            or local.nbytes != desc.nbytes
        ):
            self._post(op, [local], [remote], True, None if offset is None else (offset,))
        elif self._again is None or not self._again(op, local, desc):
            link.post(op, [local], [desc], True).wait()

    def _post(
        self, op: str, locals_: list, remotes: list, wait: bool, offsets: Iterable[int] | None
    ) -> Transfer:
        """Queue (or, host to host, run) the copies; with `wait`, return once they are done."""
        descs = self._descs(locals_, remotes, offsets)
        transfer = self._open_link().post(op, locals_, descs, wait)
        if wait:
            transfer.wait()
        return transfer

    def __repr__(self) -> str:
        return f"<devipc.p2p.Connection to process {self.peer_pid}>"


class PreparedTransfer:
    """A read or write of fixed local tensors and remote ranges, validated once
    (`Connection.prepare`): each `post()` is one transfer, checked only for the remote
    registrations' liveness (RemoteTensorFreedError once one ended). Close it (or use it as a
    context manager) to let go of the local tensors and the peer's memory it holds mapped."""

    def __init__(self, connection: Connection, prepared: _transport.Prepared):
        self._connection: Connection | None = connection
        self._prepared = prepared
        self._close = weakref.finalize(self, prepared.close)  # dropped: let go as well

    def post(self) -> Transfer:
        """Start the transfer; `wait()` on what it returns (or poll `done()`)."""
        connection = self._connection
        if connection is None:
            raise ValueError("this prepared transfer is closed: prepare it again")
        if connection._link is None:
            raise ValueError(
                "the connection of this prepared transfer is closed: connect and prepare again"
            )
        return self._prepared.post()

    def close(self) -> None:
        """Idempotent."""
        self._connection = None
        self._close()  # runs once

    def __enter__(self) -> "PreparedTransfer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<devipc.p2p.PreparedTransfer{' closed' if self._connection is None else ''}>"


def _check_local(local: object, desc: Descriptor | None) -> None:
    if type(local) is not torch.Tensor and not isinstance(local, torch.Tensor):
        raise TypeError(f"a local tensor is a torch.Tensor, not {type(local).__name__}")
    nbytes = local.nbytes
    if desc is not None and nbytes != desc.nbytes:
        raise TransferSizeError(
            f"the local tensor has {nbytes} bytes, the remote range "
            f"{desc.nbytes} (pass an offset to move a sub-range)"
        )
