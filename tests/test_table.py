"""A bucket's table as columns: round trips, packing layout, views, and forged tables refused as
InvalidHandleError before any view is made."""

import struct

import pytest
import torch

import devipc
from devipc._core import _wire
from devipc._core._handles import Handle
from devipc._core._table import ALIGNMENT, MAX_NAME, Table


def _round_trip(table: Table, storage_bytes: int) -> Table:
    writer = _wire.Writer(_wire.BUCKET)
    table.write(writer)
    reader = _wire.Reader(writer.done(), (_wire.BUCKET,))
    again = Table.read(reader, storage_bytes)
    reader.end()
    return again


def _columns(table: Table):
    return (
        table.names,
        table.dtypes,
        [tuple(s) for s in table.shapes],
        [tuple(s) for s in table.strides],
        table.offsets,
    )


def test_a_table_round_trips_with_every_kind_of_row():
    base = torch.zeros(64, dtype=torch.float64)
    items = [
        ("w", base[:12].view(3, 4)),
        ("t", base[:12].view(3, 4).t()),
        ("scalar", base[5]),
        ("empty", base[:0].view(0, 7)),
        ("é-ü", base.view(torch.bool)[3:9:2]),
        ("z", base[8:12].view(torch.complex64)),
    ]
    table = Table.where_they_lie(items)
    assert _columns(_round_trip(table, base.nbytes)) == _columns(table)
    assert table.offsets == [0, 0, 40, 0, 3, 64]


def test_a_table_larger_than_one_plain_field_round_trips():
    """19,500 rows, as in a 30B MoE sync: its columns pass 64 KiB each."""
    count = 19_500
    table = Table(
        [f"model.layers.{i}.mlp.experts.{i % 64}.w{i % 3}" for i in range(count)],
        [torch.bfloat16] * count,
        [(4, 2)] * count,
        [(2, 1)] * count,
        [16 * i for i in range(count)],
    )
    assert _columns(_round_trip(table, 16 * count)) == _columns(table)


def test_packing_aligns_every_row_and_strides_are_torch_contiguous():
    tensors = [
        torch.ones(3, 5),
        torch.ones(()),
        torch.ones(0, 4, 2),
        torch.ones(2, 0, 3),
        torch.ones(7, dtype=torch.bool),
        torch.ones(2, 2, dtype=torch.complex128).t(),
    ]
    items = [(str(i), t) for i, t in enumerate(tensors)]
    table, end = Table.packed(items)
    assert all(offset % ALIGNMENT == 0 for offset in table.offsets)
    assert table.strides == [t.contiguous().stride() for t in tensors]
    assert end == table.offsets[-1] + tensors[-1].nbytes
    tied, _ = Table.packed([("a", tensors[0]), ("b", tensors[0])], aliases=True)
    assert tied.offsets == [0, 0]


def test_views_are_plain_tensors_of_the_storage():
    storage = torch.arange(16, dtype=torch.float32).untyped_storage()
    table = Table(["a", "b"], [torch.float32, torch.int16], [(2, 2), (2,)], [(1, 2), (1,)], [8, 0])
    views = table.views(storage)
    assert views["a"].tolist() == [[2.0, 4.0], [3.0, 5.0]]
    assert all(v.untyped_storage().data_ptr() == storage.data_ptr() for v in views.values())
    assert all(v._base is None for v in views.values())
    versions = [v._version for v in views.values()]
    views["a"].add_(1)
    assert [v._version for v in views.values()] == [versions[0] + 1, versions[1]]  # their own
    with pytest.raises(ValueError, match="multiple of its item size"):
        table.views(storage, shift=2)


def _table_bytes(names, codes, ndims, shapes, strides, offsets, lengths=None) -> bytes:
    writer = _wire.Writer(_wire.BUCKET)
    encoded = [n.encode() for n in names]
    writer.int(len(names)).ints([len(n) for n in encoded] if lengths is None else lengths)
    writer.bytes(b"".join(encoded)).bytes(bytes(codes)).bytes(bytes(ndims))
    return writer.ints(shapes).ints(strides).ints(offsets).done()


F32 = _wire.dtype_code(torch.float32)


@pytest.mark.parametrize(
    "data, message",
    [
        (
            _table_bytes(["a"], [F32], [1], [17], [1], [0]),
            "ends at byte 68, outside its storage of 64",
        ),
        (_table_bytes(["a"], [F32], [2], [4, 5], [5, 1], [0]), "ends at byte 80, outside"),
        (_table_bytes(["a"], [F32], [1], [4], [1], [2]), "not a multiple of 4"),
        (_table_bytes(["a"], [F32], [2], [1 << 32, 1 << 32], [0, 0], [0]), "too large"),
        (_table_bytes(["a"], [F32], [3], [0, 1 << 32, 1 << 32], [0, 0, 0], [0]), "too large"),
        (_table_bytes(["a", "a"], [F32] * 2, [1, 1], [1, 1], [1, 1], [0, 0]), "unique"),
        (_table_bytes(["ab"], [F32], [1], [1], [1], [0], lengths=[3]), "do not cut"),
        (_table_bytes(["a"], [F32], [1], [1], [1], [0], lengths=[MAX_NAME + 1]), "do not cut"),
        (_table_bytes(["a"], [200], [1], [1], [1], [0]), "unknown dtype code"),
        (_table_bytes(["a"], [F32], [65], [1] * 65, [1] * 65, [0]), "ndims of at most 64"),
        (_table_bytes(["a"], [F32, F32], [1], [1], [1], [0]), "at most 1 allowed"),
        (_table_bytes(["a"], [], [1], [1], [1], [0]), "needs 1 dtype codes"),
        (_table_bytes(["a"], [F32], [2], [1, 1], [1], [0]), "exactly 2"),
        (_table_bytes(["a"], [F32], [1], [1], [1], [0, 0]), "exactly 1"),
        (_table_bytes(["a"], [F32], [1], [1], [-1], [0]), "negative"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_forged_tables_are_refused(data, message):
    reader = _wire.Reader(data, (_wire.BUCKET,))
    with pytest.raises(devipc.InvalidHandleError, match=message):
        Table.read(reader, 64)


def test_a_forged_name_is_refused():
    data = _table_bytes(["ab"], [F32], [1], [1], [1], [0]).replace(b"ab", b"\xff\xfe")
    with pytest.raises(devipc.InvalidHandleError, match="not UTF-8"):
        Table.read(_wire.Reader(data, (_wire.BUCKET,)), 64)


def test_a_handle_whose_row_reaches_outside_its_storage_is_refused():
    tensor = torch.ones(4, device="openreg")
    handle = devipc.share(tensor)
    try:
        data = bytes(handle)
        shape = struct.pack("<Iq", 8, 4)  # the shapes field: (4,), in the table, the last part
        at = data.rindex(shape)  # the storage part before it may hold a 4 too (a slot index)
        forged = data[:at] + struct.pack("<Iq", 8, 5) + data[at + len(shape) :]
        with pytest.raises(devipc.InvalidHandleError, match="outside its storage"):
            Handle.from_bytes(forged)
    finally:
        assert handle.revoke()
    del tensor
    devipc.ipc_collect()
