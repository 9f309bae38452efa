"""DLPack on openreg: zero-copy between torch tensors, a clear refusal elsewhere."""

import numpy as np
import pytest
import torch
from torch.utils.dlpack import DLDeviceType


def test_an_openreg_tensor_crosses_dlpack_zero_copy_as_the_extension_device():
    tensor = torch.arange(6.0, device="openreg:1").reshape(2, 3)
    assert tensor.__dlpack_device__() == (DLDeviceType.kDLExtDev, 1)
    for opened in (torch.from_dlpack(tensor), torch.utils.dlpack.from_dlpack(tensor.__dlpack__())):
        assert opened.device == tensor.device and opened.data_ptr() == tensor.data_ptr()
        assert opened.shape == tensor.shape and opened.stride() == tensor.stride()
    torch.from_dlpack(tensor).add_(1)  # the same memory
    assert tensor.cpu().tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]


def test_other_devices_keep_torchs_own_answer():
    assert torch.ones(2).__dlpack_device__() == (DLDeviceType.kDLCPU, 0)
    assert torch.from_dlpack(np.arange(3.0)).tolist() == [0.0, 1.0, 2.0]


def test_a_framework_that_does_not_know_the_extension_device_refuses():
    with pytest.raises(RuntimeError, match="Unsupported device"):
        np.from_dlpack(torch.ones(2, device="openreg"))
