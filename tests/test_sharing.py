"""share_device / new_shared_device / release_ipc_counter_device and the sent-data collector,
in one process and across processes, in both openreg IPC modes."""

import gc
import logging
import textwrap
from multiprocessing.reduction import ForkingPickler

import _workers
import pytest
import torch
from _support import TIMEOUT, keep_collector_out, run_python, wait_until

import devipc
from devipc._core import _sharing
from devipc._core._refcount import SENT

pytestmark = pytest.mark.usefixtures("ipc_mode")


def _drain():
    torch.accelerator.synchronize()
    devipc.ipc_collect()


def test_share_and_rebuild_in_one_process_is_zero_copy():
    source = torch.arange(16, dtype=torch.float32, device="openreg")
    shared = devipc.rfc.share_device(source.untyped_storage())
    assert len(shared) == 8
    device, handle, size_bytes, offset_bytes, rc_handle, rc_offset, event, needs_event = shared
    assert isinstance(handle, bytes) and size_bytes == 64 and isinstance(offset_bytes, int)
    assert needs_event == (len(event) > 0)
    storage = devipc.rfc.new_shared_device(*shared)
    assert storage.device == source.device and storage.nbytes() == 64
    view = torch.tensor([], dtype=torch.float32, device="openreg").set_(storage)
    view[3] = -1
    assert source[3].item() == -1
    assert devipc.received_via_ipc(storage) and not devipc.received_via_ipc(source)
    del view, storage
    del source
    assert devipc.ipc_collect() >= 1


def test_sharing_waits_for_queued_work():
    big = torch.empty(32 << 20, dtype=torch.uint8)
    big.fill_(7)
    target = torch.empty(32 << 20, dtype=torch.uint8, device="openreg")
    for _ in range(4):
        target.copy_(big, non_blocking=True)
    shared = devipc.rfc.share_device(target.untyped_storage())
    if not shared[7]:
        # No events: the producer synchronized; nothing may still be queued.
        assert torch.accelerator.current_stream().query()
    storage = devipc.rfc.new_shared_device(*shared)
    received = torch.tensor([], dtype=torch.uint8, device="openreg").set_(storage)
    assert int(received[-1].item()) == 7
    del received, storage, target
    _drain()


def test_cache_hit_releases_the_new_slot(children):
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.hold_until_told, inbox, outbox)
    try:
        tensor = torch.ones(8, device="openreg")
        _drain()
        held_before = _sharing.stats()["sent"]
        inbox.put(tensor)
        assert outbox.get(timeout=TIMEOUT) == 8.0
        inbox.put(tensor)  # same storage: the consumer's cache hit must give this slot back
        assert outbox.get(timeout=TIMEOUT) == 8.0
        devipc.ipc_collect()
        assert _sharing.stats()["sent"] == held_before + 1  # the second send came back at once
        inbox.put("drop")
        assert outbox.get(timeout=TIMEOUT) == "dropped"
        devipc.ipc_collect()
        assert _sharing.stats()["sent"] == held_before
    finally:
        inbox.put("exit")
    children.join_ok()


def test_memory_returns_to_baseline_after_release(children):
    _drain()
    baseline = torch.accelerator.memory_allocated()
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.hold_until_told, inbox, outbox)
    try:
        tensor = torch.ones(1 << 20, device="openreg")
        inbox.put(tensor)
        assert outbox.get(timeout=TIMEOUT) == float(1 << 20)
        del tensor
        devipc.ipc_collect()
        # The consumer still holds it: the producer must keep the memory.
        assert torch.accelerator.memory_allocated() >= baseline + (4 << 20)
        inbox.put("drop")
        assert outbox.get(timeout=TIMEOUT) == "dropped"
        devipc.ipc_collect()
        # (below it: an earlier test's garbage of this xdist worker may go meanwhile)
        assert torch.accelerator.memory_allocated() <= baseline
    finally:
        inbox.put("exit")
    children.join_ok()


