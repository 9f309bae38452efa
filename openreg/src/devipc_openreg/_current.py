"""Which openreg device and stream are current: what `torch.openreg`'s functions and its streams
and events resolve a `device` argument against."""

import torch

from . import _runtime

PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)  # type: ignore[call-overload]


def index_of(device: torch.device | str | int | None) -> int:
    """Index of an openreg device given as None (current), int, str or torch.device."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "openreg":
        raise ValueError(f"expected an openreg device, got {device}")
    return current_device() if device.index is None else device.index


def current_device() -> int:
    return _runtime.current_device()


def set_device(device: torch.device | str | int | None) -> None:
    _runtime.set_device(index_of(device))


def current_stream(device: torch.device | str | int | None = None) -> torch.Stream:
    """This thread's current stream of `device`."""
    index = index_of(device)
    stream_id = _runtime.current_stream_id(index)
    return torch.Stream(stream_id=stream_id, device_index=index, device_type=PRIVATEUSE1)
