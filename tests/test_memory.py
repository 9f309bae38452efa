import gc

import pytest
import torch

import devipc
from devipc._memory import storage_from_memory


def test_storage_owns_the_memory_until_it_dies():
    backing = torch.arange(8, dtype=torch.uint8, device="openreg")
    freed = []
    storage = storage_from_memory(backing.data_ptr() + 2, 4, backing.device,
                                  lambda: freed.append(True))
    assert storage.nbytes() == 4 and storage.device == backing.device
    view = torch.tensor([], dtype=torch.uint8, device="openreg").set_(storage)
    assert view.cpu().tolist() == [2, 3, 4, 5]
    with pytest.raises(RuntimeError):
        storage.resize_(8)  # memory we mapped cannot grow
    del storage
    assert freed == []  # the view still holds it
    del view
    gc.collect()
    assert freed == [True]


def test_a_failing_release_is_logged_not_raised(caplog):
    backing = torch.zeros(4, dtype=torch.uint8, device="openreg")

    def explode():
        raise OSError("unmap failed")

    storage = storage_from_memory(backing.data_ptr(), 4, backing.device, explode)
    del storage
    assert "releasing a received storage failed" in caplog.text


def test_devices_dlpack_cannot_express_are_refused():
    with pytest.raises(devipc.UnsupportedDeviceError, match="DLPack"):
        storage_from_memory(0, 4, torch.device("cuda", 0), lambda: None)