def test_an_allocation_sent_again_stays_mapped_across_a_pending_release(children):
    """Weights synced every step: the consumer drops step k's tensor and opens step k + 1's;
    the release that was pending runs after the new open, which reuses the mapping."""
    tensor = torch.arange(1 << 16, dtype=torch.float32, device="openreg")
    first, second = bytes(devipc.share(tensor)), bytes(devipc.share(tensor))
    outbox = children.ctx.Queue()
    children.start(_workers.reopen_while_release_pends, first, second, outbox)
    maps, pending_before, pending_after, mapped, same, mapped_at_end = outbox.get(timeout=TIMEOUT)
    assert (pending_before, pending_after) == (1, 0)  # the old release ran, after the open
    assert (maps, mapped, same, mapped_at_end) == (1, 1, True, 0)
    children.join_ok()
    del tensor
    wait_until(lambda: devipc.stats()["sent"] == 0, "every send ended", collect=True)


def test_a_refused_open_leaves_the_send_to_the_genuine_bytes():
    """The device refuses a forged memory handle before the slot is taken (issue 27, defect 6)."""
    tensor = torch.ones(4, device="openreg")
    shared = devipc.rfc.share_device(tensor.untyped_storage())
    forged = list(shared)
    forged[1] = bytes(len(shared[1]))  # forged memory handle
    with pytest.raises(devipc.InvalidHandleError):
        devipc.rfc.new_shared_device(*forged)
    counter = _sharing._counters._open(shared[4])
    try:
        assert counter.state(shared[5]) == SENT
    finally:
        _sharing._counters._put(shared[4])
    received = devipc.rfc.new_shared_device(*shared)
    assert torch.equal(torch.empty(0, device="openreg").set_(received).cpu(), tensor.cpu())
    del tensor, received
    _drain()


def test_storage_larger_than_its_allocation_is_refused():
    tensor = torch.ones(4, device="openreg")
    shared = list(devipc.rfc.share_device(tensor.untyped_storage()))
    shared[2] = 1 << 40
    with pytest.raises(devipc.InvalidHandleError, match="exceeds"):
        devipc.rfc.new_shared_device(*shared)
    assert devipc.revoke(tensor) == 1  # refused before its slot was taken: still unopened
    del tensor
    _drain()


def test_unsupported_device_is_an_error_not_a_copy():
    hooks = devipc.hooks.get_ipc_hooks("openreg")
    devipc.hooks.unregister_ipc_hooks("openreg")
    try:
        tensor = torch.ones(4, device="openreg")
        with pytest.raises(devipc.UnsupportedDeviceError, match="openreg:0"):
            devipc.rfc.share_device(tensor.untyped_storage())
        # torch's own path, which devices without hooks take, gets the same clear error
        with pytest.raises(devipc.UnsupportedDeviceError, match="register_ipc_hooks"):
            ForkingPickler.dumps(tensor)
    finally:
        devipc.hooks.register_ipc_hooks("openreg", hooks)


def test_many_unopened_sends_warn_once_naming_revoke_and_are_freed_once_released():
    tensor = torch.ones(4, device="openreg")
    before = _sharing.stats()["sent"]
    with pytest.warns(UserWarning, match=r"never opened.*revoke\(storage\).*set_unopened_deadline"):
        sends = [
            devipc.rfc.share_device(tensor.untyped_storage())
            for _ in range(_sharing.LIMBO_WARN_BLOCKS + 1)
        ]
        devipc.ipc_collect()
    assert _sharing.stats()["unopened"] == len(sends)
    assert _sharing.stats()["oldest_unopened_s"] >= 0
    for shared in sends:
        devipc.rfc.release_ipc_counter_device(shared[4], shared[5])
    # With IPC events a release completes on the stream's worker: collect until all have.
    wait_until(
        lambda: _sharing.stats()["sent"] <= before, "every released send collected", collect=True
    )
    assert _sharing.stats()["unopened"] == 0


