"""Typed handles and buckets: share / open / share_tensors / open_tensors / revoke, across spawned
processes in both openreg IPC modes; device remap by identity, device=, and the args[6] pattern."""

import pickle
import shutil
import subprocess
import sys
import textwrap

import _workers
import pytest
import torch
import torch.multiprocessing.reductions as torch_reductions
from _support import TIMEOUT, wait_until

import devipc
from devipc._core._refcount import RELEASED

pytestmark = pytest.mark.usefixtures("ipc_mode")


def _drain():
    torch.accelerator.synchronize()
    wait_until(lambda: devipc.stats()["sent"] == 0, "every send ended", collect=True)


def _round_trip(children, tensor, device=None):
    """Sends share(tensor) as bytes to a fresh process; returns (device, values) it saw, and
    checks writes both ways."""
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.open_and_write, inbox, outbox, device)
    try:
        inbox.put(bytes(devipc.share(tensor)))
        seen = outbox.get(timeout=TIMEOUT)
        assert outbox.get(timeout=TIMEOUT) == "added"
        assert tensor.cpu().tolist() == [v + 1 for v in seen[1]]  # theirs, seen here
        tensor.fill_(-3)
        torch.accelerator.synchronize()
        inbox.put("filled")
        assert outbox.get(timeout=TIMEOUT) == [-3.0] * tensor.numel()  # ours, seen there
    finally:
        inbox.put("exit")
    children.join_ok()
    return seen


def test_a_handle_opens_in_a_fresh_process_and_writes_cross_both_ways(children):
    base = torch.arange(10, dtype=torch.float32, device="openreg")
    view = base[2:8:2]
    assert _round_trip(children, view) == ("openreg:0", [2.0, 4.0, 6.0])
    assert base.cpu().tolist()[:3] == [0.0, 1.0, -3.0]  # only the view was written
    del base, view
    _drain()


def test_the_consumer_finds_the_device_by_identity(children, monkeypatch):
    tensor = torch.ones(3, device="openreg:1")  # this process read its environment already
    handle = devipc.share(tensor)
    assert handle.device == torch.device("openreg", 1)
    monkeypatch.setenv("OPENREG_VISIBLE_DEVICES", "1")  # the child's openreg:0 is our :1
    outbox = children.ctx.Queue()
    children.start(_workers.try_open, bytes(handle), outbox)
    assert outbox.get(timeout=TIMEOUT) == ("opened", [1.0, 1.0, 1.0])
    children.join_ok()
    del tensor
    _drain()


def test_open_on_an_explicit_device(children):
    tensor = torch.zeros(4, device="openreg:0")
    assert _round_trip(children, tensor, "openreg:1") == ("openreg:1", [0.0] * 4)
    del tensor
    _drain()


def test_open_on_a_device_the_hooks_cannot_map_is_refused(monkeypatch):
    from devipc_openreg._ipc_hooks import OpenRegIpcHooks

    tensor = torch.ones(4, device="openreg:0")
    handle = devipc.share(tensor)
    monkeypatch.setattr(OpenRegIpcHooks, "can_map_on", lambda self, memory, device: False)
    with pytest.raises(devipc.UnsupportedDeviceError, match="cannot be mapped on openreg:1"):
        devipc.open(handle, device="openreg:1")
    with pytest.raises(devipc.UnsupportedDeviceError, match="cannot be mapped on cpu"):
        devipc.open(handle, device="cpu")
    counter, slot = handle._shared.ref_counter_handle, handle._shared.ref_counter_offset
    from devipc._core import _sharing

    assert _sharing._exports._counters.file(counter).counter.state(slot) == RELEASED
    del tensor, handle
    _drain()


@pytest.mark.parametrize(
    "producer, visible, index, expected",
    [
        ("openreg:0", None, 1, "openreg:1"),  # overwritten: that device, as rebuild_cuda_tensor
        ("openreg:1", None, 0, "openreg:0"),
        ("openreg:1", "1", None, "openreg:0"),  # left alone: found by identity
        ("openreg:0", None, None, "openreg:0"),
    ],
)
def test_overwriting_args_6_selects_the_device(
    children, monkeypatch, producer, visible, index, expected
):
    tensor = torch.arange(3, dtype=torch.float32, device=producer)
    payload = pickle.dumps(torch_reductions.reduce_tensor(tensor))
    if visible is not None:
        monkeypatch.setenv("OPENREG_VISIBLE_DEVICES", visible)
    outbox = children.ctx.Queue()
    children.start(_workers.rebuild_on, payload, index, outbox)
    assert outbox.get(timeout=TIMEOUT) == ("opened", expected, [0.0, 1.0, 2.0])
    children.join_ok()
    del tensor
    _drain()


