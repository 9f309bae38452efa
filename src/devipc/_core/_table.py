"""A bucket's table: the names, dtypes, shapes, strides and byte offsets of tensors that are views
of one storage, kept and sent as columns.

Columns, because a weight sync moves thousands of tensors: one wire field per column costs the
same for one entry or for 19,500, where fields per entry cost microseconds each to write, read
and check. A tensor handle is a table of one entry.
"""

import functools
from collections.abc import Iterable, Sequence
from itertools import accumulate, chain, repeat
from operator import floordiv, mod
from typing import cast

import torch

from . import _wire
from ._errors import InvalidHandleError

ALIGNMENT = 256  # bytes between the starts of a packed bucket's tensors
MAX_ENTRIES = 1 << 20
MAX_NAME = 1024  # bytes of UTF-8

_INT_MAX = _wire.INT_MAX


class Table:
    """Parallel columns, one row per tensor; `offsets` are in bytes from the storage's start."""

    __slots__ = ("names", "dtypes", "shapes", "strides", "offsets")

    def __init__(
        self,
        names: Iterable[str],
        dtypes: Iterable[torch.dtype],
        shapes: Iterable[tuple[int, ...]],
        strides: Iterable[tuple[int, ...]],
        offsets: Iterable[int],
    ):
        self.names, self.dtypes, self.shapes = list(names), list(dtypes), list(shapes)
        self.strides, self.offsets = list(strides), list(offsets)

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def where_they_lie(cls, items: Sequence[tuple[str, torch.Tensor]]) -> "Table":
        """The rows of (name, tensor) pairs as they lie in their storage (the caller checks
        that it is one storage)."""
        tensors = [tensor for _, tensor in items]
        return cls(
            [name for name, _ in items],
            [t.dtype for t in tensors],
            [tuple(t.shape) for t in tensors],
            [t.stride() for t in tensors],
            cast("list[int]", [t.storage_offset() * t.element_size() for t in tensors]),
        )

    @classmethod
    def packed(
        cls, items: Iterable[tuple[str, torch.Tensor]], aliases: bool = False
    ) -> tuple["Table", int]:
        """Where (name, tensor) pairs go when packed: contiguous, at offsets aligned to
        ALIGNMENT; with `aliases`, names of one same view share its bytes. And the end."""
        names: list[str] = []
        dtypes: list[torch.dtype] = []
        shapes: list[tuple[int, ...]] = []
        offsets: list[int] = []
        end = 0
        seen: dict[tuple, int] = {}
        for name, tensor in items:
            shape, dtype = tuple(tensor.shape), tensor.dtype
            nbytes = tensor.nbytes
            key = (tensor.data_ptr(), dtype, shape, tensor.stride()) if aliases and nbytes else None
            offset = seen.get(key, -1) if key is not None else -1
            if offset < 0:
                offset = -(-end // ALIGNMENT) * ALIGNMENT
                end = offset + nbytes
                if key is not None:
                    seen[key] = offset
            names.append(name)
            dtypes.append(dtype)
            shapes.append(shape)
            offsets.append(offset)
        return cls(names, dtypes, shapes, map(_contiguous, shapes), offsets), end

    def write(self, writer: _wire.Writer) -> None:
        """On the wire: count | name lengths | names | dtype codes | ndims | shapes | strides |
        offsets, where shapes (strides) holds every row's shape (stride), row after row."""
        names = [name.encode("utf-8") for name in self.names]
        if any(len(name) > MAX_NAME for name in names):
            raise ValueError(f"a bucket's names are at most {MAX_NAME} bytes of UTF-8")
        writer.int(len(names)).ints(list(map(len, names)))
        writer.bytes(b"".join(names), limit=len(names) * MAX_NAME)
        writer.bytes(bytes(map(_wire.dtype_code, self.dtypes)), limit=MAX_ENTRIES)
        writer.bytes(bytes(map(len, self.shapes)), limit=MAX_ENTRIES)
        writer.ints(list(chain.from_iterable(self.shapes)))
        writer.ints(list(chain.from_iterable(self.strides)))
        writer.ints(self.offsets)

    @classmethod
    def read(cls, reader: _wire.Reader, storage_bytes: int) -> "Table":
        """`write`'s table, every row checked to lie inside `storage_bytes`, names unique."""
        count = reader.int("tensor count", 0, MAX_ENTRIES)
        lengths = reader.ints("name lengths", count, exact=True)
        blob = reader.bytes("tensor names", count * MAX_NAME)
        if lengths and max(lengths) > MAX_NAME or sum(lengths) != len(blob):
            raise InvalidHandleError(
                f"name lengths {lengths[:8]}... do not cut {len(blob)} bytes "
                f"into names of at most {MAX_NAME} bytes"
            )
        names = _cut(blob, lengths)
        if len(set(names)) != count:
            raise InvalidHandleError("a bucket's tensor names must be unique")
        dtypes = _wire.dtypes_of(reader.bytes("dtype codes", count))
        ndims = reader.bytes("ndims", count)
        if len(dtypes) != count or len(ndims) != count or ndims and max(ndims) > _wire.MAX_NDIM:
            raise InvalidHandleError(
                f"a table of {count} rows needs {count} dtype codes and "
                f"{count} ndims of at most {_wire.MAX_NDIM}"
            )
        rows = list(map(slice, accumulate(ndims, initial=0), accumulate(ndims)))
        dims = sum(ndims)
        shapes = list(map(reader.ints("shapes", dims, exact=True).__getitem__, rows))
        strides = list(map(reader.ints("strides", dims, exact=True).__getitem__, rows))
        offsets = reader.ints("tensor offsets", count, exact=True)
        for name, dtype, shape, stride, offset in zip(names, dtypes, shapes, strides, offsets):
            _check_row(name, dtype.itemsize, shape, stride, offset, storage_bytes)
        return cls(names, dtypes, shapes, strides, offsets)

    def views(
        self, storage: torch.UntypedStorage, shift: int = 0, requires_grad: bool = False
    ) -> dict[str, torch.Tensor]:
        """The rows as tensors on `storage` (`shift` bytes added to every offset), by name: plain
        tensors with their own version counters, not views of a common base."""
        empties = {
            dtype: torch.empty(0, dtype=dtype, device=storage.device) for dtype in set(self.dtypes)
        }
        itemsizes = [dtype.itemsize for dtype in self.dtypes]
        starts = [shift + offset for offset in self.offsets]
        if any(map(mod, starts, itemsizes)):
            raise ValueError(
                f"shifted by {shift} bytes, a row would not start at a multiple of its item size"
            )
        fresh = map(torch.Tensor.new, map(empties.__getitem__, self.dtypes))
        views = dict(
            zip(
                self.names,
                map(
                    torch.Tensor.set_,
                    fresh,
                    repeat(storage),
                    map(floordiv, starts, itemsizes),
                    self.shapes,
                    self.strides,
                ),
            )
        )
        if requires_grad:
            for view in views.values():
                view.requires_grad_(True)
        return views


def _cut(blob: bytes, lengths: Sequence[int]) -> list[str]:
    """`blob` cut into names of `lengths` bytes."""
    cuts = list(map(slice, accumulate(lengths, initial=0), accumulate(lengths)))
    try:
        if blob.isascii():  # one decode, then cuts of the text
            return list(map(blob.decode("ascii").__getitem__, cuts))
        return [blob[cut].decode("utf-8") for cut in cuts]
    except UnicodeDecodeError:
        raise InvalidHandleError("a tensor name is not UTF-8 text") from None


@functools.lru_cache(maxsize=1024)
def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`, as torch gives them (sizes 0 count as 1)."""
    if not shape:
        return ()
    return tuple(accumulate(reversed(shape[1:]), lambda a, b: a * max(b, 1), initial=1))[::-1]


def _check_row(
    name: str,
    itemsize: int,
    shape: Sequence[int],
    stride: Sequence[int],
    offset: int,
    storage_bytes: int,
) -> None:
    """A forged row must not reach outside the storage it is a view of."""
    if offset % itemsize:
        raise InvalidHandleError(f"{name!r}: byte offset {offset} is not a multiple of {itemsize}")
    numel, last = 1, 0
    for size, step in zip(shape, stride):
        numel *= size or 1
        last += (size - 1) * step
    if numel > _INT_MAX:
        raise InvalidHandleError(f"{name!r}: shape {shape} is too large")
    end = offset if 0 in shape else offset + (last + 1) * itemsize
    if end > storage_bytes:
        raise InvalidHandleError(
            f"{name!r} ends at byte {end}, outside its storage of {storage_bytes}"
        )
