"""Facts about devices: a torch.device's type and name, looked up (torch formats them anew at each
access, through a C++ string stream, a few thousand instructions, and a send and its open ask
several times); how many devices of a type this process sees, and whether it has a given one; and
a device's streams: its current one, and waiting for all its work. The one place devipc asks torch
about a device's streams. Imports no torch at import time (see `_hooks`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
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


def current_stream(device: torch.device) -> torch.Stream:
    """This thread's current stream of `device`: for the accelerator, one call into torch's C++
    (torch.accelerator.current_stream checks its argument in Python first: ~2.5 us a call here,
    against 0.15 us), else through the device's module."""
    import torch

    if device.index is not None and type_of(device) == _accelerator_type():
        return torch._C._accelerator_getStream(device.index)
    return torch.get_device_module(device).current_stream(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on every stream of `device` (as `current_stream`)."""
    import torch

    if device.index is not None and type_of(device) == _accelerator_type():
        torch._C._accelerator_synchronizeDevice(device.index)
    else:
        torch.get_device_module(device).synchronize(device)


def accelerator_streams() -> Callable[[int], torch.Stream]:
    """The accelerator's current stream of a device index (`accelerator_index`): torch's C++
    call itself, for loops where even `current_stream`'s Python is most of the cost."""
    import torch

    return torch._C._accelerator_getStream


@functools.lru_cache(maxsize=64)
def accelerator_index(device: torch.device) -> int | None:
    """`device`'s index for `accelerator_streams`; None if it is not the accelerator's (its
    streams are not known there)."""
    return device.index if type_of(device) == _accelerator_type() else None


def _accelerator_type() -> str | None:
    """torch.accelerator's device type. A registered PrivateUse1 backend is the accelerator
    for good (torch prefers it, and one stays registered): that answer is kept."""
    import torch

    global _final_accelerator
    if _final_accelerator is not None:
        return _final_accelerator
    accelerator = torch._C._accelerator_getAccelerator()
    if accelerator is None:
        return None
    if accelerator.type == torch._C._get_privateuse1_backend_name():
        _final_accelerator = accelerator.type
    return accelerator.type


_final_accelerator: str | None = None
