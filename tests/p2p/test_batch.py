"""readv/writev of many pairs through the device's `copy_batch` hook (one stream operation): the
same bytes as the per-pair path, in both directions, with openreg and CPU local tensors; the batch
is really taken, queued on the caller's current stream, and a device without the hook still
works."""

import os
import sys

import pytest
import torch
from _support import TIMEOUT, wait_until

import devipc
import devipc.p2p as p2p
from devipc.p2p import _ipc
from devipc_openreg._ipc_hooks import OpenRegIpcHooks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "openreg"))
from _native import held_stream

NBYTES = 1 << 16
pytestmark = pytest.mark.xdist_group("p2p_batch")  # one worker starts the module's `owner`


@pytest.fixture
def batches(monkeypatch):
    """How many times readv/writev called openreg's copy_batch hook, and with how many rows."""
    calls = []
    original = OpenRegIpcHooks.copy_batch

    def counted(self, device_index, table):
        calls.append(table.shape[0])
        return original(self, device_index, table)

    monkeypatch.setattr(OpenRegIpcHooks, "copy_batch", counted)
    return calls


def _ranges(generator, count):
    """`count` disjoint byte ranges (offset, nbytes) of a NBYTES tensor, at random places."""
    cuts = torch.randperm(NBYTES - 1, generator=generator)[: 2 * count].add(1).sort().values
    pairs = cuts.view(-1, 2).tolist()
    order = torch.randperm(count, generator=generator).tolist()  # not in address order
    return [(pairs[i][0], pairs[i][1] - pairs[i][0]) for i in order]


def _transfer_both_ways(call, peer, device, generator):
    """(what readv brought, the owner's tensor after writev) for 200 random ranges."""
    values = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=generator)
    tensor_id, _ = call("create", values, "openreg")
    ranges = _ranges(generator, 200)
    remotes = [call("advertise", tensor_id, offset, n) for offset, n in ranges]
    locals_ = [torch.zeros(n, dtype=torch.uint8, device=device) for _, n in ranges]
    peer.readv(locals_, remotes)
    read = [t.cpu() for t in locals_]
    for (offset, n), got in zip(ranges, read):
        assert torch.equal(got, values[offset : offset + n])
    news = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator).to(device)
        for _, n in ranges
    ]
    peer.writev(news, remotes)
    after = call("get", tensor_id)
    expected = values.clone()
    for (offset, n), new in zip(ranges, news):
        expected[offset : offset + n] = new.cpu()
    assert torch.equal(after, expected)
    call("drop", tensor_id)
    return read, after


@pytest.mark.usefixtures("ipc_mode")
@pytest.mark.parametrize("device", ["openreg", "cpu"])
def test_the_batch_moves_what_the_per_pair_path_moves(owner, peer, batches, monkeypatch, device):
    call, _ = owner
    batched = _transfer_both_ways(call, peer, device, torch.Generator().manual_seed(3))
    assert batches == [200, 200]  # one batch per readv and per writev
    monkeypatch.setattr(_ipc, "_BATCH_MIN", 1 << 30)  # the per-pair path
    per_pair = _transfer_both_ways(call, peer, device, torch.Generator().manual_seed(3))
    assert batches == [200, 200]
    assert all(torch.equal(a, b) for a, b in zip(batched[0], per_pair[0]))
    assert torch.equal(batched[1], per_pair[1])


@pytest.mark.usefixtures("ipc_mode")
def test_a_device_without_copy_batch_copies_pair_by_pair(owner, peer, monkeypatch):
    monkeypatch.delattr(OpenRegIpcHooks, "copy_batch")
    assert (devipc_hooks := _ipc.hooks_for(torch.device("openreg", 0))).copy_batch is None, (
        devipc_hooks
    )  # IpcHooks' default: no batch
    call, _ = owner
    _transfer_both_ways(call, peer, "openreg", torch.Generator().manual_seed(4))


@pytest.mark.usefixtures("ipc_mode")
def test_one_pair_strided_or_cpu_remote_take_the_per_pair_path(owner, peer, batches):
    call, _ = owner
    tensor_id, whole = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    halves = [call("advertise", tensor_id, 0, 128), call("advertise", tensor_id, 128, 128)]
    one = torch.zeros(64, device="openreg")
    peer.readv([one], [whole])
    strided = [torch.zeros(8, 4, device="openreg").t(), torch.zeros(32, device="openreg")]
    peer.readv(strided, halves)
    assert batches == []
    assert torch.equal(strided[0].cpu().reshape(-1), torch.arange(32.0).view(4, 8).reshape(-1))
    cpu_id, _ = call("create", torch.arange(64, dtype=torch.float32), "cpu")
    cpu_halves = [call("advertise", cpu_id, 0, 128), call("advertise", cpu_id, 128, 128)]
    peer.readv([torch.zeros(32, device="openreg") for _ in range(2)], cpu_halves)
    assert batches == []
    call("drop", tensor_id)
    call("drop", cpu_id)


@pytest.mark.usefixtures("ipc_mode")
def test_an_async_batch_is_queued_on_the_callers_current_stream(owner, peer, batches):
    # releases of earlier tests' mappings (closing one waits for the device) first
    torch.accelerator.synchronize()
    wait_until(lambda: devipc.stats()["pending_releases"] == 0, "releases done", collect=True)
    call, _ = owner
    tensor_id, _ = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    remotes = [call("advertise", tensor_id, 16 * i, 16) for i in range(16)]
    locals_ = [torch.zeros(4, device="openreg") for _ in remotes]
    minus = torch.full((4,), -1.0, device="openreg")
    with held_stream(torch.accelerator.current_stream(), TIMEOUT):
        for local in locals_:
            local.copy_(minus)  # the caller's own work (asynchronous), queued first
        transfer = peer.readv_async(locals_, remotes)
        assert batches == [16] and not transfer.done()
        with pytest.raises(TimeoutError):
            transfer.wait(0.01)
    transfer.wait(TIMEOUT)
    assert torch.equal(torch.cat([t.cpu() for t in locals_]), torch.arange(64.0))
    call("drop", tensor_id)


