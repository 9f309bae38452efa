"""The wire format: round trips, every kind of malformed input refused as InvalidHandleError, and
random mutations of real handle bytes that never raise anything else."""

import random
import struct

import pytest
import torch

import devipc
from devipc._core import _wire
from devipc._core._handles import Handle


def _message(kind=_wire.TENSOR, version=_wire.VERSION, magic=_wire.MAGIC, body=b""):
    return struct.pack("<4sHH", magic, version, kind) + body


def _field(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def test_fields_round_trip():
    data = (
        _wire.Writer(_wire.TENSOR)
        .device(torch.device("openreg", 3))
        .bytes(b"\0\1")
        .text("ünï")
        .int(-5)
        .ints([0, 2, 1 << 40])
        .done()
    )
    assert data[:4] == b"DVIP"
    reader = _wire.Reader(data, (_wire.TENSOR,))
    assert reader.device() == torch.device("openreg", 3)
    assert reader.bytes("b") == b"\0\1"
    assert reader.text("t") == "ünï"
    assert reader.int("i", -10, 0) == -5
    assert reader.ints("shape") == (0, 2, 1 << 40)
    reader.end()


def test_every_dtype_in_the_list_round_trips_as_its_code():
    dtypes = [d for d in _wire._DTYPE_BY_CODE if d is not None]
    assert torch.bfloat16 in dtypes and torch.complex128 in dtypes and len(dtypes) >= 16
    assert _wire.dtypes_of(bytes(map(_wire.dtype_code, dtypes))) == dtypes
    assert _wire.dtype_code(torch.bool) == 0  # codes are fixed: the list only grows
    with pytest.raises(TypeError, match="cannot send"):
        _wire.dtype_code(torch.qint8)
    with pytest.raises(devipc.InvalidHandleError, match="unknown dtype code"):
        _wire.dtypes_of(bytes([1, len(_wire._DTYPE_BY_CODE)]))


def test_storage_handle_wrap_round_trips():
    wrapped = _wire.wrap_storage_handle(torch.device("openreg", 1), b"hooks handle")
    assert _wire.is_wrapped(wrapped) and not _wire.is_wrapped(b"ORIP...")
    assert _wire.unwrap_storage_handle(wrapped) == (torch.device("openreg", 1), b"hooks handle")


@pytest.mark.parametrize(
    "data, message",
    [
        ("not bytes", "is bytes"),
        (b"DVI", "truncated"),
        (_message(magic=b"PKL\x80"), "magic"),
        (_message(version=1), "version 1; this devipc reads version 6"),
        (_message(kind=99), "unknown kind 99"),
        (_message(kind=_wire.BUCKET), "expected a tensor handle, got a bucket handle"),
        (_message(), "missing"),
        (_message(body=b"\x01\x00"), "missing"),
        (_message(body=struct.pack("<I", 1000) + b"abc"), "claims 1000 bytes"),
        (_message(body=struct.pack("<I", 0xFFFFFFFF)), "claims 4294967295 bytes"),
    ],
)
def test_malformed_headers_and_lengths_are_refused(data, message):
    with pytest.raises(devipc.InvalidHandleError, match=message):
        _wire.Reader(data, (_wire.TENSOR,)).int("x")


def test_a_message_of_the_64_record_layout_says_to_use_the_same_devipc():
    """Version 3's publishers had 64 records: its tokens' record indices and relay cards mean
    other things than version 4's (1,024), so the two refuse each other's by version, not as
    damaged tokens."""
    with pytest.raises(devipc.InvalidHandleError, match="version 3; .* use the same devipc"):
        _wire.Reader(
            _message(kind=_wire.WEIGHTS, version=3), (_wire.WEIGHTS,), "WeightPublisher token"
        )


@pytest.mark.parametrize(
    "body, read, message",
    [
        (_field(b"\0" * 4), lambda r: r.int("n"), "8 bytes, not 4"),
        (_field(struct.pack("<q", -1)), lambda r: r.int("size"), "outside 0.."),
        (_field(struct.pack("<q", 2)), lambda r: r.flag("flag"), "outside 0..1"),
        (_field(struct.pack("<65q", *[1] * 65)), lambda r: r.ints("shape"), "at most 64"),
        (_field(b"\0" * 9), lambda r: r.ints("shape"), "not a list"),
        (_field(struct.pack("<2q", 3, -2)), lambda r: r.ints("stride"), "negative"),
        (_field(struct.pack("<2q", 1, 2)), lambda r: r.ints("offsets", 3, exact=True), "exactly 3"),
        (_field(b"\xff\xfe"), lambda r: r.text("name"), "not UTF-8"),
        (_field(b"open\xc3\xa9reg"), lambda r: r.device_type(), "short lowercase ASCII"),
        (_field(b"x" * 33), lambda r: r.device_type(), "at most 32"),
        (_field(b"Openreg"), lambda r: r.device_type(), "short lowercase ASCII"),
        (_field(b"zzz") + _field(struct.pack("<q", 0)), lambda r: r.device(), "unknown device"),
        (_field(b"openreg") + _field(struct.pack("<q", 128)), lambda r: r.device(), "0..127"),
        (_field(b"a" * 10), lambda r: r.bytes("handle", 4), "at most 4"),
        (_field(b"") + b"extra", lambda r: (r.bytes("b"), r.end()), "unexpected bytes"),
    ],
)
def test_malformed_fields_are_refused(body, read, message):
    with pytest.raises(devipc.InvalidHandleError, match=message):
        read(_wire.Reader(_message(body=body), (_wire.TENSOR,)))


def _real_handles():
    tensor = torch.arange(12, dtype=torch.float32, device="openreg").reshape(3, 4)
    bucket = devipc.share_tensors(
        [("a", tensor), ("b", torch.ones(2, dtype=torch.bool, device="openreg"))]
    )
    handles = [devipc.share(tensor[1:, ::2]), bucket]
    return tensor, handles


def test_handles_round_trip_through_bytes():
    tensor, handles = _real_handles()
    for handle in handles:
        again = Handle.from_bytes(bytes(handle))
        assert bytes(again) == bytes(handle)
        assert (again.kind, again.device, again.names, again.nbytes) == (
            handle.kind,
            handle.device,
            handle.names,
            handle.nbytes,
        )
        assert again.local is None and handle.revoke()
    del tensor, handles
    devipc.ipc_collect()


def _mutate(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(data)) if data else 0
        if op == 0 and data:  # flip a byte
            data[at] = rng.randrange(256)
        elif op == 1:  # truncate
            del data[at:]
        elif op == 2 and data:  # drop a span
            del data[at : at + rng.randint(1, 16)]
        elif op == 3:  # insert junk
            data[at:at] = rng.randbytes(rng.randint(1, 16))
        elif op == 4 and len(data) >= at + 4:  # forge a length or count
            data[at : at + 4] = struct.pack(
                "<I", rng.choice([0, 1, 7, 8, 64, 65, 1 << 31, 0xFFFFFFFF])
            )
        elif op == 5 and len(data) >= at + 8:  # forge an integer
            data[at : at + 8] = struct.pack(
                "<q", rng.choice([-1, 0, 1, 63, 64, 127, 128, 1 << 62, -(1 << 63)])
            )
    return bytes(data)


def test_random_mutations_raise_only_invalid_handle_errors():
    """Handle._decode has no catch-all: its explicit checks must cover every mutation."""
    tensor, handles = _real_handles()
    originals = [bytes(h) for h in handles]
    originals.append(_wire.wrap_storage_handle(tensor.device, handles[0]._shared.handle))
    rng = random.Random(20261130)
    decoded = refused = 0
    for i in range(3000):
        data = _mutate(originals[i % len(originals)], rng)
        try:
            if i % len(originals) == 2:
                _wire.unwrap_storage_handle(data)
            else:
                Handle._decode(data)
            decoded += 1
        except devipc.InvalidHandleError:
            refused += 1
    assert refused > 2000 and decoded + refused == 3000
    for handle in handles:
        handle.revoke()
    del tensor, handles
    devipc.ipc_collect()


def test_decoded_messages_are_kept_by_their_bytes_and_bounded():
    reads = []
    cache = _wire.Decoded(lambda data: reads.append(data) or len(data), limit=2)
    assert [cache.decode(b"a"), cache.decode(b"a"), cache.decode(b"bb")] == [1, 1, 2]
    assert reads == [b"a", b"bb"]  # the second b"a" came from the cache
    cache.decode(b"ccc")  # full: cleared, then kept
    assert len(cache) == 1 and cache.get(b"ccc") == 3
