"""Sub-ranges of advertised descriptors and prepared transfers over the same-host path, in both
openreg IPC modes: the bytes land where they should, a range past what the owner advertised is
refused, a prepared transfer posts many times, a freed remote raises on the next post, a closed
one (or its connection) refuses to post, and a post is ordered after the caller's queued work."""

import os
import sys
import threading

import pytest
import torch
from _support import TIMEOUT

import devipc.p2p as p2p

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "openreg"))
from _native import held_stream

both_modes = pytest.mark.usefixtures("ipc_mode")
pytestmark = pytest.mark.xdist_group("p2p_prepared")  # one worker starts the module's `owner`


@both_modes
@pytest.mark.parametrize("device", ["openreg", "cpu"])
def test_sub_ranges_read_and_write_inside_the_advertised_range(owner, peer, device):
    call, _ = owner
    values = torch.arange(64, dtype=torch.float32)
    tensor_id, _ = call("create", values, "openreg")
    part = call("advertise", tensor_id, 32 * 4, 16 * 4)  # elements 32..47
    eight = torch.zeros(8, device=device)
    peer.read(eight, part, offset=4 * 4)
    assert eight.cpu().tolist() == list(range(36, 44))
    peer.read_async(eight, part, offset=0).wait(TIMEOUT)
    assert eight.cpu().tolist() == list(range(32, 40))
    peer.write(torch.full((4,), -1.0, device=device), part, offset=12 * 4)  # its last 4
    peer.writev([torch.full((2,), -2.0, device=device)] * 2, [part, part], offsets=[0, 8])
    expected = values.clone()
    expected[44:48] = -1.0
    expected[32:34] = expected[34:36] = -2.0
    assert torch.equal(call("get", tensor_id), expected)
    pairs = [torch.zeros(2, device=device) for _ in range(3)]
    peer.readv(pairs, [part] * 3, offsets=(8, 24, 56))
    assert [t.cpu().tolist() for t in pairs] == [[-2.0, -2.0], [38.0, 39.0], [-1.0, -1.0]]
    call("drop", tensor_id)


@both_modes
def test_a_sub_range_past_what_the_owner_advertised_is_refused(owner, peer):
    call, _ = owner
    tensor_id, _ = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    part = call("advertise", tensor_id, 0, 64)  # 64 of the storage's 256 bytes
    local = torch.zeros(4, device="openreg")
    peer.read(local, part, offset=48)  # the last 16 bytes: fine
    for offset in (49, 64, 1 << 40):
        with pytest.raises(p2p.TransferSizeError, match="not inside the 64 bytes"):
            peer.read(local, part, offset=offset)
        with pytest.raises(p2p.TransferSizeError):
            peer.prepare("write", [local], [part], offsets=[offset])
    with pytest.raises(ValueError, match="non-negative int"):
        peer.write(local, part, offset=-16)
    with pytest.raises(ValueError, match="2 offsets for 1 remote"):
        peer.readv([local], [part], offsets=[0, 16])
    with pytest.raises(p2p.TransferSizeError, match="pass an offset"):
        peer.read(local, part)  # without an offset the sizes must match
    assert torch.equal(call("get", tensor_id), torch.arange(64.0))  # nothing was written
    call("drop", tensor_id)