def test_overwriting_args_6_with_a_device_the_hooks_refuse(monkeypatch):
    from devipc_openreg._ipc_hooks import OpenRegIpcHooks

    tensor = torch.ones(2, device="openreg:0")
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    monkeypatch.setattr(OpenRegIpcHooks, "can_map_on", lambda self, memory, device: False)
    args = list(args)
    args[6] = 1
    with pytest.raises(devipc.UnsupportedDeviceError, match="cannot be mapped on openreg:1"):
        rebuild(*args)
    del tensor
    _drain()


@pytest.mark.parametrize("damage", ["truncated", "bit flipped"])
def test_memory_handle_bytes_the_device_refuses_leave_the_send_to_the_genuine_ones(damage):
    """The device refuses the damaged memory handle before the send's slot is taken, so the
    genuine bytes still open it (issue 27, defect 6)."""
    tensor = torch.arange(4.0, device="openreg")
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    handle = args[7]
    damaged = list(args)
    damaged[7] = handle[:-3] if damage == "truncated" else handle[:-1] + bytes([handle[-1] ^ 1])
    with pytest.raises(devipc.InvalidHandleError):
        rebuild(*damaged)
    received = rebuild(*args)
    assert received.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    del tensor, received
    _drain()


def test_a_bucket_of_mixed_dtypes_crosses_processes(children):
    source = {
        "w": torch.arange(6, dtype=torch.float32, device="openreg").reshape(2, 3),
        "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16, device="openreg"),
        "mask": torch.tensor([True, False, True], device="openreg"),
        "empty": torch.empty(0, 5, device="openreg"),
        "z": torch.tensor([1 + 2j], dtype=torch.complex64, device="openreg"),
        "odd": torch.arange(7, dtype=torch.int8, device="openreg")[::2],  # not contiguous
        "scalar": torch.tensor(7, dtype=torch.int64, device="openreg"),
    }
    before = devipc.stats()
    handle = devipc.share_tensors(source)
    after = devipc.stats()
    assert after["buckets_shared"] == before["buckets_shared"] + 1
    assert after["bucket_tensors_shared"] == before["bucket_tensors_shared"] + len(source)
    assert handle.kind == "bucket" and handle.names == tuple(source)
    offsets = handle._table.offsets
    assert all(offset % 256 == 0 for offset in offsets) and offsets == sorted(offsets)
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.open_bucket_and_write, inbox, outbox)
    try:
        inbox.put(handle)  # a Handle pickles as its bytes
        report, same_mapping = outbox.get(timeout=TIMEOUT)
        assert same_mapping
        for name, tensor in source.items():
            dtype, shape, device, values = report[name]
            assert (dtype, shape, device) == (tensor.dtype, tuple(tensor.shape), "openreg:0")
            assert values == tensor.cpu().tolist(), name
        assert outbox.get(timeout=TIMEOUT) == "written"
        assert handle.local["w"].cpu().tolist() == [[5.0] * 3] * 2  # theirs, seen here
        assert source["w"][0, 0].item() == 0  # a bucket is a copy of its sources
        handle.local["mask"].fill_(False)
        handle.local["z"].mul_(2)
        torch.accelerator.synchronize()
        inbox.put("filled")
        report = outbox.get(timeout=TIMEOUT)
        assert report["mask"][3] == [False] * 3 and report["z"][3] == [2 + 4j]  # ours, there
    finally:
        inbox.put("exit")
    children.join_ok()
    del handle
    _drain()


