"""orMemcpyBatchAsync through the package's binding (`_runtime.memcpy_batch_async`): many copies
as one stream operation, ordered with the stream's other work, checked before anything runs."""

import ctypes

import _native as native
import pytest
import torch

from devipc_openreg import _runtime as rt


@pytest.fixture
def stream():
    s = native.stream_create(0)
    yield s
    native.stream_destroy(s)


def _table(rows):
    return torch.tensor(rows, dtype=torch.int64).view(-1, 3)


def test_a_batch_copies_every_range_both_ways(stream):
    n = 1000
    data = bytes(range(256)) * 16  # 4 KiB
    src = ctypes.create_string_buffer(data, 4096)
    dev = native.malloc(4 * n, 0)
    out = ctypes.create_string_buffer(4 * n)
    generator = torch.Generator().manual_seed(1)
    offsets = torch.randint(0, 4093, (n,), generator=generator).tolist()
    host = ctypes.addressof(src)
    # host -> device: 4 bytes each, from random offsets; then device -> host, all in one stream
    rt.memcpy_batch_async(
        _table([(dev + 4 * i, host + o, 4) for i, o in enumerate(offsets)]), stream
    )
    rt.memcpy_batch_async(
        _table([(ctypes.addressof(out) + 4 * i, dev + 4 * i, 4) for i in range(n)]), stream
    )
    native.stream_synchronize(stream)
    assert out.raw == b"".join(data[o : o + 4] for o in offsets)
    rt.memcpy_batch_async(_table([]), stream)  # nothing to do
    native.free(dev)


def test_a_batch_is_one_operation_ordered_on_its_stream(stream, gate):
    dev = native.malloc(16, 0)
    zero, one, two = (ctypes.c_uint64(v) for v in (0, 1, 2))
    native.memcpy(dev, ctypes.addressof(zero), 8, native.HOST_TO_DEVICE)
    out = ctypes.c_uint64(7)
    gate.hold(stream)
    # the batch writes 1 then 2 to the same address (its order), then copies it out
    rt.memcpy_batch_async(
        _table(
            [
                (dev, ctypes.addressof(one), 8),
                (dev, ctypes.addressof(two), 8),
                (ctypes.addressof(out), dev, 8),
            ]
        ),
        stream,
    )
    assert not native.stream_query(stream)
    assert out.value == 7  # held behind the gate
    gate.open()
    native.stream_synchronize(stream)
    assert out.value == 2
    native.free(dev)


def test_bad_addresses_are_refused_and_nothing_runs(stream):
    dev = native.malloc(64, 0)
    try:
        _refused(stream, dev)
    finally:
        native.free(dev)


def _refused(stream, dev):
    _, base, size, _ = native.pointer_attributes(dev)
    end = base + size  # of dev's segment: the runtime knows segments, not blocks
    a, b = ctypes.create_string_buffer(b"x" * 64), ctypes.create_string_buffer(64)
    good = (dev, ctypes.addressof(a), 64)
    with pytest.raises(rt.OpenRegError, match="copy 1: neither destination .* nor source"):
        rt.memcpy_batch_async(_table([good, (ctypes.addressof(b), ctypes.addressof(a), 8)]), stream)
    with pytest.raises(rt.OpenRegError, match="copy 1: source .* runs past"):
        rt.memcpy_batch_async(_table([good, (ctypes.addressof(b), end - 32, 64)]), stream)
    with pytest.raises(rt.OpenRegError, match="copy 1: destination .* runs past"):
        rt.memcpy_batch_async(_table([good, (end - 1, ctypes.addressof(a), 2)]), stream)
    with pytest.raises(rt.OpenRegError, match="copy 0: NULL pointer"):
        rt.memcpy_batch_async(_table([(0, dev, 8)]), stream)
    native.stream_synchronize(stream)
    out = ctypes.create_string_buffer(64)
    native.memcpy(ctypes.addressof(out), dev, 64, native.DEVICE_TO_HOST)
    assert out.raw != a.raw  # the good copy of a refused batch never ran
    err = rt.lib.orMemcpyBatchAsync(None, None, None, 3, stream)
    assert err == native.INVALID_VALUE and b"NULL array" in rt.lib.orGetLastErrorMessage()
