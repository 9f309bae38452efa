"""What the kit compares: a tensor it sent against a peer's report of what arrived, and the views
both sides make of one storage. A leaf: the checks and the peers' tasks use it."""

import torch

from ._verdicts import CheckFailed, expect


def compare(name: str, sent: torch.Tensor, got: dict) -> None:
    """`got` (a task's report of a received tensor) is `sent`, zero-copy, on the same device,
    viewed with the same stride and offset."""
    same_values(name, sent, got)
    for field, value in (("stride", sent.stride()), ("offset", sent.storage_offset())):
        expect(got[field] == value, f"{name}: {field} {got[field]}, sent {value}")


def same_values(name: str, sent: torch.Tensor, got: dict) -> None:
    """`got` holds `sent`'s values, dtype and shape, in memory received on the same device."""
    expect(got["received"], f"{name}: not in memory received through devipc (a copy?)")
    expect(
        got["device"] == str(sent.device),  # the peer sees the devices the kit sees
        f"{name}: arrived on {got['device']}, sent from {sent.device}",
    )
    for field, value in (("dtype", sent.dtype), ("shape", tuple(sent.shape))):
        expect(got[field] == value, f"{name}: {field} {got[field]}, sent {value}")
    expected = sent.detach().cpu()
    if not torch.equal(got["values"], expected):
        raise CheckFailed(
            f"{name}: values differ: sent {preview(expected)}, got {preview(got['values'])}"
        )


def preview(tensor: torch.Tensor) -> str:
    return str(tensor.flatten()[:6].tolist())


def views_of(base: torch.Tensor) -> dict[str, torch.Tensor]:
    grid = base.view(8, 8)
    return {
        "whole": base,
        "slice [5:20]": base[5:20],
        "transposed": grid.t(),
        "strided [::3]": base[::3],
        "block [2:, 1:5]": grid[2:, 1:5],
        "expanded": base[7:8].expand(4, 3),
    }
