"""devipc's one wire format: versioned, validated bytes, never pickle.

    magic b"DVIP" | u16 version | u16 kind | field*      (little-endian)
    field = u32 length | payload

Integers are 8-byte signed payloads, text is ASCII or UTF-8, arrays of integers are 8 bytes per
element. A reader names the type and the bounds of each field it expects, in order, and the bytes
must end exactly after the last one. Whatever the bytes hold, decoding raises only
InvalidHandleError: handles come from other processes, sockets and files, and a forged length or
count must neither crash nor allocate without bound. P2P descriptors use it too: a new kind
takes a new number, a changed layout a new version.
"""

import builtins
import functools
import re
import struct
from collections.abc import Callable, Sequence
from typing import TypeGuard, TypeVar

import torch

from ._errors import InvalidHandleError

MAGIC = b"DVIP"
VERSION = 6  # 2: a bucket's table as columns; 3: an arena attachment names its record's serial;
# 4: a publisher's records number 1,024, not 64 (a token's record index, the relay's cards)
# 5: a token across hosts names the publisher's block sums (`_remote_token`)
# 6: and every record (the relay's chain, read to go around a straggler)
_HEADER = struct.Struct("<4sHH")
_LENGTH = struct.Struct("<I")
_INT = struct.Struct("<q")
_STORAGES_KEPT = 4096  # storage handles whose wrapping is remembered, each way

# Kinds of message. Numbers are never reused.
STORAGE = 1  # a hooks' storage handle wrapped with the sender's device (reduce_tensor's args[7])
TENSOR = 2  # devipc.share
BUCKET = 3  # devipc.share_tensors
ARENA = 4  # devipc.Arena.attach: one consumer's way into an arena
CHUNK = 5  # devipc.Arena.put: a generation and its table
P2P_METADATA = 6  # devipc.p2p.Endpoint.metadata: how a peer reaches an endpoint
P2P_DESCRIPTOR = 7  # devipc.p2p.Endpoint.advertise: a registered tensor's byte range
P2P_NIXL = 8  # devipc.p2p over NIXL: the transport part of a P2P_DESCRIPTOR
P2P_NIXL_AGENT = 9  # devipc.p2p over NIXL: the transport part of a P2P_METADATA
WEIGHTS = 10  # devipc.WeightPublisher.token: an arena attachment and the published table
HOST = 11  # a CPU storage's shared-memory file (a CPU trainer's weights)
RELAY_CARD = 12  # how a relaying weight subscriber is reached (`_relay.Card`)
KIND_NAMES = {
    STORAGE: "storage handle",
    TENSOR: "tensor handle",
    BUCKET: "bucket handle",
    ARENA: "arena attachment",
    CHUNK: "arena chunk",
    P2P_METADATA: "p2p endpoint metadata",
    P2P_DESCRIPTOR: "p2p remote descriptor",
    P2P_NIXL: "p2p NIXL descriptor part",
    P2P_NIXL_AGENT: "p2p NIXL agent metadata",
    WEIGHTS: "WeightPublisher token",
    HOST: "host memory handle",
    RELAY_CARD: "relay card",
}

MAX_NDIM = 64
MAX_BYTES = 1 << 16  # a bytes or text field, unless its writer and reader name another limit
INT_MAX = (1 << 63) - 1
MAX_DEVICE_INDEX = 127
_DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")

# The dtypes that cross the wire; a dtype's code is its index here: append, never reorder.
_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
_DTYPE_BY_CODE = tuple(getattr(torch, name, None) for name in _DTYPE_NAMES)
DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPE_BY_CODE) if dtype is not None}


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype as one byte: its index in the fixed list of names above."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"devipc cannot send tensors of dtype {dtype}") from None


def dtypes_of(codes: bytes) -> list[torch.dtype]:
    """The dtypes of `dtype_code`s; InvalidHandleError for a code this torch does not know."""
    try:
        found = [_DTYPE_BY_CODE[code] for code in codes]
    except IndexError:
        found = [None]
    dtypes = [dtype for dtype in found if dtype is not None]
    if len(dtypes) != len(found):
        raise InvalidHandleError(f"unknown dtype code in {codes[:16]!r}")
    return dtypes


