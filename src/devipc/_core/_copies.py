"""Many tensor copies as one device operation, where the device's hooks can (`copy_batch`).

A weight sync copies thousands of tensors; one `Tensor.copy_` each costs a dispatch and a stream
operation each. The pairs that are plain byte copies (contiguous, same dtype and size, one side in
the device's memory) go to the hooks' `copy_batch` as one table of (destination, source, bytes)
(`copy_table`, the one maker of such tables); the others, and every pair on a device without the
hook, are copied one by one.
"""

import array
from collections.abc import Callable, Iterable

import torch

from ._hooks import hooks_for

__all__ = ["batch_copier", "copy_batched", "copy_pairs", "copy_table"]

_BATCH_MIN = 2  # below this, one copy_ is as cheap

Column = torch.Tensor | array.array  # int64 values; an array's typecode is "q"


def copy_table(destinations: Column, sources: Column, sizes: Column) -> torch.Tensor:
    """The table `copy_batch` takes, an (N, 3) int64 CPU tensor of rows (destination address,
    source address, bytes), made of its three columns (arrays are read in place, no tuple made
    per row)."""
    return torch.stack([_tensor_of(column) for column in (destinations, sources, sizes)], dim=1)


def _tensor_of(column: Column) -> torch.Tensor:
    if isinstance(column, torch.Tensor):
        return column
    if not column:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(column, dtype=torch.int64)


def batch_copier(device: torch.device) -> Callable[[int, torch.Tensor], None] | None:
    """The hooks' `copy_batch` of `device`, or None (the CPU, or hooks without it)."""
    return None if device.type == "cpu" else hooks_for(device).copy_batch


def copy_batched(
    device: torch.device, destinations: Column, sources: Column, sizes: Column
) -> bool:
    """Queue the byte copies of these columns (`copy_table`) on `device`'s current stream as one
    operation; False (nothing done) when its hooks have no `copy_batch` (the CPU has none)."""
    copy_batch = batch_copier(device)
    if copy_batch is None:
        return False
    if len(sizes):
        copy_batch(device.index or 0, copy_table(destinations, sources, sizes))
    return True


def copy_pairs(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`destination.copy_(source)` for each pair, the plain byte copies of one device batched."""
    destinations, sources, sizes = array.array("q"), array.array("q"), array.array("q")
    plain: list[tuple[torch.Tensor, torch.Tensor]] = []
    rest: list[tuple[torch.Tensor, torch.Tensor]] = []
    device = None
    for destination, source in pairs:
        if (
            destination.dtype is source.dtype
            and destination.shape == source.shape
            and destination.device == source.device
            and destination.device.type != "cpu"
            and destination.is_contiguous()
            and source.is_contiguous()
            and (device is None or destination.device == device)
        ):
            device = destination.device
            if destination.numel():
                destinations.append(destination.data_ptr())
                sources.append(source.data_ptr())
                sizes.append(destination.nbytes)
                plain.append((destination, source))
        else:
            rest.append((destination, source))
    if (
        device is None
        or len(sizes) < _BATCH_MIN
        or not copy_batched(device, destinations, sources, sizes)
    ):
        rest.extend(plain)
    with torch.no_grad():
        for destination, source in rest:
            destination.copy_(source)
