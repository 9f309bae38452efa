"""openreg's six hooks, against the contract's semantics."""

import _workers
import pytest
import torch
from _support import TIMEOUT, wait_until

import devipc
from devipc_openreg._ipc_hooks import OpenRegIpcHooks


def test_registered_and_supported():
    assert isinstance(devipc.hooks.get_ipc_hooks("openreg"), OpenRegIpcHooks)
    assert devipc.hooks.device_supports_ipc("openreg")


def test_handle_names_the_segment_and_the_offset():
    hooks = OpenRegIpcHooks()
    a = torch.empty(64, dtype=torch.uint8, device="openreg")
    b = torch.empty(64, dtype=torch.uint8, device="openreg")
    handle_a, offset_a = hooks.get_ipc_mem_handle(a.data_ptr())
    handle_b, offset_b = hooks.get_ipc_mem_handle(b.data_ptr())
    assert handle_a == handle_b and offset_a != offset_b  # small blocks share a segment
    memory = hooks.open_ipc_mem_handle(handle_a)
    try:
        assert memory.device == a.device
        assert memory.ptr + offset_b + 64 <= memory.ptr + memory.size
    finally:
        memory.close()


def test_host_memory_maps_on_any_openreg_device_and_devices_have_identities():
    hooks = OpenRegIpcHooks()
    a = torch.empty(64, dtype=torch.uint8, device="openreg:1")
    memory = hooks.open_ipc_mem_handle(hooks.get_ipc_mem_handle(a.data_ptr())[0])
    try:
        assert hooks.can_map_on(memory, torch.device("openreg", 0))
        assert not hooks.can_map_on(memory, torch.device("openreg", 2))
        assert not hooks.can_map_on(memory, torch.device("cpu"))
    finally:
        memory.close()
    ids = [hooks.device_identity(torch.device("openreg", i)) for i in range(2)]
    assert len(ids[0]) == 36 and ids[0] != ids[1]
    assert [hooks.memory_kind(i) for i in range(2)] == ["DRAM", "DRAM"]  # host memory


@pytest.mark.parametrize("mode, size", [("0", 0), ("1", 64)])
def test_event_size_follows_the_mode(monkeypatch, mode, size):
    monkeypatch.setenv("OPENREG_IPC_EVENTS", mode)
    hooks = OpenRegIpcHooks()
    assert hooks.ipc_event_handle_size() == size
    event = hooks.get_ipc_event_handle(torch.device("openreg", 0))
    assert len(event) == size
    hooks.wait_ipc_event(event, torch.accelerator.current_stream())
    torch.accelerator.synchronize()


def test_device_is_matched_by_identity_not_by_index(children, monkeypatch):
    """The producer's openreg:1 is the consumer's openreg:0 when only that device is visible
    there: no framework has to rewrite argument 6 of the rebuild tuple."""
    tensor = torch.ones(3, device="openreg:1")  # this process read its environment already
    monkeypatch.setenv("OPENREG_VISIBLE_DEVICES", "1")
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.check_received, inbox, outbox)
    try:
        inbox.put((tensor, torch.ones(3)))
        report = outbox.get(timeout=TIMEOUT)
    finally:
        inbox.put(None)
    children.join_ok()
    assert report["equal"] and report["device"] == "openreg:0"
    del tensor
    devipc.ipc_collect()
    torch.accelerator.empty_cache()


@pytest.mark.parametrize("mode", ["sync", "events"])
def test_a_received_storage_is_released_after_the_work_queued_on_it(gate, monkeypatch, mode):
    """The consumer's release waits for its own queued work: until then the producer must not
    free (and hand out again) the memory that work still reads."""
    from devipc._core import _sharing
    from devipc._core._refcount import HELD, RELEASED

    monkeypatch.setenv("OPENREG_IPC_EVENTS", "1" if mode == "events" else "0")
    source = torch.ones(1 << 20, device="openreg")  # 4 MiB: a segment of its own
    sent_ptr = source.data_ptr()
    shared = devipc.rfc.share_device(source.untyped_storage())
    received = torch.tensor([], device="openreg").set_(devipc.rfc.new_shared_device(*shared))
    stream = torch.openreg.current_stream()
    gate.hold_torch_stream(stream)
    copy = received.clone()  # queued behind the gate
    del received  # its storage dies while the clone still has to read it
    counter = _sharing._counters._open(shared[4])
    try:
        assert devipc.stats()["pending_releases"] == 1
        assert counter.state(shared[5]) == HELD
        del source
        devipc.ipc_collect()
        fresh = torch.empty(1 << 20, device="openreg")
        assert fresh.data_ptr() != sent_ptr, "freed while the consumer's copy was still queued"
        gate.open()
        torch.openreg.synchronize()
        assert copy.sum().item() == 1 << 20
        wait_until(
            lambda: not devipc.stats()["pending_releases"], "the deferred release ran", collect=True
        )
        assert counter.state(shared[5]) == RELEASED
    finally:
        _sharing._counters._put(shared[4])


def test_an_ipc_mode_switch_other_than_0_or_1_is_refused_with_the_value(monkeypatch):
    monkeypatch.setenv("OPENREG_IPC_EVENTS", "yes")
    with pytest.raises(ValueError, match="OPENREG_IPC_EVENTS='yes' is not understood"):
        devipc.share(torch.ones(2, device="openreg"))


def test_make_resizable_gives_a_storage_its_allocator_back():
    from devipc._core._memory import tensor_from_memory

    base = torch.arange(16.0, device="openreg")
    borrowed = tensor_from_memory(base.data_ptr(), 64, base.device, lambda: None).untyped_storage()
    assert not borrowed.resizable()
    OpenRegIpcHooks().make_resizable(borrowed)
    assert borrowed.resizable()
    borrowed.resize_(128)  # new openreg memory, the first 64 bytes copied
    assert borrowed.data_ptr() != base.data_ptr()
    view = torch.empty(0, device="openreg").set_(borrowed, 0, (32,))
    assert view[:16].cpu().tolist() == list(range(16))