class Writer:
    """Builds one message; fields go in the order the kind's reader expects them."""

    def __init__(self, kind: builtins.int):
        self._parts = [_HEADER.pack(MAGIC, VERSION, kind)]

    def _field(self, payload: builtins.bytes) -> "Writer":
        self._parts += [_LENGTH.pack(len(payload)), payload]
        return self

    def int(self, value: builtins.int) -> "Writer":
        return self._field(_INT.pack(value))

    def bytes(self, value: builtins.bytes, limit: builtins.int = MAX_BYTES) -> "Writer":
        if len(value) > limit:
            raise ValueError(f"this wire field holds at most {limit} bytes, not {len(value)}")
        return self._field(bytes(value))

    def text(self, value: str) -> "Writer":
        return self.bytes(value.encode("utf-8"))

    def ints(self, values: Sequence[builtins.int]) -> "Writer":
        return self._field(struct.pack(f"<{len(values)}q", *values))

    def device(self, device: torch.device) -> "Writer":
        return self.text(device.type).int(device.index or 0)

    def done(self) -> builtins.bytes:
        return b"".join(self._parts)


class Reader:
    """Reads one message of an expected kind; every failure is an InvalidHandleError."""

    def __init__(
        self,
        data: builtins.bytes | bytearray | memoryview,
        kinds: tuple[builtins.int, ...],
        name: str = "devipc handle",
    ):
        """`name`: what errors call the message (the object a user holds: "WeightPublisher
        token")."""
        self.name = name
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidHandleError(f"a {name} is bytes, got {type(data).__name__}")
        self._data = bytes(data)
        if len(self._data) < _HEADER.size:
            raise InvalidHandleError(
                f"truncated {name}: {len(self._data)} bytes, the header alone has {_HEADER.size}"
            )
        magic, version, kind = _HEADER.unpack_from(self._data)
        if magic != MAGIC:
            raise InvalidHandleError(f"not a {name}: magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise InvalidHandleError(
                f"{name} of wire version {version}; this devipc "
                f"reads version {VERSION}: use the same devipc on both sides"
            )
        if kind not in kinds:
            wanted = " or ".join(KIND_NAMES[k] for k in kinds)
            raise InvalidHandleError(
                f"expected a {wanted}, got a "
                f"{KIND_NAMES.get(kind, f'message of unknown kind {kind}')}"
            )
        self.kind = kind
        self._at = _HEADER.size

    def _field(self, what: str) -> builtins.bytes:
        if self._at + _LENGTH.size > len(self._data):
            raise InvalidHandleError(f"truncated {self.name}: {what} is missing")
        (length,) = _LENGTH.unpack_from(self._data, self._at)
        start = self._at + _LENGTH.size
        if length > len(self._data) - start:
            raise InvalidHandleError(
                f"truncated {self.name}: {what} claims {length} bytes, "
                f"{len(self._data) - start} are left"
            )
        self._at = start + length
        return self._data[start : self._at]

    def int(self, what: str, low: builtins.int = 0, high: builtins.int = INT_MAX) -> builtins.int:
        payload = self._field(what)
        if len(payload) != _INT.size:
            raise InvalidHandleError(
                f"{what}: an integer field has {_INT.size} bytes, not {len(payload)}"
            )
        (value,) = _INT.unpack(payload)
        if not low <= value <= high:
            raise InvalidHandleError(f"{what} is {value}, outside {low}..{high}")
        return value

    def flag(self, what: str) -> bool:
        return bool(self.int(what, 0, 1))

    def bytes(self, what: str, max_len: builtins.int = MAX_BYTES) -> builtins.bytes:
        payload = self._field(what)
        if len(payload) > max_len:
            raise InvalidHandleError(f"{what} has {len(payload)} bytes, at most {max_len} allowed")
        return payload

    def text(self, what: str, max_len: builtins.int = 1024) -> str:
        try:
            return self.bytes(what, max_len).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidHandleError(f"{what} is not UTF-8 text") from None

    def device_type(self) -> str:
        value = self.bytes("device type", 32)
        try:
            text = value.decode("ascii")
        except UnicodeDecodeError:
            text = ""
        if not _DEVICE_TYPE.fullmatch(text):
            raise InvalidHandleError(f"device type {value!r} is not a short lowercase ASCII name")
        return text

    def device(self) -> torch.device:
        """A device type and the sender's index of it (torch allows at most 127)."""
        device_type = self.device_type()
        index = self.int("device index", 0, MAX_DEVICE_INDEX)
        try:
            return torch.device(device_type, index)
        except RuntimeError:
            raise InvalidHandleError(f"unknown device type {device_type!r}") from None

    def ints(
        self, what: str, max_count: builtins.int = MAX_NDIM, exact: bool = False
    ) -> tuple[builtins.int, ...]:
        """Non-negative integers: at most `max_count`, or exactly that many with `exact`."""
        payload = self._field(what)
        count, rest = divmod(len(payload), _INT.size)
        if rest or count > max_count or exact and count != max_count:
            raise InvalidHandleError(
                f"{what}: {len(payload)} bytes is not a list of "
                f"{'exactly' if exact else 'at most'} {max_count} integers"
            )
        values = struct.unpack(f"<{count}q", payload)
        if values and min(values) < 0:
            raise InvalidHandleError(f"{what} {values} holds a negative value")
        return values

    def rest(self) -> builtins.bytes:
        """The bytes not read yet: a cache's key for what they decode to (`skip_rest`)."""
        return self._data[self._at :]

    def skip_rest(self) -> None:
        """The rest counts as read: a cache held what it decodes to (`rest`)."""
        self._at = len(self._data)

    def end(self) -> None:
        if self._at != len(self._data):
            raise InvalidHandleError(
                f"{len(self._data) - self._at} unexpected bytes after the "
                f"last field of a {self.name}"
            )