def test_packed_weights_are_shared_where_they_lie(children):
    source = {
        "w": torch.arange(6, dtype=torch.float32, device="openreg").reshape(2, 3),
        "mask": torch.tensor([True, False, True], device="openreg"),
        "z": torch.tensor([1 + 2j], dtype=torch.complex64, device="openreg"),
        "empty": torch.empty(0, 5, device="openreg"),
    }
    packed = devipc.pack(source)
    assert len({t.untyped_storage().data_ptr() for t in packed.values()}) == 1
    assert all(t.storage_offset() * t.element_size() % 256 == 0 for t in packed.values())
    for name, tensor in source.items():
        assert torch.equal(packed[name].cpu(), tensor.cpu()), name
    allocated = torch.openreg.memory_allocated()
    handle = devipc.share_tensors(packed, copy=False)
    assert torch.openreg.memory_allocated() <= allocated  # no copy (earlier tests' may go)
    assert handle.local["w"] is packed["w"]
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.open_bucket_and_write, inbox, outbox)
    try:
        inbox.put(bytes(handle))
        report, same_mapping = outbox.get(timeout=TIMEOUT)
        assert same_mapping and report["w"][3] == source["w"].cpu().tolist()
        assert outbox.get(timeout=TIMEOUT) == "written"
        assert packed["w"].cpu().tolist() == [[5.0] * 3] * 2  # theirs, in the trainer's weights
        packed["mask"].fill_(False)
        torch.accelerator.synchronize()
        inbox.put("filled")
        assert outbox.get(timeout=TIMEOUT)["mask"][3] == [False] * 3  # ours, there
    finally:
        inbox.put("exit")
    children.join_ok()
    del handle
    _drain()


def test_share_without_copy_needs_views_of_one_storage():
    with pytest.raises(ValueError, match="views of one storage"):
        devipc.share_tensors(
            {"a": torch.ones(2, device="openreg"), "b": torch.ones(2, device="openreg")}, copy=False
        )
    base = torch.arange(8, dtype=torch.float32, device="openreg")
    handle = devipc.share_tensors({"head": base[:3], "odd": base[1::2]}, copy=False)
    assert (handle._table.offsets, handle._table.strides) == ([0, 4], [(1,), (2,)])
    assert handle.revoke()
    _drain()


def test_bucket_arguments_are_checked():
    one = torch.ones(2, device="openreg")
    with pytest.raises(ValueError, match="unique"):
        devipc.share_tensors([("a", one), ("a", one)])
    with pytest.raises(ValueError, match="at most 1024"):
        devipc.share_tensors([("x" * 1025, one)])
    with pytest.raises(ValueError, match="one device"):
        devipc.share_tensors({"a": one, "b": torch.ones(2, device="openreg:1")})
    with pytest.raises(devipc.UnsupportedDeviceError):
        devipc.share_tensors({"a": one, "cpu": torch.ones(2)})
    bucket = devipc.share_tensors({"a": one})
    with pytest.raises(devipc.InvalidHandleError, match="open_tensors"):
        devipc.open(devipc.Handle.from_bytes(bytes(bucket)))
    with pytest.raises(devipc.InvalidHandleError, match="devipc.open"):
        devipc.open_tensors(single := devipc.share(one))
    assert single.revoke()
    assert bucket.revoke()  # unopened sends are held until revoked
    _drain()


def test_a_revoked_handle_cannot_be_opened(children):
    tensor = torch.ones(4, device="openreg")
    handle = devipc.share(tensor)
    data = bytes(handle)
    assert handle.revoke()
    assert not handle.revoke()  # once
    outbox = children.ctx.Queue()
    children.start(_workers.try_open, data, outbox)
    status, message = outbox.get(timeout=TIMEOUT)
    assert status == "refused" and "revoked" in message
    children.join_ok()
    assert devipc.Handle.from_bytes(data).revoke() is False  # already revoked
    del tensor
    _drain()


def test_revoke_takes_back_only_its_own_send(children):
    tensor = torch.ones(4, device="openreg")
    first, second = devipc.share(tensor), devipc.share(tensor)
    assert first.revoke()
    outbox = children.ctx.Queue()
    children.start(_workers.try_open, bytes(second), outbox)
    assert outbox.get(timeout=TIMEOUT) == ("opened", [1.0] * 4)
    children.join_ok()
    assert not second.revoke()  # opened (and released) already
    del tensor
    _drain()