def test_unopened_sends_print_one_visible_warning_apart_from_held_ones():
    # a plain script, default warning filters: the warning must show without -W flags
    result = run_python(
        textwrap.dedent("""
        import torch, devipc
        tensor = torch.ones(4, device="openreg")
        sends = [devipc.rfc.share_device(tensor.untyped_storage()) for _ in range(3000)]
        for _ in range(3):
            devipc.ipc_collect()
        print(devipc.stats()["unopened"], devipc.stats()["sent"])
    """)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3000", "3000"]
    lines = [line for line in result.stderr.splitlines() if "devipc:" in line]
    assert len(lines) == 1 and "sends were never opened" in lines[0], result.stderr  # once
    assert "held by consumers" not in result.stderr


def test_dropping_received_memory_waits_for_copies_queued_on_it():
    source = torch.full((8 << 20,), 3, dtype=torch.int32, device="openreg")
    shared = devipc.rfc.share_device(source.untyped_storage())
    received = torch.tensor([], dtype=torch.int32, device="openreg").set_(
        devipc.rfc.new_shared_device(*shared)
    )
    out = torch.zeros(8 << 20, dtype=torch.int32)
    for _ in range(4):
        out.copy_(received, non_blocking=True)  # queued reads of the mapping
    del received  # the last storage: its mapping is closed now, while the copies may be queued
    torch.openreg.synchronize()
    assert int(out[0]) == int(out[-1]) == 3
    del source
    _drain()


def test_opened_allocations_find_an_address_by_its_range():
    """`contains` (every first send asks it) bisects the ranges held, per device type."""
    from devipc._core._received import OpenedAllocations
    from devipc.hooks import OpenedMemory

    closed = []

    class Hooks:
        def open_ipc_mem_handle(self, handle):
            base = int.from_bytes(handle, "little")
            return OpenedMemory(base, 100, torch.device("openreg", 0), lambda: closed.append(base))

    opened, hooks = OpenedAllocations(), Hooks()
    for base in (5000, 1000, 3000):
        opened.acquire(hooks, base.to_bytes(4, "little"))
    device = torch.device("openreg", 0)
    assert [
        ptr
        for ptr in (999, 1000, 1099, 1100, 2999, 3050, 5099, 5100)
        if opened.contains(device, ptr)
    ] == [1000, 1099, 3050, 5099]
    assert not opened.contains(torch.device("cpu"), 1000)  # another device type
    opened.release((3000).to_bytes(4, "little"))
    assert closed == [3000] and not opened.contains(device, 3050)
    assert opened.contains(device, 1050) and opened.contains(device, 5050) and len(opened) == 2


def test_a_failing_release_is_logged_and_the_open_that_ran_it_goes_on(monkeypatch):
    """An open runs the releases that are due; one that fails is logged, and neither the open
    nor the other releases are lost (nor is anything released twice)."""
    logged: list[str] = []

    class Count(logging.Handler):  # keeps no record: a record's traceback holds the open's frame
        def emit(self, record):
            logged.append(record.getMessage())

    logger, handler = logging.getLogger("devipc"), Count()
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "propagate", False)
    try:
        gc.collect()  # an earlier test's received storages, in cycles: their releases go first
        torch.accelerator.synchronize()
        wait_until(
            lambda: devipc.stats()["pending_releases"] == 0, "earlier releases ran", collect=True
        )
        keep_collector_out(monkeypatch)  # its rounds would run the releases too
        before = devipc.stats()["mapped"]
        tensor, other = torch.arange(4.0, device="openreg"), torch.ones(4, device="openreg")
        received = [ForkingPickler.loads(ForkingPickler.dumps(t)) for t in (tensor, other)]
        del received  # both die; their releases wait for the next open
        gc.collect()  # (also if a cycle held one: a retried open's traceback, on a busy machine)
        # their deaths noted now (stats reaps), not by the open: that would wait for the work the
        # open itself queued (with events, a wait on the producer's; slow on a busy machine)
        devipc.stats()
        torch.accelerator.synchronize()  # their streams' work done: the releases are due at once
        original, calls = _sharing._opened.release, []

        def release_then_fail(handle):
            original(handle)
            calls.append(handle)
            raise OSError("unmap failed")

        monkeypatch.setattr(_sharing._opened, "release", release_then_fail)
        again = ForkingPickler.loads(ForkingPickler.dumps(tensor))
        monkeypatch.setattr(_sharing._opened, "release", original)
        assert len(calls) == 2
        assert logged == ["devipc: releasing a received storage failed"] * 2
        assert torch.equal(again.cpu(), tensor.cpu())
        del again
        devipc.ipc_collect()
        stats = devipc.stats()
        assert stats["pending_releases"] == 0 and stats["mapped"] == before
    finally:
        logger.removeHandler(handler)


