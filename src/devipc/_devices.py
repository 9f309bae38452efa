"""A torch.device's type and name, looked up: torch formats them anew at each access, through a
C++ string stream (a few thousand instructions), and a send and its open ask several times.
Imports no torch (see `_hooks`)."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@functools.cache
def type_of(device: torch.device) -> str:
    """`device.type`."""
    return device.type


@functools.cache
def name_of(device: torch.device) -> str:
    """`str(device)`."""
    return str(device)
