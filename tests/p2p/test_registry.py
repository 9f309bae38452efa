"""The registry: one registration per storage, found through views and slices, ended by
free_tensor, deregister or the garbage collector; ids never reused; nothing left behind."""

import gc
import os

import pytest
import torch
from _support import open_fds, shm_entries, wait_until

import devipc
import devipc.p2p as p2p
from devipc._core import _lifeline
from devipc._core._lifeline import TID_MASK
from devipc.p2p._descriptor import Descriptor
from devipc.p2p._registry import PAGE_LIFELINE, registry

DEVICES = ["openreg", "cpu"]


def _settle():
    torch.accelerator.synchronize()
    wait_until(
        lambda: devipc.stats()["exports"] == 0 and devipc.stats()["pending_releases"] == 0,
        "every export ended",
        collect=True,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_views_and_slices_find_the_registration_of_their_storage(device):
    tensor, tensor_id = p2p.create_tensor((4, 8), torch.float32, device)
    assert tensor.shape == (4, 8) and tensor.device.type == device
    for view in (
        tensor,
        tensor[1],
        tensor[:, 2:5],
        tensor.t(),
        tensor.view(-1)[3:],
        tensor.view(torch.int32),
    ):
        assert p2p.get_tensor_id_by_tensor(view) == tensor_id
    reg = p2p.registration(tensor[2])
    assert reg is p2p.registration(tensor_id)
    assert (reg.id, reg.nbytes, reg.device.type) == (tensor_id, 128, device)
    assert reg.base == tensor.data_ptr() and reg.alive
    with p2p.Endpoint() as endpoint:  # a slice knows its byte offset in the storage
        desc = Descriptor.from_bytes(endpoint.advertise(tensor[2]))
        assert (desc.reg_id, desc.offset, desc.nbytes) == (tensor_id, 64, 32)
        desc = Descriptor.from_bytes(endpoint.advertise(tensor[1], offset=4, nbytes=8))
        assert (desc.offset, desc.nbytes) == (36, 8)
        desc = Descriptor.from_bytes(endpoint.advertise(tensor_id, offset=100))
        assert (desc.offset, desc.nbytes) == (100, 28)
        with pytest.raises(ValueError, match="contiguous"):
            endpoint.advertise(tensor.t())
        with pytest.raises(ValueError, match="past the end"):
            endpoint.advertise(tensor[1], offset=8, nbytes=32)
    p2p.free_tensor(tensor)
    del tensor, view
    _settle()


@pytest.mark.parametrize("device", DEVICES)
def test_registering_a_storage_twice_gives_the_same_id(device):
    tensor, tensor_id = p2p.create_tensor((16,), torch.int64, device)
    assert p2p.register(tensor) == tensor_id
    assert p2p.register(tensor[3:7]) == tensor_id
    assert p2p.register(tensor.untyped_storage()) == tensor_id
    before = registry.live()
    assert p2p.register(tensor[1:]) == tensor_id and registry.live() == before
    p2p.free_tensor(tensor)


def test_manual_register_and_deregister_of_existing_tensors():
    device_tensor = torch.arange(10, device="openreg")
    cpu_tensor = torch.arange(10).share_memory_()
    ids = [p2p.register(device_tensor[2:]), p2p.register(cpu_tensor)]
    assert ids[1] > ids[0]
    assert p2p.get_tensor_id_by_tensor(device_tensor) == ids[0]
    assert p2p.deregister(ids[0]) is True
    assert p2p.deregister(ids[0]) is False  # ended already: a no-op
    with pytest.raises(p2p.NotRegisteredError, match="not registered"):
        p2p.get_tensor_id_by_tensor(device_tensor)
    with pytest.raises(p2p.NotRegisteredError, match="any more"):
        p2p.registration(ids[0])
    with pytest.raises(p2p.NotRegisteredError, match="never registered"):
        p2p.deregister(10**9)
    with pytest.raises(TypeError):
        p2p.deregister("1")
    again = p2p.register(device_tensor)
    assert again > ids[1]  # a new registration, a new id
    p2p.deregister(again)
    p2p.free_tensor(cpu_tensor)
    assert device_tensor.sum().item() == 45  # deregistering touches no data


def test_what_cannot_be_registered_says_why():
    with pytest.raises(ValueError, match="share_memory_"):
        p2p.register(torch.ones(3))  # private CPU memory: a peer could not map it
    with pytest.raises(devipc.UnsupportedDeviceError, match="no IPC hooks"):
        p2p.register(torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match="empty"):
        p2p.register(torch.ones(0, device="openreg"))
    with pytest.raises(TypeError, match="tensor or a storage"):
        p2p.register([1, 2])
    with pytest.raises(p2p.NotRegisteredError):
        p2p.free_tensor(torch.ones(3, device="openreg"))


@pytest.mark.parametrize("device", DEVICES)
def test_the_garbage_collector_deregisters(device):
    tensor, tensor_id = p2p.create_tensor((8,), torch.float32, device)
    reg = p2p.registration(tensor_id)
    view = tensor[2:]
    del tensor
    assert reg.alive  # a view keeps the storage
    del view
    assert not reg.alive and reg.storage() is None
    with pytest.raises(p2p.NotRegisteredError):
        p2p.registration(tensor_id)
    cycle, cycle_id = p2p.create_tensor((8,), torch.float32, device)
    holder = {"tensor": cycle}
    holder["self"] = holder  # only the cycle collector can free it
    del cycle, holder
    gc.collect()
    with pytest.raises(p2p.NotRegisteredError):
        p2p.registration(cycle_id)


def test_ids_are_never_reused_and_storages_at_a_reused_address_are_new():
    seen, addresses = [], set()
    for _ in range(200):
        tensor, tensor_id = p2p.create_tensor((64,), torch.uint8, "openreg")
        addresses.add(tensor.data_ptr())
        seen.append(tensor_id)
        del tensor  # the caching allocator hands the same block out again, once collected
        devipc.ipc_collect()
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert len(addresses) < len(seen)  # addresses were reused, ids were not
    assert registry.live() == 0


class Recorder:
    def __init__(self, fail_on_register=False):
        self.events, self.fail = [], fail_on_register

    def on_register(self, reg):
        if self.fail:
            raise RuntimeError("refused")
        self.events.append(("register", reg.id))

    def on_deregister(self, reg):
        self.events.append(("deregister", reg.id))


def test_listeners_hear_every_registration_and_its_end():
    old, old_id = p2p.create_tensor((4,), torch.float32, "openreg")
    listener = Recorder()
    p2p.add_listener(listener)
    try:
        assert listener.events == [("register", old_id)]  # the live ones, when added
        new, new_id = p2p.create_tensor((4,), torch.float32, "cpu")
        p2p.free_tensor(old)
        del new  # the garbage collector's end is heard too
        assert listener.events[1:] == [
            ("register", new_id),
            ("deregister", old_id),
            ("deregister", new_id),
        ]
    finally:
        p2p.remove_listener(listener)
    refusing = Recorder(fail_on_register=True)
    p2p.add_listener(refusing)
    try:
        live = registry.live()
        with pytest.raises(RuntimeError, match="refused"):
            p2p.register(torch.ones(2, device="openreg"))
        assert registry.live() == live  # rolled back
    finally:
        p2p.remove_listener(refusing)


@pytest.mark.parametrize("device", DEVICES)
def test_thousands_of_cycles_leave_nothing_behind(device):
    with p2p.Endpoint() as endpoint:  # the counter file devipc keeps for its next sends
        endpoint.advertise(p2p.create_tensor((256,), torch.float32, "openreg")[0])
    _settle()
    fds, shm, stats = open_fds(), shm_entries(), devipc.stats()
    with p2p.Endpoint() as endpoint:
        for i in range(2000):
            tensor, tensor_id = p2p.create_tensor((256,), torch.float32, device)
            if i % 4 == 0:
                endpoint.advertise(tensor[1:9])  # an export peers could map
            if i % 2:
                p2p.free_tensor(tensor)
            del tensor
    assert registry.live() == 0
    _settle()
    assert devipc.stats() == stats
    wait_until(lambda: open_fds() <= fds, "no descriptor left")
    assert shm_entries() == shm


def test_a_storage_received_through_devipc_is_not_advertised_again():
    tensor = torch.ones(4, device="openreg")
    received = devipc.open(bytes(devipc.share(tensor)))
    received_id = p2p.register(received)  # registering is fine: a listener may want it
    with p2p.Endpoint() as endpoint, pytest.raises(devipc.ReshareError, match="clone"):
        endpoint.advertise(received)
    p2p.deregister(received_id)
    del received, tensor
    _settle()


@pytest.mark.skipif(not _lifeline._SUPPORTED, reason="no glibc here: peers poll the pidfd")
def test_the_page_carries_this_process_lifeline():
    """Peers read from the page's header whether this process lives (`_lifeline`)."""
    page = registry.page().buffer
    lifeline = page.words[PAGE_LIFELINE]
    assert lifeline > 0  # glibc, Linux: held
    assert page.words[0] & TID_MASK == lifeline
    assert os.path.exists(f"/proc/self/task/{lifeline}")  # the parked thread


def test_past_the_registry_pages_slots_register_says_so_and_an_ended_one_frees_its_slot(
    monkeypatch,
):
    """The page has PAGE_SLOTS (65,536) words: the registration past them is refused naming
    the limit and what to do. (As if all but one were taken: the registry's count is patched.)"""
    from devipc.p2p._registry import PAGE_SLOTS

    monkeypatch.setattr(registry, "_free_slots", [])
    monkeypatch.setattr(registry, "_used_slots", PAGE_SLOTS - 1)
    last, _ = p2p.create_tensor((4,), torch.float32, "cpu")
    with pytest.raises(
        devipc.DevIpcError,
        match=r"at most 65,536 live registrations in a "
        r"process.*free_tensor or deregister",
    ):
        p2p.create_tensor((4,), torch.float32, "cpu")
    p2p.free_tensor(last)  # its slot is free again
    again, _ = p2p.create_tensor((4,), torch.float32, "cpu")
    p2p.free_tensor(again)
    assert registry._free_slots == [PAGE_SLOTS - 1]