def test_mappings_kept_open_for_reuse_are_bounded_and_close(monkeypatch):
    """Hooks with `reusable_mappings` keep a mapping whose last storage died open for the next
    open of the same handle, at most IDLE_MAPPINGS of them, each until `close_idle` finds it
    older than asked; hooks without it close with the last storage, as before."""
    from devipc._core import _received
    from devipc.hooks import OpenedMemory

    closed, opened_count = [], []

    class Hooks:
        def __init__(self, reusable):
            self.reusable = reusable

        def reusable_mappings(self):
            return self.reusable

        def open_ipc_mem_handle(self, handle):
            base = int.from_bytes(handle, "little")
            opened_count.append(base)
            return OpenedMemory(base, 10, torch.device("openreg", 0), lambda: closed.append(base))

    monkeypatch.setattr(_received, "IDLE_MAPPINGS", 2)
    opened, reusable = _received.OpenedAllocations(), Hooks(True)
    handles = [(100 * i).to_bytes(4, "little") for i in range(1, 5)]
    for handle in handles[:3]:
        opened.acquire(reusable, handle)
        opened.release(handle)
    assert closed == [100] and len(opened) == opened.idle() == 2  # the oldest idle one went
    opened.acquire(reusable, handles[1])  # kept: opened again without a mapping
    assert opened_count == [100, 200, 300] and opened.idle() == 1
    assert opened.contains(torch.device("openreg", 0), 305)  # an idle mapping is still mapped
    opened.release(handles[1])
    assert opened.close_idle(older_than=3600) and closed == [100]  # not old enough
    assert not opened.close_idle() and sorted(closed) == [100, 200, 300] and len(opened) == 0
    plain = Hooks(False)
    opened.acquire(plain, handles[3])
    opened.release(handles[3])
    assert closed[-1] == 400 and len(opened) == 0 and opened.idle() == 0


def test_a_new_tensor_per_send_maps_nothing_new_and_the_producer_reuses_its_memory(monkeypatch):
    """A new tensor every step (a batch, an activation): the producer gives each send's memory
    back within a few sends (its caching allocator reuses it), and the consumer finds the
    segments still mapped; `ipc_collect` closes what was kept. The collector thread is kept out:
    the sends' own path must do it (nor close what is kept, however slow this machine is)."""
    from devipc._core._hooks import hooks_for

    _drain()
    keep_collector_out(monkeypatch)
    hooks = hooks_for(torch.device("openreg"))
    maps, open_handle = [], hooks.open_ipc_mem_handle
    monkeypatch.setattr(
        hooks, "open_ipc_mem_handle", lambda handle: maps.append(handle) or open_handle(handle)
    )
    mapped, baseline = devipc.stats()["mapped"], torch.accelerator.memory_allocated()
    size, places = 16 << 20, set()
    for step in range(40):
        tensor = torch.full((size // 4,), step, dtype=torch.int32, device="openreg")
        places.add(tensor.data_ptr())
        received = ForkingPickler.loads(ForkingPickler.dumps(tensor))
        assert int(received[-1]) == step
        del tensor, received
        torch.accelerator.synchronize()
        assert torch.accelerator.memory_allocated() <= baseline + 8 * size, step
    assert len(places) <= 4 and len(maps) <= 4, (len(places), len(maps))
    _sharing._deferred.poll()  # the last release, which the next open would have run
    stats = devipc.stats()  # every segment it used is kept, and only those
    assert stats["pending_releases"] == 0 and 1 <= stats["mapped_idle"] <= len(maps)
    assert stats["mapped"] == mapped + stats["mapped_idle"]
    devipc.ipc_collect()
    stats = devipc.stats()
    assert stats["mapped_idle"] == 0 and stats["mapped"] == mapped
    _drain()
    assert torch.accelerator.memory_allocated() <= baseline
