"""Many tensor copies as one device operation, where the device's hooks can (`copy_batch`).

A weight sync copies thousands of tensors; one `Tensor.copy_` each costs a dispatch and a stream
operation each. The pairs that are plain byte copies (contiguous, same dtype and size, one side in
the device's memory) go to the hooks' `copy_batch` as one table of (destination, source, bytes);
the others, and every pair on a device without the hook, are copied one by one.
"""
import array
from collections.abc import Callable, Iterable

import torch

from ._hooks import hooks_for

__all__ = ["copy_columns", "copy_pairs", "copy_rows"]

_BATCH_MIN = 2  # below this, one copy_ is as cheap


def copy_rows(device: torch.device, rows: list[tuple[int, int, int]]) -> bool:
    """Queue the byte copies `rows` (destination, source, bytes) on `device`'s current stream as
    one operation; False (nothing done) when its hooks have no `copy_batch` (the CPU has none)."""
    copy_batch = _copy_batch(device)
    if copy_batch is None:
        return False
    if rows:
        copy_batch(device.index or 0, torch.tensor(rows, dtype=torch.int64).view(-1, 3))
    return True


def copy_columns(device: torch.device, columns: array.array) -> bool:
    """`copy_rows` of rows given as one flat int64 array of columns: every destination, then
    every source, then every size (thousands of rows, no tuple made for each)."""
    copy_batch = _copy_batch(device)
    if copy_batch is None:
        return False
    if columns:
        copy_batch(device.index or 0,
                   torch.frombuffer(columns, dtype=torch.int64).view(3, -1).t().contiguous())
    return True


def _copy_batch(device: torch.device) -> Callable[[int, torch.Tensor], None] | None:
    """The hooks' `copy_batch` of `device`, or None (the CPU, or hooks without it)."""
    if device.type == "cpu":
        return None
    return getattr(hooks_for(device), "copy_batch", None)


def copy_pairs(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`destination.copy_(source)` for each pair, the plain byte copies of one device batched."""
    rows: list[tuple[int, int, int]] = []
    plain: list[tuple[torch.Tensor, torch.Tensor]] = []
    rest: list[tuple[torch.Tensor, torch.Tensor]] = []
    device = None
    for destination, source in pairs:
        if destination.dtype is source.dtype and destination.shape == source.shape \
                and destination.device == source.device and destination.device.type != "cpu" \
                and destination.is_contiguous() and source.is_contiguous() \
                and (device is None or destination.device == device):
            device = destination.device
            if destination.numel():
                rows.append((destination.data_ptr(), source.data_ptr(), destination.nbytes))
                plain.append((destination, source))
        else:
            rest.append((destination, source))
    if device is None or len(rows) < _BATCH_MIN or not copy_rows(device, rows):
        rest.extend(plain)
    with torch.no_grad():
        for destination, source in rest:
            destination.copy_(source)
