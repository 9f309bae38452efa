import gc

import pytest
import torch

import devipc
from devipc._memory import reap_freed, storage_from_memory, watched


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
    reap_freed()
    assert freed == []  # the view still holds it
    del view
    gc.collect()
    assert freed == []  # seen at the next reap, not in the deleter
    assert reap_freed() == 1 and freed == [True]
    assert reap_freed() == 0 and freed == [True]  # once


def test_a_bounded_reap_looks_at_the_newest_storages_only():
    """A hot path's look (an open, a send) costs the same however many storages a process
    holds: it sees the newest deaths; a full reap (the collector's) sees every one."""
    backing = torch.zeros(64, dtype=torch.uint8, device="openreg")
    reap_freed()
    freed: list[int] = []
    storages = [storage_from_memory(backing.data_ptr() + i, 1, backing.device,
                                    lambda i=i: freed.append(i)) for i in range(40)]
    del storages[0], storages[-1]  # the oldest and the newest die
    assert reap_freed(newest=8) == 1 and freed == [39]
    assert reap_freed(newest=8) == 0  # the oldest is not among the 8 newest
    assert reap_freed() == 1 and freed == [39, 0]
    del storages
    assert reap_freed() == 38


def test_a_storage_dying_while_an_exception_unwinds_keeps_the_exception():
    """The deleter runs no Python: CPython cannot call it while an exception is set (a ctypes
    callback there turned the user's exception into a SystemError, or crashed)."""
    backing = torch.zeros(4, dtype=torch.uint8, device="openreg")
    freed = []

    def fail():
        for _ in (storage_from_memory(backing.data_ptr(), 4, backing.device,
                                      lambda: freed.append(True)),):
            raise KeyError("the user's own error")  # the storage dies on the way out

    before = watched()
    for _ in range(20):
        with pytest.raises(KeyError, match="the user's own error"):
            fail()
    assert reap_freed() >= 20 and freed == [True] * 20 and watched() == before


def test_a_failing_release_is_logged_not_raised(caplog):
    backing = torch.zeros(4, dtype=torch.uint8, device="openreg")

    def explode():
        raise OSError("unmap failed")

    storage = storage_from_memory(backing.data_ptr(), 4, backing.device, explode)
    del storage
    reap_freed()
    assert "releasing a storage's memory failed" in caplog.text


def test_devices_dlpack_cannot_express_are_refused():
    with pytest.raises(devipc.UnsupportedDeviceError, match="DLPack"):
        storage_from_memory(0, 4, torch.device("cuda", 0), lambda: None)
