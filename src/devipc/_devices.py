"""Facts about devices: a torch.device's type and name, looked up (torch formats them anew at each
access, through a C++ string stream, a few thousand instructions, and a send and its open ask
several times); how many devices of a type this process sees, and whether it has a given one.
Imports no torch at import time (see `_hooks`)."""
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


def count_of(device_type: str) -> int:
    """How many `device_type` devices this process sees: 0 for a type torch has no module for
    here (a device another host has), or whose runtime refuses to start."""
    import torch

    try:
        return int(torch.get_device_module(device_type).device_count())
    except (AttributeError, RuntimeError):
        return 0


def present(device: torch.device) -> bool:
    """Whether this process can place tensors on `device` (no index: the type's current one).
    A device named by bytes from elsewhere (a token, a peer's message) numbers another
    process's devices, maybe another host's."""
    return (device.index or 0) < count_of(device.type)  # (torch's CPU counts 1)
