"""DLPack for openreg tensors: `torch.from_dlpack(t)` and `t.__dlpack_device__()`.

torch's C++ DLPack code maps PrivateUse1 to DLPack's extension device type (kDLExtDev) both ways,
zero-copy. But `Tensor.__dlpack_device__` (torch 2.13-2.15) finds PrivateUse1 by the name
"privateuse1", which a backend renamed to "openreg" no longer has, and raises "Unknown device type
openreg for Dlpack"; `torch.from_dlpack` asks it first. Every renamed PrivateUse1 backend meets
this, so openreg wraps that one method: a PrivateUse1 tensor answers (kDLExtDev, its index), every
other tensor goes to torch's own. Only frameworks that know kDLExtDev as this device can take such
a capsule: torch does; NumPy and CuPy refuse it (move the tensor to the CPU for them).
"""

import torch
from torch.utils.dlpack import DLDeviceType

_torchs_own = torch.Tensor.__dlpack_device__


def _dlpack_device(self: torch.Tensor) -> tuple:
    device = self.device
    if (
        device.type == torch._C._get_privateuse1_backend_name()
        and device.type != "privateuse1"
        and not torch.overrides.has_torch_function_unary(self)
    ):
        return (DLDeviceType.kDLExtDev, device.index or 0)
    return _torchs_own(self)


def register() -> None:
    """Idempotent. Where a later torch's own method knows renamed backends, it gives the same
    answer, so the wrapper is harmless there."""
    if torch.Tensor.__dlpack_device__ is _torchs_own:
        torch.Tensor.__dlpack_device__ = _dlpack_device  # type: ignore[method-assign]