_D = TypeVar("_D")
_T = TypeVar("_T")


def decode(read: Callable[[_D], _T], data: _D, what: str) -> _T:
    """`read(data)`, where any failure reads as InvalidHandleError: a gap in a reader's checks
    must still name bad bytes, never leak a TypeError or struct.error."""
    try:
        return read(data)
    except InvalidHandleError:
        raise
    except Exception as error:
        raise InvalidHandleError(f"malformed {what}: {error}") from error


class Decoded(dict[bytes, _T]):
    """Messages already decoded, by their bytes (a connection sees the same descriptors call after
    call). Bounded: cleared whole when full, which is simple and safe with other threads
    calling; `get` is the dict's, for callers that look up many at once."""

    def __init__(self, read: Callable[[bytes], _T], limit: int):
        super().__init__()
        self._read, self._limit = read, limit

    def decode(self, data: bytes) -> _T:
        value = self.get(data)
        if value is None:
            value = self._read(data)
            if len(self) >= self._limit:
                self.clear()
            self[data] = value
        return value


@functools.lru_cache(maxsize=_STORAGES_KEPT)
def wrap_storage_handle(device: torch.device, handle: bytes) -> bytes:
    """reduce_tensor's args[7]: the hooks' handle, with the device the sender put in args[6].
    Cached: an allocation sent again (every step's weights) costs a lookup."""
    return Writer(STORAGE).device(device).bytes(handle).done()


def is_wrapped(handle: object) -> TypeGuard[bytes]:
    return isinstance(handle, bytes) and handle[:4] == MAGIC


def _read_storage_handle(data: bytes | bytearray | memoryview) -> tuple[torch.device, bytes]:
    reader = Reader(data, (STORAGE,))
    device = reader.device()
    handle = reader.bytes("memory handle")
    reader.end()
    return device, handle


_unwrapped = Decoded(_read_storage_handle, _STORAGES_KEPT)


def unwrap_storage_handle(data: bytes | bytearray | memoryview) -> tuple[torch.device, bytes]:
    """(the sender's device, the hooks' handle) of `wrap_storage_handle`'s bytes; the handles
    of allocations received before are looked up, not parsed again."""
    if type(data) is bytes:
        return _unwrapped.decode(data)
    return _read_storage_handle(data)
