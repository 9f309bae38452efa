"""How a sharded trainer's weights lie over its ranks, and which rank holds which part of a
slice an engine asks for.

A parameter's layout is the vocabulary of torch's DTensor and of vLLM's `ParamMeta`: its full
shape, a mesh of ranks (`owners`, row-major over `mesh_shape`) and one placement per mesh axis,
Replicate or Shard(dim). A Shard splits its dim as `torch.chunk` does (pieces of ceil(n / k), the
last ones shorter or empty: uneven shards), one axis after the other, so each rank holds one box
of the full tensor. What an engine asks for is a box too (a range of one dim); `plan` says, once,
from which rank and where in its local shard each part of it comes.
"""

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = [
    "REPLICATE",
    "Layout",
    "ParamLayout",
    "Piece",
    "byte_runs",
    "layout_of",
    "plan",
    "tp_slices",
    "world_of",
]

REPLICATE = -1  # a placement code: the mesh axis replicates; a code d >= 0 shards dim d

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim of the full tensor


def _code(placement: Any) -> int:
    """A placement as its code: torch's Replicate() / Shard(dim) (by their names, with no import
    of torch.distributed), or vLLM's int codes (-1 replicate, d >= 0 shard dim d)."""
    if isinstance(placement, int) and not isinstance(placement, bool):
        if placement < REPLICATE:
            raise ValueError(f"a placement code is -1 (replicate) or a dim >= 0, not {placement}")
        return placement
    kind = type(placement).__name__
    if kind == "Replicate":
        return REPLICATE
    if kind == "Shard" and isinstance(getattr(placement, "dim", None), int):
        return placement.dim
    raise ValueError(
        f"a placement is Replicate(), Shard(dim) or an int code (-1 replicate, "
        f"d >= 0 shard dim d), not {placement!r} (Partial and strided shards are "
        f"not published: reduce or redistribute them first)"
    )


def _chunk(start: int, stop: int, pieces: int, index: int) -> tuple[int, int]:
    """Piece `index` of [start, stop) split in `pieces` as torch.chunk splits it."""
    size = -(-(stop - start) // pieces) if stop > start else 0
    low = min(start + index * size, stop)
    return low, min(low + size, stop)


@dataclass(frozen=True)
class ParamLayout:
    """One parameter over the trainer's ranks: `shape` (the full tensor's), `mesh_shape`,
    `placements` (one per mesh axis: Replicate() / Shard(d) or vLLM's codes; None or () for a
    tensor every owner holds whole) and `owners` (the rank at each mesh coordinate, row-major;
    None: ranks 0, 1, ... in order)."""

    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...] = (1,)
    placements: tuple[int, ...] = ()
    owners: tuple[int, ...] = ()

    def __init__(
        self,
        shape: Iterable[int],
        mesh_shape: Iterable[int] = (1,),
        placements: Iterable[Any] | None = None,
        owners: Iterable[int] | None = None,
    ):
        shape, mesh = tuple(map(int, shape)), tuple(map(int, mesh_shape))
        codes = tuple(map(_code, placements or ())) or (REPLICATE,) * len(mesh)
        ranks = tuple(range(math.prod(mesh))) if owners is None else tuple(map(int, owners))
        if any(size < 0 for size in shape) or not mesh or any(size < 1 for size in mesh):
            raise ValueError(
                f"a shape of sizes >= 0 and a mesh shape of sizes >= 1, not {shape} over {mesh}"
            )
        if len(codes) != len(mesh):
            raise ValueError(
                f"{len(codes)} placements for a mesh of {len(mesh)} axes {mesh}: one per axis"
            )
        if any(code >= len(shape) for code in codes):
            raise ValueError(f"placements {codes} shard a dim a tensor of shape {shape} lacks")
        if len(ranks) != math.prod(mesh) or len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(
                f"owners {ranks}: {math.prod(mesh)} distinct ranks >= 0, one per "
                f"coordinate of mesh {mesh}"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "mesh_shape", mesh)
        object.__setattr__(self, "placements", codes)
        object.__setattr__(self, "owners", ranks)

    def box(self, rank: int) -> Box | None:
        """The part of the full tensor `rank` holds (None: it is no owner)."""
        if rank not in self.owners:
            return None
        flat, coordinate = self.owners.index(rank), []
        for size in reversed(self.mesh_shape):
            flat, at = divmod(flat, size)
            coordinate.append(at)
        box = [(0, size) for size in self.shape]
        for code, pieces, index in zip(self.placements, self.mesh_shape, reversed(coordinate)):
            if code != REPLICATE:
                box[code] = _chunk(*box[code], pieces, index)
        return tuple(box)

    def to_json(self) -> list[list[int]]:
        """The layout as plain lists (shape, mesh shape, placement codes, owners), for a JSON
        message; `ParamLayout(*those)` makes it again."""
        return [list(self.shape), list(self.mesh_shape), list(self.placements), list(self.owners)]

    def local_shape(self, rank: int) -> tuple[int, ...] | None:
        """The shape of `rank`'s local shard (None: it is no owner)."""
        box = self.box(rank)
        return None if box is None else tuple(stop - start for start, stop in box)


Layout = Mapping[str, ParamLayout]


