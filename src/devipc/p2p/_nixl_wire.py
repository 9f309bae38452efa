"""The NIXL path's wire formats: a descriptor's transport part (`Remote`) and an agent's metadata,
each ending with a digest (`sealed`) checked before NIXL's own parser sees a byte. NIXL parses
its blobs itself and a damaged one can crash it (fuzzing found segfaults), so damaged bytes are
InvalidHandleError here. Torch-free and NIXL-free: the cross-host weight publisher reads tokens
with it too."""

import hashlib
import hmac
import struct
from dataclasses import dataclass

from .._core import _wire
from .._core._errors import InvalidHandleError
from ._registry import PAGE_SLOTS

__all__ = [
    "KINDS",
    "Remote",
    "agent_metadata_from_bytes",
    "agent_metadata_to_bytes",
    "sealed",
    "unsealed",
]

KINDS = ("DRAM", "VRAM")


@dataclass(frozen=True)
class Remote:
    """A decoded transport part of a peer's descriptor."""

    agent: str
    kind: str
    dev_id: int
    addr: int
    nbytes: int
    reg_id: int
    slot: int
    page: int  # the address of the peer's registry page
    partial: bytes  # the registration's partial agent metadata

    def to_bytes(self) -> bytes:
        writer = _wire.Writer(_wire.P2P_NIXL).text(self.agent).text(self.kind)
        writer.int(self.dev_id).int(self.addr).int(self.nbytes).int(self.reg_id).int(self.slot)
        return sealed(writer.int(self.page).bytes(self.partial))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "Remote":
        reader = _wire.Reader(unsealed(data), (_wire.P2P_NIXL,))
        agent = reader.text("NIXL agent name", 256)
        kind = reader.text("memory kind", 8)
        if kind not in KINDS:
            raise InvalidHandleError(f"memory kind {kind!r} is not one of {KINDS}")
        dev_id = reader.int("NIXL device id", 0, 1 << 20)
        addr = reader.int("address", 1)
        nbytes = reader.int("range size")
        reg_id = reader.int("registration id", 1)
        slot = reader.int("registry slot", 0, PAGE_SLOTS - 1)
        page = reader.int("registry page address", 1)
        partial = reader.bytes("NIXL partial metadata")
        reader.end()
        if not agent or not partial:
            raise InvalidHandleError("a NIXL descriptor needs an agent name and metadata")
        return cls(agent, kind, dev_id, addr, nbytes, reg_id, slot, page, partial)


_DIGEST = 16
_SEAL = 4 + _DIGEST  # the digest field: its length and itself


def _seal_of(body: bytes) -> bytes:
    """A last wire field (u32 length | payload) holding the digest of everything before it."""
    return struct.pack("<I", _DIGEST) + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def sealed(writer: "_wire.Writer") -> bytes:
    """The message with a digest as its last field. NIXL parses its metadata blobs itself, and a
    damaged one can crash it (fuzzing found segfaults): damaged bytes must never reach it."""
    body = writer.done()
    return body + _seal_of(body)


def unsealed(data: bytes | bytearray | memoryview) -> bytes:
    """The message `sealed` made, its digest checked and removed; InvalidHandleError if damaged."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidHandleError(f"a NIXL part is bytes, got {type(data).__name__}")
    data = bytes(data)
    body = data[:-_SEAL]
    if len(data) <= _SEAL or not hmac.compare_digest(data[-_SEAL:], _seal_of(body)):
        raise InvalidHandleError(
            "a NIXL part of a descriptor or of metadata is damaged (its digest does not match)"
        )
    return body


def agent_metadata_to_bytes(agent: str, blob: bytes) -> bytes:
    return sealed(_wire.Writer(_wire.P2P_NIXL_AGENT).text(agent).bytes(blob))


def agent_metadata_from_bytes(data: bytes | bytearray | memoryview) -> tuple[str, bytes]:
    reader = _wire.Reader(unsealed(data), (_wire.P2P_NIXL_AGENT,))
    agent = reader.text("NIXL agent name", 256)
    blob = reader.bytes("NIXL agent metadata")
    reader.end()
    if not agent or not blob:
        raise InvalidHandleError("NIXL agent metadata needs an agent name and its metadata")
    return agent, blob
