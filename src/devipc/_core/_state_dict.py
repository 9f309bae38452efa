"""A model's state_dict in one send: the common case of a weight sync, on top of buckets.

Tied weights (two names of one tensor, e.g. embeddings shared with the output layer) are packed
once and stay tied in the consumer. Everything in the dict must be a tensor on one device that
can share: a state_dict with `_extra_state` objects is for the caller to split.
"""

from collections.abc import Mapping

import torch

from ._handles import Handle, open_tensors, pack_and_share

__all__ = ["open_state_dict", "share_state_dict"]


def share_state_dict(state_dict: Mapping[str, torch.Tensor], copy: bool = True) -> Handle:
    """One send of a state_dict (any mapping of names to tensors) as one bucket: packed into a
    new allocation, or with `copy=False` shared where it lies (weights kept in `devipc.pack`)."""
    if not hasattr(state_dict, "items"):
        raise TypeError(
            f"a state_dict is a mapping of names to tensors, not {type(state_dict).__name__}"
        )
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"state_dict[{name!r}] is a {type(value).__name__}, not a tensor: "
                f"send what is not a tensor separately"
            )
    return pack_and_share(list(state_dict.items()), aliases=True, copy=copy)


def open_state_dict(
    handle: Handle | bytes | bytearray | memoryview, device: torch.device | str | int | None = None
) -> dict[str, torch.Tensor]:
    """The state_dict of a `share_state_dict` handle (or its bytes), in its order, zero-copy:
    `model.load_state_dict(...)` copies from it, or `assign=True` keeps the shared memory."""
    return open_tensors(handle, device)