@pytest.mark.usefixtures("ipc_mode")
@pytest.mark.parametrize("how", ["free", "deregister"])
def test_a_batch_against_a_freed_remote_raises(owner, peer, batches, how):
    call, _ = owner
    alive, _ = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    gone, _ = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    remotes = [call("advertise", alive, 0, 128), call("advertise", gone, 0, 128)]
    locals_ = [torch.zeros(32, device="openreg") for _ in remotes]
    peer.readv(locals_, remotes)
    call(how, gone)
    with pytest.raises(p2p.RemoteTensorFreedError):
        peer.readv(locals_, remotes)
    with pytest.raises(p2p.RemoteTensorFreedError):
        peer.writev(locals_, remotes)
    assert batches == [2]
    assert torch.equal(call("get", alive), torch.arange(64.0))
    call("drop", alive)
    call("drop", gone)


@pytest.mark.usefixtures("ipc_mode")
def test_a_vector_posted_again_takes_the_same_batch_with_new_local_tensors(owner, peer, batches):
    call, _ = owner
    tensor_id, _ = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    remotes = [call("advertise", tensor_id, 16 * i, 16) for i in range(16)]
    for step in range(3):  # the same descriptors, other local tensors (CPU ones the last time)
        device = "cpu" if step == 2 else "openreg"
        locals_ = [torch.full((4,), -1.0, device=device) for _ in remotes]
        peer.readv(locals_, remotes)
        assert torch.equal(torch.cat([t.cpu() for t in locals_]), torch.arange(64.0))
        peer.writev([t * (step + 2) for t in locals_], remotes)
        assert torch.equal(call("get", tensor_id), torch.arange(64.0) * (step + 2))
        peer.writev(locals_, remotes)
    strided = [torch.zeros(2, 2, device="openreg").t() for _ in remotes]  # not a plain batch
    peer.readv(strided, remotes)
    assert torch.equal(torch.cat([t.cpu().reshape(-1) for t in strided]), torch.arange(64.0))
    assert batches == [16] * 9
    call("free", tensor_id)
    with pytest.raises(p2p.RemoteTensorFreedError):
        peer.readv(locals_, remotes)
    call("drop", tensor_id)


@pytest.mark.usefixtures("ipc_mode")
def test_a_long_vector_posted_again_goes_in_slices_and_an_odd_pair_sends_all_the_first_way(
    owner, peer, batches, monkeypatch
):
    """A vector posted again reaches the device in slices (its first copies run while the rest
    are read); a strided local tensor anywhere sends every pair the first way, no slice first."""
    monkeypatch.setattr(_ipc, "_SLICE", 4)
    call, _ = owner
    tensor_id, _ = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    remotes = [call("advertise", tensor_id, 16 * i, 16) for i in range(16)]
    locals_ = [torch.full((4,), -1.0, device="openreg") for _ in remotes]
    peer.readv(locals_, remotes)  # the first post: one batch, the vector's rows kept
    for step in (2, 3):
        peer.writev([t * step for t in locals_], remotes)
        assert torch.equal(call("get", tensor_id), torch.arange(64.0) * step)
    assert batches == [16] + [4] * 8
    del batches[:]
    odd = [torch.zeros(4, device="openreg") for _ in remotes]
    odd[9] = torch.zeros(2, 2, device="openreg").t()  # strided: in the third slice
    peer.readv(odd, remotes)
    assert batches == []  # no slice went: the per-pair path copied all 16
    assert torch.equal(torch.cat([t.cpu().reshape(-1) for t in odd]), torch.arange(64.0) * 3)
    call("drop", tensor_id)


@pytest.mark.usefixtures("ipc_mode")
def test_a_device_error_in_a_later_slice_is_raised_and_leaves_the_connection_working(
    owner, peer, monkeypatch
):
    monkeypatch.setattr(_ipc, "_SLICE", 4)
    call, _ = owner
    tensor_id, _ = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    remotes = [call("advertise", tensor_id, 16 * i, 16) for i in range(16)]
    locals_ = [torch.zeros(4, device="openreg") for _ in remotes]
    peer.readv(locals_, remotes)
    original, calls = OpenRegIpcHooks.copy_batch, []

    def failing(self, device_index, table):
        calls.append(table.shape[0])
        if len(calls) == 3:
            raise RuntimeError("the device refused the third slice")
        return original(self, device_index, table)

    monkeypatch.setattr(OpenRegIpcHooks, "copy_batch", failing)
    with pytest.raises(RuntimeError, match="third slice"):
        peer.writev(locals_, remotes)
    monkeypatch.setattr(OpenRegIpcHooks, "copy_batch", original)
    peer.readv(locals_, remotes)  # nothing left pinned or half-done
    assert torch.equal(torch.cat([t.cpu() for t in locals_]), torch.arange(64.0))
    call("free", tensor_id)
    with pytest.raises(p2p.RemoteTensorFreedError):
        peer.readv(locals_, remotes)
    assert peer.mapped() == 0  # unpinned: the ended registration's mapping could go
    call("drop", tensor_id)