@both_modes
@pytest.mark.parametrize("pairs", [1, 3])
@pytest.mark.parametrize("device", ["openreg", "cpu"])
def test_a_prepared_transfer_posts_many_times(owner, peer, pairs, device):
    call, _ = owner
    tensor_id, whole = call("create", torch.zeros(64, dtype=torch.float32), device)
    sources = [torch.zeros(4, device=device) for _ in range(pairs)]
    targets = [torch.zeros(4, device=device) for _ in range(pairs)]
    offsets = [32 * i + 16 for i in range(pairs)]
    with (
        peer.prepare("write", sources, [whole] * pairs, offsets) as write,
        peer.prepare("read", targets, [whole] * pairs, offsets) as read,
    ):
        for step in range(1, 6):
            for source in sources:
                source.fill_(step)  # queued on the stream the post is ordered after
            write.post().wait(TIMEOUT)
            got = call("get", tensor_id)
            for offset in offsets:
                assert got[offset // 4 : offset // 4 + 4].tolist() == [step] * 4
            read.post().wait(TIMEOUT)
            assert all(t.cpu().tolist() == [step] * 4 for t in targets)
    call("drop", tensor_id)


@both_modes
@pytest.mark.parametrize("how", ["free", "deregister"])
def test_a_prepared_post_after_the_remote_ended_raises(owner, peer, how):
    call, _ = owner
    tensor_id, whole = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    local = torch.zeros(64, device="openreg")
    prepared = peer.prepare("read", [local], [whole])
    prepared.post().wait(TIMEOUT)
    assert local.cpu().tolist() == list(range(64))
    call(how, tensor_id)
    with pytest.raises(p2p.RemoteTensorFreedError, match="freed or deregistered"):
        prepared.post()
    with pytest.raises(p2p.RemoteTensorFreedError):
        prepared.post()  # stays refused
    assert peer.mapped() == 0
    prepared.close()
    call("drop", tensor_id)


@both_modes
def test_a_closed_prepared_transfer_or_connection_refuses_to_post(owner, peer):
    call, _ = owner
    tensor_id, whole = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    with peer.prepare("read", [torch.zeros(64)], [whole]) as prepared:
        prepared.post().wait(TIMEOUT)
    with pytest.raises(ValueError, match="prepared transfer is closed"):
        prepared.post()
    prepared.close()  # idempotent
    kept = peer.prepare("read", [torch.zeros(64, device="openreg")], [whole])
    with pytest.raises(ValueError, match="'read' or 'write'"):
        peer.prepare("READ!", [torch.zeros(64)], [whole])
    peer.close()
    with pytest.raises(ValueError, match="closed"):
        kept.post()
    assert peer.mapped() == 0
    call("drop", tensor_id)


@both_modes
def test_a_prepared_post_is_ordered_after_the_callers_queued_work(owner, peer):
    call, _ = owner
    tensor_id, whole = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    local = torch.zeros(64, device="openreg")
    prepared = peer.prepare("read", [local], [whole])
    prepared.post().wait(TIMEOUT)  # the owner's event waited for once
    minus = torch.full((64,), -1.0, device="openreg")
    with held_stream(torch.accelerator.current_stream(), TIMEOUT):
        local.copy_(minus)  # queued first: the read must land after it
        transfer = prepared.post()
        assert not transfer.done()
    transfer.wait(TIMEOUT)
    assert local.cpu().tolist() == list(range(64))
    prepared.close()
    call("drop", tensor_id)


@both_modes
def test_a_sync_read_is_ordered_after_the_callers_queued_work(owner, peer):
    call, _ = owner
    tensor_id, whole = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    local = torch.zeros(64, device="openreg")
    peer.read(local, whole)  # seen before: the next read takes the short path
    minus = torch.full((64,), -1.0, device="openreg")
    reader = threading.Thread(target=peer.read, args=(local, whole))
    with held_stream(torch.accelerator.current_stream(), TIMEOUT):
        local.copy_(minus)  # queued on the default stream, which the reader's read is on too
        reader.start()
        reader.join(0.05)
        assert reader.is_alive()  # waiting for the held stream, not copied around it
    reader.join(TIMEOUT)
    assert local.cpu().tolist() == list(range(64))
    call("drop", tensor_id)


@pytest.mark.parametrize("device", ["openreg", "cpu"])
def test_the_short_path_copies_into_whichever_local_tensor_it_is_given(owner, peer, device):
    """A descriptor read and written again by the calling thread keeps the last local tensor's
    bytes (found again by its address); another tensor, at another address, gets its own."""
    call, _ = owner
    tensor_id, whole = call("create", torch.arange(64, dtype=torch.float32), "openreg")
    first, second = (torch.zeros(64, device=device) for _ in range(2))
    for _ in range(2):  # the first path (which waits once for the owner's event, if any)
        peer.read(first, whole)
    (plan,) = peer._link._singles.values()  # then the short one is planned
    for value in (1.0, 2.0):  # the same tensor again, the remote changed in between
        peer.write(torch.full((64,), value, device=device), whole)
        peer.read(first, whole)
        assert first.cpu().tolist() == [value] * 64
        assert plan.last[0] == first.data_ptr()  # its bytes were kept, then reused
    peer.read(second, whole)
    assert second.cpu().tolist() == [2.0] * 64 and plan.last[0] == second.data_ptr()
    peer.write(torch.arange(64, dtype=torch.float32, device=device), whole)
    peer.read(first, whole)
    assert first.cpu().tolist() == list(range(64))
    peer.write(second, whole)  # the write takes the local tensor's bytes too, not the last
    assert call("get", tensor_id).tolist() == [2.0] * 64
    call("drop", tensor_id)