def layout_of(weights: Mapping[str, torch.Tensor]) -> dict[str, ParamLayout]:
    """The layout of a state dict of DTensors (FSDP2's `fully_shard`, `distribute_tensor`):
    each one's global shape, device mesh and placements. A plain tensor is held whole by every
    rank of the first DTensor's mesh."""
    meshes: list[Any] = [getattr(tensor, "device_mesh", None) for tensor in weights.values()]
    first = next((mesh for mesh in meshes if mesh is not None), None)
    if first is None:
        raise ValueError("no DTensor among the weights: describe their layout with ParamLayout")
    layout = {}
    for (name, tensor), mesh in zip(weights.items(), meshes):
        grid = (first if mesh is None else mesh).mesh
        layout[name] = ParamLayout(
            tensor.shape, grid.shape, getattr(tensor, "placements", None), grid.flatten().tolist()
        )
    return layout


def world_of(layout: Layout) -> int:
    """How many trainer ranks publish: one past the highest owner."""
    return 1 + max(max(param.owners) for param in layout.values())


# What an engine asks of a parameter: None for all of it, or (dim, start, stop).
Slice = tuple[int, int, int] | None


def tp_slices(
    layout: Layout,
    rank: int,
    size: int,
    dims: Mapping[str, int | None] | Callable[[str], int | None],
) -> dict[str, Slice]:
    """What tensor-parallel engine `rank` of `size` serves of each parameter: its piece of dim
    `dims[name]` split as torch.chunk splits it (vLLM's even split where `size` divides the
    dim), or all of it where the dim is None (replicated in the engine)."""
    if not 0 <= rank < size:
        raise ValueError(f"a tensor-parallel rank in [0, {size}), not {rank}")
    dim_of = dims.get if isinstance(dims, Mapping) else dims
    slices: dict[str, Slice] = {}
    for name, param in layout.items():
        dim = dim_of(name)
        slices[name] = None if dim is None else (dim, *_chunk(0, param.shape[dim], size, rank))
    return slices


class Piece(NamedTuple):
    """Part of an engine's slice: from trainer rank `rank`, its local shard's `source` box
    (relative to the shard), landing at `target` (relative to the slice)."""

    rank: int
    source: tuple[slice, ...]
    target: tuple[slice, ...]


def plan(
    layout: Layout, slices: Mapping[str, Slice]
) -> dict[str, tuple[tuple[int, ...], list[Piece]]]:
    """For each parameter asked for: the slice's shape and the pieces that make it, one from
    each distinct shard it overlaps (of replicas, the lowest rank's). Computed once per engine."""
    unknown = sorted(set(slices) - set(layout))
    if unknown:
        raise KeyError(f"the trainer publishes no parameters named {unknown[:5]}")
    out = {}
    for name, asked in slices.items():
        param = layout[name]
        want = [(0, size) for size in param.shape]
        if asked is not None:
            dim, start, stop = asked
            if not (0 <= dim < len(param.shape) and 0 <= start <= stop <= param.shape[dim]):
                raise ValueError(
                    f"{name!r}: slice {asked} (dim, start, stop) is outside its shape {param.shape}"
                )
            want[dim] = (start, stop)
        shards: dict[Box, int] = {}
        for rank in sorted(param.owners):
            box = param.box(rank)
            assert box is not None
            shards.setdefault(box, rank)
        pieces = []
        for box, rank in shards.items():
            overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, want)]
            if all(low < high for low, high in overlap):
                pieces.append(Piece(rank, _relative(overlap, box), _relative(overlap, want)))
        out[name] = (tuple(high - low for low, high in want), pieces)
    return out


def _relative(
    box: Sequence[tuple[int, int]],
    origin: Sequence[tuple[int, int]],
) -> tuple[slice, ...]:
    return tuple(slice(low - base, high - base) for (low, high), (base, _) in zip(box, origin))


def byte_runs(
    offset: int, shape: Sequence[int], strides: Sequence[int], itemsize: int, box: Sequence[slice]
) -> list[tuple[int, int]]:
    """The contiguous byte runs (start, length) that hold `box` of a tensor lying at byte
    `offset` of its buffer: what an engine pulls of it across hosts. A tensor that is not
    row-major contiguous is pulled whole."""
    ranges = [(part.start, part.stop) for part in box]
    if any(start >= stop for start, stop in ranges):
        return []
    expected, step = [], 1
    for size in reversed(shape):
        expected.append(step)
        step *= size
    if tuple(strides) != tuple(reversed(expected)):
        return [(offset, step * itemsize)] if step else []
    if not ranges:  # a scalar
        return [(offset, itemsize)]
    # the dims after `last` are whole: one run per index of the dims before it
    last = max(
        (dim for dim, (start, stop) in enumerate(ranges) if (start, stop) != (0, shape[dim])),
        default=0,
    )
    length = (ranges[last][1] - ranges[last][0]) * math.prod(shape[last + 1 :]) * itemsize
    runs: list[tuple[int, int]] = []
    outer = [range(start, stop) for start, stop in ranges[:last]]
    for index in itertools.product(*outer):
        element = (
            sum(i * stride for i, stride in zip(index, strides)) + ranges[last][0] * strides[last]
        )
        start = offset + element * itemsize
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + length)
        else:
            runs.append((start, length))
    return runs