def test_forged_or_truncated_handles_are_refused():
    tensor = torch.ones(4, device="openreg")
    handle = devipc.share(tensor)
    data = bytes(handle)
    for bad in (data[:-1], data[:20], b"", data + b"\0", b"PK" + data[2:]):
        with pytest.raises(devipc.InvalidHandleError):
            devipc.open(bad)
    memory = handle._shared.handle
    forged = bytearray(memory)
    forged[40] ^= 0xFF  # the random token: names no memfd of the producer
    with pytest.raises(devipc.InvalidHandleError):
        devipc.open(data.replace(memory, bytes(forged)))
    # refused before the slot was taken: the genuine bytes still open (issue 27, defect 6)
    assert devipc.open(data).cpu().tolist() == [1.0] * 4
    del tensor
    _drain()


def test_forged_grad_and_device_flags_are_invalid_handles_and_leave_the_send_alone():
    """requires_grad on an integer tensor (typed handle, or args[10] of rebuild_device_tensor),
    and an empty tensor on a device this process does not see: InvalidHandleError, before the
    send's slot is taken, so the genuine bytes still open."""
    import torch.multiprocessing.reductions as reductions

    tensor = torch.arange(4, device="openreg")
    handle = devipc.share(tensor)
    handle._requires_grad = True
    with pytest.raises(devipc.InvalidHandleError, match="cannot require grad"):
        devipc.open(bytes(handle))
    handle._requires_grad = False
    assert devipc.open(bytes(handle)).cpu().tolist() == [0, 1, 2, 3]
    rebuild, args = reductions.reduce_tensor(tensor)
    for forged in (True, 1, None):
        with pytest.raises(devipc.InvalidHandleError):
            rebuild(*args[:10], forged, *args[11:])
    assert rebuild(*args).cpu().tolist() == [0, 1, 2, 3]
    empty = devipc.share(torch.empty(0, device="openreg"))
    empty._shared = empty._shared._replace(device=torch.device("openreg", 8))
    with pytest.raises(devipc.InvalidHandleError, match="openreg:8"):
        devipc.open(bytes(empty))
    rebuild, args = reductions.reduce_tensor(torch.empty(0, device="openreg"))
    with pytest.raises(devipc.InvalidHandleError):
        rebuild(*args[:6], 8, *args[7:])
    del tensor
    _drain()


def test_a_table_seen_before_is_still_checked_against_each_handles_storage():
    """A consumer keeps the tables it decoded (a trainer sends the same one every step); a
    handle whose table was seen with a larger storage is still refused where a row would reach
    outside its own."""
    big = torch.arange(1000, dtype=torch.float32, device="openreg")
    handle = devipc.share_tensors({"a": big[996:]}, copy=False)
    assert devipc.open_tensors(bytes(handle))["a"].cpu().tolist() == [996.0, 997.0, 998.0, 999.0]
    again = devipc.share_tensors({"a": big[996:]}, copy=False)
    assert devipc.open_tensors(bytes(again))["a"].cpu().tolist() == [996.0, 997.0, 998.0, 999.0]
    forged = devipc.share_tensors({"a": big[996:]}, copy=False)
    forged._shared = forged._shared._replace(size_bytes=16)  # the same table, a smaller storage
    with pytest.raises(devipc.InvalidHandleError, match="outside its storage"):
        devipc.open_tensors(bytes(forged))
    forged._shared = forged._shared._replace(size_bytes=4000)
    assert forged.revoke()
    del big
    _drain()


def _in_another_pid_namespace(code: str, *args: str) -> subprocess.CompletedProcess:
    """Runs `code` as root's `unshare --pid --fork --mount-proc` would for a second container
    sharing the device: its own PID namespace and /proc. Skips where that is not allowed."""
    command = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code, *args]
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) on this machine")
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=TIMEOUT
    )
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid is not permitted here: {probe.stderr.decode().strip()}")
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)


def test_a_consumer_in_another_pid_namespace_is_told_so_not_that_the_producer_exited():
    tensor = torch.arange(4.0, device="openreg")
    handle = devipc.share(tensor)
    result = _in_another_pid_namespace(
        textwrap.dedent("""
        import sys, devipc
        try:
            devipc.open(bytes.fromhex(sys.argv[1]))
        except devipc.DevIpcError as error:
            print(type(error).__name__, error)
    """),
        bytes(handle).hex(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("InvalidHandleError"), result.stdout
    assert "another PID namespace" in result.stdout and "shareProcessNamespace" in result.stdout
    assert "exited" not in result.stdout
    assert handle.revoke()  # the producer is alive, and its send was never opened
