"""Endpoint metadata and remote descriptors as devipc wire bytes (`devipc._core._wire`), validated
field by field: they come from other processes, and anything malformed is InvalidHandleError.

    P2P_METADATA   = transport name | host | pid | registry page handle | transport metadata
    P2P_DESCRIPTOR = registry page handle | registration id | page slot | storage bytes |
                     range offset | range bytes | device | device identity | memory kind |
                     memory handle | offset in allocation | ref-counter handle | anchor slot or
                     inode | fd | event | transport extra
"""

import re
from dataclasses import dataclass, field, replace

import torch

from .._core import _wire
from .._core._errors import InvalidHandleError, TransferSizeError
from .._core._memfd import HANDLE_SIZE, handle_pid, host_identity
from .._core._refcount import SLOTS_PER_FILE
from ._registry import PAGE_SLOTS

__all__ = ["CPU", "DEVICE", "NONE", "Descriptor", "Metadata", "check_name", "host_identity"]

NONE, DEVICE, CPU = 0, 1, 2  # how a peer on the same host reaches the memory
MAX_FD = 1 << 30
_NAME = re.compile(r"[a-z][a-z0-9_.-]{0,15}")


@dataclass(frozen=True)
class Metadata:
    transport: str
    host: bytes
    pid: int
    page: bytes  # the registry page's memfd handle
    extra: bytes  # the transport's own metadata (NIXL agent metadata), or b""

    def to_bytes(self) -> bytes:
        writer = _wire.Writer(_wire.P2P_METADATA).text(self.transport).bytes(self.host)
        return writer.int(self.pid).bytes(self.page).bytes(self.extra).done()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "Metadata":
        reader = _wire.Reader(data, (_wire.P2P_METADATA,))
        transport = reader.text("transport", 16)
        try:
            check_name(transport)
        except ValueError as error:
            raise InvalidHandleError(f"p2p metadata names no transport: {error}") from None
        host = reader.bytes("host identity", 256)
        pid = reader.int("pid", 1, (1 << 31) - 1)
        page = reader.bytes("registry page handle", HANDLE_SIZE)
        if len(page) != HANDLE_SIZE:
            raise InvalidHandleError(
                f"a registry page handle has {HANDLE_SIZE} bytes, not {len(page)}"
            )
        extra = reader.bytes("transport metadata")
        reader.end()
        if handle_pid(page) != pid:
            raise InvalidHandleError(
                f"the registry page handle names another process than pid {pid}"
            )
        return cls(transport, host, pid, page, extra)


@dataclass(frozen=True)
class Descriptor:
    page: bytes
    reg_id: int
    slot: int
    storage_bytes: int
    offset: int  # of the range, in bytes from the storage's start
    nbytes: int
    device: torch.device
    identity: bytes
    kind: int  # NONE, DEVICE or CPU
    mem: bytes  # DEVICE: the hooks' memory handle
    mem_offset: int  # DEVICE: the storage's offset in its allocation
    counter: bytes  # DEVICE: the ref-counter file of the anchor send
    anchor: int  # DEVICE: the anchor send's slot; CPU: the shared file's inode
    fd: int  # CPU: the owner's fd of the shared file
    event: bytes  # DEVICE: an interprocess event recorded when advertised, or b""
    extra: bytes  # the transport's part (NIXL), or b""
    # bytes from the advertised range's start to this one's (`narrow`): never on the wire, so a
    # transport whose `extra` names the advertised range's address adds it
    shift: int = field(default=0, compare=False)

    def narrow(self, offset: int, nbytes: int) -> "Descriptor":
        """Bytes [offset, offset + nbytes) of this range: only what the owner advertised."""
        if offset == 0 and nbytes == self.nbytes:
            return self
        if type(offset) is not int or offset < 0 or offset + nbytes > self.nbytes:
            raise TransferSizeError(
                f"bytes [{offset}, {offset + nbytes}) are not inside the "
                f"{self.nbytes} bytes the owner advertised: pass an offset "
                f"in [0, {self.nbytes - nbytes}] or ask for a larger range"
            )
        return replace(self, offset=self.offset + offset, nbytes=nbytes, shift=self.shift + offset)

    def to_bytes(self) -> bytes:
        writer = _wire.Writer(_wire.P2P_DESCRIPTOR).bytes(self.page).int(self.reg_id)
        writer.int(self.slot).int(self.storage_bytes).int(self.offset).int(self.nbytes)
        writer.device(self.device).bytes(self.identity).int(self.kind).bytes(self.mem)
        writer.int(self.mem_offset).bytes(self.counter).int(self.anchor).int(self.fd)
        return writer.bytes(self.event).bytes(self.extra).done()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "Descriptor":
        return _wire.decode(cls._decode, data, "p2p descriptor")

    @classmethod
    def _decode(cls, data: bytes | bytearray | memoryview) -> "Descriptor":
        reader = _wire.Reader(data, (_wire.P2P_DESCRIPTOR,))
        page = reader.bytes("registry page handle", HANDLE_SIZE)
        reg_id = reader.int("registration id", 1)
        slot = reader.int("registry slot", 0, PAGE_SLOTS - 1)
        storage_bytes = reader.int("storage size", 1)
        offset = reader.int("range offset", 0, storage_bytes)
        nbytes = reader.int("range size", 0, storage_bytes - offset)
        device = reader.device()
        identity = reader.bytes("device identity", 256)
        kind = reader.int("memory kind", NONE, CPU)
        mem = reader.bytes("memory handle")
        mem_offset = reader.int("offset in allocation")
        counter = reader.bytes("ref-counter handle", HANDLE_SIZE)
        anchor = reader.int("anchor slot or inode")
        fd = reader.int("fd", 0, MAX_FD)
        event = reader.bytes("event handle", 1024)
        extra = reader.bytes("transport extra")
        reader.end()
        if len(page) != HANDLE_SIZE:
            raise InvalidHandleError(
                f"a registry page handle has {HANDLE_SIZE} bytes, not {len(page)}"
            )
        if kind == DEVICE and (not mem or len(counter) != HANDLE_SIZE or anchor >= SLOTS_PER_FILE):
            raise InvalidHandleError(
                "a device descriptor needs a memory handle, a ref-counter "
                "handle and an anchor slot inside the file"
            )
        if kind == CPU and (device != torch.device("cpu", 0) or mem or counter or mem_offset):
            raise InvalidHandleError("a CPU descriptor names a CPU tensor by fd and inode only")
        return cls(
            page=page,
            reg_id=reg_id,
            slot=slot,
            storage_bytes=storage_bytes,
            offset=offset,
            nbytes=nbytes,
            device=device,
            identity=identity,
            kind=kind,
            mem=mem,
            mem_offset=mem_offset,
            counter=counter,
            anchor=anchor,
            fd=fd,
            event=event,
            extra=extra,
        )


def check_name(name: object) -> str:
    """A transport's name: a short lowercase word, as the wire format carries it."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"a transport's name is 1-16 characters of [a-z0-9_.-] starting with a "
            f"letter, got {name!r}"
        )
    return name
