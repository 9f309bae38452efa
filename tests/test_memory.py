import ctypes
import gc
import os
import signal
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from _support import TIMEOUT

import devipc
from devipc._core import _memory
from devipc._core._memory import reap_freed, tensor_from_memory, watched


def test_storage_owns_the_memory_until_it_dies():
    backing = torch.arange(8, dtype=torch.uint8, device="openreg")
    freed = []
    storage = tensor_from_memory(
        backing.data_ptr() + 2, 4, backing.device, lambda: freed.append(True)
    ).untyped_storage()
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


@pytest.mark.parametrize(
    "dtype, shape",
    [
        (torch.float32, (2, 3)),
        (torch.bfloat16, (12,)),
        (torch.bool, (3, 2, 4)),
        (torch.complex64, (3,)),
        (torch.int64, (1, 1, 3)),
        (torch.uint16, (4, 3)),
    ],
)
def test_a_tensor_of_any_dlpack_dtype_and_contiguous_shape_is_made_in_one_call(dtype, shape):
    """What an open makes when a whole storage is sent: that tensor, no empty().set_()."""
    source = (torch.arange(24) % 5).to(dtype).to("openreg")
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    freed = []
    tensor = tensor_from_memory(
        source.data_ptr(), nbytes, source.device, lambda: freed.append(True), dtype, shape
    )
    assert (tensor.dtype, tuple(tensor.shape), tensor.device) == (dtype, shape, source.device)
    assert tensor.is_contiguous() and tensor.data_ptr() == source.data_ptr()
    assert tensor.untyped_storage().nbytes() == nbytes
    assert torch.equal(tensor.cpu(), source.cpu()[: tensor.numel()].reshape(shape))
    del tensor
    assert reap_freed() == 1 and freed == [True]


def test_the_struct_of_a_dead_tensor_is_reused_and_a_live_one_never():
    from devipc._core import _memory

    backing = torch.arange(16, dtype=torch.uint8, device="openreg")
    reap_freed()
    first = tensor_from_memory(backing.data_ptr(), 4, backing.device, lambda: None)
    second = tensor_from_memory(backing.data_ptr() + 4, 4, backing.device, lambda: None)
    del first
    reap_freed()
    third = tensor_from_memory(backing.data_ptr() + 8, 4, backing.device, lambda: None)
    # the struct `first` had now serves `third`; `second`'s still says that it lives
    assert third.cpu().tolist() == [8, 9, 10, 11] and second.cpu().tolist() == [4, 5, 6, 7]
    assert reap_freed() == 0
    del second, third
    assert reap_freed() == 2
    assert len(_memory._recycled[("openreg", 0)]) >= 2


def test_a_reused_struct_is_a_new_entry_that_a_stale_look_cannot_take():
    """A reap that listed the storages before a struct was reused (the collector, paused by a
    thread switch) must not take the new tensor's entry for the dead one's: entries are not
    keyed by the struct's address."""
    from devipc._core import _memory

    backing = torch.arange(16, dtype=torch.uint8, device="openreg")
    reap_freed()
    freed: list[int] = []
    first = tensor_from_memory(backing.data_ptr(), 4, backing.device, lambda: freed.append(1))
    stale = list(_memory._live.items())  # what a paused reap holds
    number, entry = stale[-1]
    del first
    assert reap_freed() == 1 and freed == [1]
    second = tensor_from_memory(backing.data_ptr() + 4, 4, backing.device, lambda: freed.append(2))
    again, reused = next(reversed(_memory._live.items()))
    assert reused[0] == entry[0] and again != number  # the same struct, a new entry
    del second
    # the stale look sees a dead word at that address, but its entry is gone: nothing to take
    assert entry[1][0] != _memory._LIVE and _memory._live.pop(number, None) is None
    assert reap_freed() == 1 and freed == [1, 2]


