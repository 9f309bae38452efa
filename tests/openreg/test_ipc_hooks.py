"""openreg's six hooks, against the contract's semantics."""
import _workers
import pytest
import torch
from _support import TIMEOUT

import devipc
from devipc_openreg._ipc_hooks import OpenRegIpcHooks


def test_registered_and_supported():
    assert isinstance(devipc.get_ipc_hooks("openreg"), OpenRegIpcHooks)
    assert devipc.device_supports_ipc("openreg")


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