def test_a_struct_torch_refused_goes_back_for_the_next_tensor(monkeypatch):
    from devipc._core import _memory

    backing = torch.arange(8, dtype=torch.uint8, device="openreg")
    reap_freed()
    kept = list(_memory._recycled.get(("openreg", 0), []))

    def refuse(capsule):
        raise RuntimeError("refused")

    monkeypatch.setattr(torch._C, "_from_dlpack", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        tensor_from_memory(backing.data_ptr(), 4, backing.device, lambda: None)
    monkeypatch.undo()
    assert len(_memory._recycled[("openreg", 0)]) == len(kept) + (0 if kept else 1)


def test_a_bounded_reap_looks_at_the_newest_storages_only():
    """A hot path's look (an open, a send) costs the same however many storages a process
    holds: it sees the newest deaths; a full reap (the collector's) sees every one."""
    backing = torch.zeros(64, dtype=torch.uint8, device="openreg")
    reap_freed()
    freed: list[int] = []
    storages = [
        tensor_from_memory(
            backing.data_ptr() + i, 1, backing.device, lambda i=i: freed.append(i)
        ).untyped_storage()
        for i in range(40)
    ]
    del storages[0], storages[-1]  # the oldest and the newest die
    assert reap_freed(newest=8) == 1 and freed == [39]
    assert reap_freed(newest=8) == 0  # the oldest is not among the 8 newest
    assert reap_freed() == 1 and freed == [39, 0]
    del storages
    assert reap_freed() == 38


class _ChangedWhileListed(dict):
    """A storage made by another thread while a reap lists the live ones (building the list
    allocates, a collection runs finalizers, another thread takes the GIL): the dict changes
    under the reap's iteration, once."""

    def items(self):
        view = super().items()
        if -4 in self:  # changed once already
            return view
        owner = self

        class Changing:
            def _change_then(self, iterator):
                for count, item in enumerate(iterator):
                    if count == 1:
                        owner[-4] = owner[-2]  # -> "dictionary changed size during iteration"
                    yield item

            def __iter__(self):
                return self._change_then(iter(view))

            def __reversed__(self):
                return self._change_then(reversed(view))

        return Changing()


@pytest.mark.parametrize("newest", [None, 8], ids=["full", "bounded"])
def test_a_reap_survives_storages_made_while_it_lists_them(monkeypatch, newest):
    freed: list[int] = []
    dead = (0, (_memory._LIVE + 1,), lambda: freed.append(1), None)  # its first word: died
    live = (0, (_memory._LIVE,), lambda: freed.append(2), None)
    monkeypatch.setattr(_memory, "_live", _ChangedWhileListed({-2: live, -1: dead, -3: live}))
    assert reap_freed(newest) == 1 and freed == [1]
    assert -1 not in _memory._live and -2 in _memory._live


def test_a_storage_dying_while_an_exception_unwinds_keeps_the_exception():
    """The deleter runs no Python: CPython cannot call it while an exception is set (a ctypes
    callback there turned the user's exception into a SystemError, or crashed)."""
    backing = torch.zeros(4, dtype=torch.uint8, device="openreg")
    freed = []

    def fail():
        for _ in (
            tensor_from_memory(
                backing.data_ptr(), 4, backing.device, lambda: freed.append(True)
            ).untyped_storage(),
        ):
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

    storage = tensor_from_memory(backing.data_ptr(), 4, backing.device, explode).untyped_storage()
    del storage
    reap_freed()
    assert "releasing a storage's memory failed" in caplog.text


def test_devices_dlpack_cannot_express_are_refused():
    with pytest.raises(devipc.UnsupportedDeviceError, match="DLPack"):
        tensor_from_memory(0, 4, torch.device("cuda", 0), lambda: None).untyped_storage()


def _in_a_fork(child) -> int:
    """Fork; the child runs `child()` (no openreg call there, no pytest), and leaves by os._exit:
    0 if it returned True. The child's exit code, the child killed if it is not out in time."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if child() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + TIMEOUT
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # bounded poll of the child's exit, not a synchronization
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not exit")
    return os.waitstatus_to_exitcode(done[1])


def test_a_forked_child_runs_none_of_its_parents_releases():
    """A forked child's copies of received tensors are its parent's to release: their deaths in
    the child run no `on_free` (which would release the parent's slots a second time)."""
    backing = torch.arange(8, dtype=torch.uint8, device="openreg")
    freed = []
    tensor = tensor_from_memory(backing.data_ptr(), 4, backing.device, lambda: freed.append(1))

    def child():
        nonlocal tensor
        del tensor
        return reap_freed() == 0 and not freed and watched() == 0

    assert _in_a_fork(child) == 0
    del tensor
    assert reap_freed() >= 1 and freed == [1]  # here, the parent's release runs


def test_a_forked_child_of_a_sender_keeps_the_structs_its_storages_point_at():
    """A sent storage reaches its memory through an alias's DLPack struct: a forked child that
    forgets its parent's storages keeps their structs, else the storage's death there would
    call a deleter in freed (here: reused) memory."""
    sent = torch.arange(16, dtype=torch.uint8, device="openreg")
    ForkingPickler.dumps(sent)  # exported: its storage now holds an alias's DataPtr
    size = ctypes.sizeof(_memory._Words)

    def child():
        nonlocal sent
        gc.collect()  # what would free a forgotten struct, before its storage dies
        reused = [_memory._malloc(size) for _ in range(8)]  # a freed struct's memory comes back
        for address in reused:
            ctypes.memset(address, 0xAB, size)
        del sent
        return all(ctypes.c_uint64.from_address(a).value == 0xABABABABABABABAB for a in reused)

    assert _in_a_fork(child) == 0
    assert devipc.revoke(sent) == 1  # nobody opens that send: take it back
