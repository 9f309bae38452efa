"""Endpoints across spawned processes, in both openreg IPC modes: one-sided reads and writes of
whole tensors and byte ranges, dtypes, strided local tensors, vectors, async transfers, several
peers; a freed, deregistered or collected remote tensor raises and its mapping is closed; a
SIGKILLed owner gives a clear error and leaves nothing behind."""

import array
import os
import sys

import _p2p_workers
import _workers
import pytest
import torch
from _support import TIMEOUT, Children, foreign_memfd_maps, open_fds, recv, wait_until

import devipc
import devipc.p2p as p2p
from devipc.p2p import _remote
from devipc.p2p._registry import PAGE_LIFELINE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "openreg"))
from _native import held_stream

both_modes = pytest.mark.usefixtures("ipc_mode")
pytestmark = pytest.mark.xdist_group("p2p_endpoint")  # one worker starts the module's `owner`


class Owner:
    """A spawned process that registers tensors and advertises them when asked."""

    def __init__(self, children: Children):
        self.proc, self.conn = children.start_piped(_p2p_workers.owner)
        ready, self.pid, self.metadata = recv(self.conn)
        assert ready == "ready"

    def call(self, *command):
        self.conn.send(command)
        return recv(self.conn)


@pytest.fixture(scope="module")
def owner():
    group = Children()
    try:
        yield Owner(group)
    finally:
        group.reap()


@pytest.fixture
def peer(owner, ipc_mode):
    """A fresh endpoint here connected to the owner, both in this test's IPC mode."""
    owner.call("env", "OPENREG_IPC_EVENTS", os.environ["OPENREG_IPC_EVENTS"])
    with p2p.Endpoint() as endpoint:
        yield endpoint.connect(owner.metadata)


def _settle():
    """Run the releases that waited for device work."""
    torch.accelerator.synchronize()
    wait_until(lambda: devipc.stats()["pending_releases"] == 0, "releases done", collect=True)


def _owner_idle(owner: Owner) -> None:
    """Wait until the owner holds no export, send or registration (its counter file and cached
    device memory stay)."""
    wait_until(
        lambda: (lambda s: (s["exports"], s["sent"], s["live"]))(owner.call("stats")) == (0, 0, 0),
        "the owner holds no exports, sends or registrations",
    )


def _shm_maps() -> int:
    """Mappings of torch's CPU shared memory files (the owner's CPU tensors) in this process."""
    with open("/proc/self/maps") as maps:
        return sum("/torch_" in line for line in maps)


PLACES = [("openreg", "openreg"), ("cpu", "cpu"), ("openreg", "cpu"), ("cpu", "openreg")]


@both_modes
@pytest.mark.parametrize("remote_device,local_device", PLACES)
def test_read_and_write_whole_tensors_and_byte_ranges(owner, peer, remote_device, local_device):
    values = torch.arange(64, dtype=torch.float32)
    tensor_id, whole = owner.call("create", values, remote_device)
    local = torch.zeros(64, device=local_device)
    peer.read(local, whole)
    assert torch.equal(local.cpu(), values)
    part = owner.call("advertise", tensor_id, 16, 32)  # floats 4..11
    middle = torch.zeros(8, device=local_device)
    peer.read(middle, part)
    assert middle.cpu().tolist() == list(range(4, 12))
    peer.write(torch.full((8,), -1.0, device=local_device), part)
    expected = values.clone()
    expected[4:12] = -1
    assert torch.equal(owner.call("get", tensor_id), expected)
    peer.write(torch.zeros(64, device=local_device), whole)
    assert not owner.call("get", tensor_id).any()
    owner.call("drop", tensor_id)


@both_modes
def test_device_transfers_are_queued_on_the_callers_current_stream(owner, peer):
    _settle()  # releases of earlier tests' mappings (closing one waits for the device) first
    tensor_id, whole = owner.call("create", torch.arange(16, dtype=torch.float32), "openreg")
    local = torch.zeros(16, device="openreg")
    hundreds = torch.full((16,), 100.0, device="openreg")
    with held_stream(torch.accelerator.current_stream(), TIMEOUT):
        local.copy_(hundreds)  # the caller's own work (asynchronous), queued first
        transfer = peer.read_async(local, whole)
        assert not transfer.done()  # queued behind the gate, behind add_
        with pytest.raises(TimeoutError):
            transfer.wait(0.01)
    transfer.wait(TIMEOUT)
    assert transfer.done() and local.cpu().tolist() == list(range(16))  # read after copy_
    owner.call("drop", tensor_id)


@both_modes
def test_a_transfer_dropped_in_flight_keeps_the_peers_memory_until_its_copy_ran(owner, peer):
    """Queued on a stream of its own, dropped without wait(), its registration ended and the
    connection closed: the mapping it copies from is released only once the copy ran."""
    _settle()
    tensor_id, whole = owner.call("create", torch.arange(16, dtype=torch.float32), "openreg")
    local = torch.zeros(16, device="openreg")
    peer.read(local, whole)  # mapped while the default stream is current
    local.zero_()
    side = torch.Stream(device="openreg")  # neither the stream it was mapped on nor ours
    with held_stream(side, TIMEOUT) as gate:
        with side:
            peer.read_async(local, whole)  # dropped at once
        owner.call("drop", tensor_id)  # the owner lets go: only this process keeps its memory
        peer.close()  # the mapping goes, but for the transfer's copy
        devipc.ipc_collect()
        assert devipc.stats()["pending_releases"] >= 1  # not released under the queued copy
        gate.open()
        side.synchronize()
    _settle()  # now it goes
    assert local.cpu().tolist() == list(range(16))
    _owner_idle(owner)


@both_modes
@pytest.mark.parametrize("device", ["openreg", "cpu"])
def test_dtypes_cross_bit_for_bit(owner, peer, device):
    generator = torch.Generator().manual_seed(0)
    for dtype in (
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int8,
        torch.bool,
        torch.complex64,
        torch.uint8,
    ):
        values = (torch.randn(3, 5, generator=generator) * 100).to(dtype)
        tensor_id, whole = owner.call("create", values, device)
        local = torch.empty(3, 5, dtype=dtype, device=device)
        peer.read(local, whole)
        assert torch.equal(local.cpu(), values), dtype
        peer.write(torch.ones(3, 5, dtype=dtype, device=device), whole)
        assert torch.equal(owner.call("get", tensor_id), torch.ones(3, 5, dtype=dtype))
        owner.call("drop", tensor_id)


@both_modes
@pytest.mark.parametrize("device", ["openreg", "cpu"])
def test_non_contiguous_local_tensors(owner, peer, device):
    values = torch.arange(32, dtype=torch.float32).view(4, 8)
    tensor_id, whole = owner.call("create", values, device)
    strided = torch.zeros(8, 4, device=device).t()  # 4 x 8, not contiguous
    assert not strided.is_contiguous()
    peer.read(strided, whole)
    assert torch.equal(strided.cpu(), values)
    peer.write(strided * 2, whole)  # contiguous
    peer.write((torch.arange(32.0, device=device).view(8, 4) * 3).t(), whole)  # strided
    assert torch.equal(owner.call("get", tensor_id), (torch.arange(32.0).view(8, 4) * 3).t())
    odd = owner.call("advertise", tensor_id, 2, 16)
    with pytest.raises(p2p.TransferSizeError, match="aligned"):
        peer.read(torch.zeros(2, 2, device=device).t(), odd)
    contiguous = torch.zeros(16, dtype=torch.uint8, device=device)
    peer.read(contiguous, odd)  # bytes: any offset
    now = owner.call("get", tensor_id).contiguous().view(-1).view(torch.uint8)
    assert contiguous.cpu().tolist() == now[2:18].tolist()
    strided_bytes = torch.zeros(8, 2, dtype=torch.uint8, device=device).t()  # 2 x 8
    peer.read(strided_bytes, odd)
    assert strided_bytes.cpu().tolist() == now[2:18].view(2, 8).tolist()
    owner.call("drop", tensor_id)


@both_modes
@pytest.mark.parametrize("device", ["openreg", "cpu"])
def test_vectors_and_async_transfers(owner, peer, device):
    values = torch.arange(1024, dtype=torch.int32)
    tensor_id, _ = owner.call("create", values, device)
    ranges = [owner.call("advertise", tensor_id, 16 * i, 16) for i in range(64)]
    locals_ = [torch.zeros(4, dtype=torch.int32, device=device) for _ in ranges]
    peer.readv(locals_, ranges)
    assert torch.equal(torch.cat([t.cpu() for t in locals_]), values[:256])
    transfer = peer.writev_async([t + 1 for t in locals_], ranges)
    transfer.wait(timeout=TIMEOUT)
    assert transfer.done()
    assert torch.equal(owner.call("get", tensor_id)[:256], values[:256] + 1)
    one = torch.zeros(4, dtype=torch.int32, device=device)
    transfer = peer.read_async(one, ranges[3])
    transfer.wait(TIMEOUT)
    assert transfer.done() and one.cpu().tolist() == [13, 14, 15, 16]
    peer.write_async(one * 0, ranges[3]).wait(TIMEOUT)
    assert owner.call("get", tensor_id)[12:16].tolist() == [0] * 4
    later = peer.readv_async(locals_[:2], ranges[:2])
    later.wait()
    assert later.done()
    with pytest.raises(ValueError, match="2 local tensors for 1 remote"):
        peer.readv(locals_[:2], ranges[:1])
    with pytest.raises(p2p.TransferSizeError, match="8 bytes, the remote range 16"):
        peer.read(torch.zeros(2, dtype=torch.int32, device=device), ranges[0])
    with pytest.raises(TypeError, match="torch.Tensor"):
        peer.read([0, 0, 0, 0], ranges[0])
    owner.call("drop", tensor_id)


@both_modes
@pytest.mark.parametrize("device", ["openreg", "cpu"])
@pytest.mark.parametrize("how", ["free", "deregister", "drop"])
def test_a_freed_remote_tensor_raises_and_its_mapping_is_closed(owner, peer, device, how):
    _settle()
    _owner_idle(owner)
    mapped, maps, shm_maps = devipc.stats()["mapped"], foreign_memfd_maps(), _shm_maps()
    tensor_id, whole = owner.call("create", torch.arange(256, dtype=torch.float32), device)
    local = torch.zeros(256, device=device)
    peer.read(local, whole)
    assert peer.mapped() == 1
    if device == "openreg":
        assert devipc.stats()["mapped"] == mapped + 1
    else:
        assert _shm_maps() == shm_maps + 1
    assert owner.call(how, tensor_id) in ("ok", True)
    with pytest.raises(p2p.RemoteTensorFreedError, match="freed or deregistered"):
        peer.read(local, whole)
    with pytest.raises(p2p.RemoteTensorFreedError):
        peer.write(local, whole)  # stays refused, never touches the memory
    assert peer.mapped() == 0
    _settle()
    assert devipc.stats()["mapped"] == mapped
    assert _shm_maps() == shm_maps
    assert foreign_memfd_maps() <= maps
    if how != "drop":  # the owner's tensor is still alive there: drop it too
        owner.call("drop", tensor_id)
    _owner_idle(owner)


@both_modes
@pytest.mark.parametrize("device", ["openreg", "cpu"])
def test_a_mapped_range_is_the_owners_memory_and_outlives_its_free(owner, peer, device):
    """`map` gives the advertised range itself, no copy: writes cross both ways; once the owner
    freed the tensor the mapping still holds the memory (reads through the connection are
    refused), and it lets go when its tensor dies."""
    _settle()
    _owner_idle(owner)
    mapped, maps, shm_maps = devipc.stats()["mapped"], foreign_memfd_maps(), _shm_maps()
    tensor_id, _ = owner.call("create", torch.arange(64, dtype=torch.float32), device)
    part = owner.call("advertise", tensor_id, 16, 32)  # floats 4..11
    view = peer.map(part)
    assert (view.dtype, view.nbytes, view.device.type) == (torch.uint8, 32, device)
    floats = view.view(torch.float32)
    assert floats.cpu().tolist() == list(range(4, 12))
    floats[:2] = -1.0  # this process writes, the owner sees it
    torch.accelerator.synchronize()
    assert owner.call("get", tensor_id)[2:8].tolist() == [2, 3, -1, -1, 6, 7]
    peer.write(torch.full((8,), 9.0, device=device), part)  # the owner's memory changes
    assert floats.cpu().tolist() == [9.0] * 8
    owner.call("drop", tensor_id)
    with pytest.raises(p2p.RemoteTensorFreedError):
        peer.read(torch.zeros(8, device=device), part)
    assert floats.cpu().tolist() == [9.0] * 8  # still mapped, still the last bytes
    del view, floats
    _settle()
    _owner_idle(owner)
    assert devipc.stats()["mapped"] <= mapped
    assert _shm_maps() == shm_maps
    assert foreign_memfd_maps() <= maps


@pytest.mark.parametrize("liveness", ["lifeline", "pidfd"])
def test_the_owner_killed_gives_a_clear_error_and_leaves_nothing(children, monkeypatch, liveness):
    """Peers learn the owner's death from its lifeline word, or from its pidfd where the owner's
    page has none (another C library): read here as a header word that is always 0."""
    monkeypatch.setenv("OPENREG_IPC_EVENTS", "1")  # the owner's events: pages of its own too
    if liveness == "pidfd":
        monkeypatch.setattr(_remote, "PAGE_LIFELINE", PAGE_LIFELINE - 1)
    _settle()
    owner = Owner(children)  # its pipe and sentinel stay open until the test ends
    local = torch.zeros(64, device="openreg")  # this process's own device memory, cached
    _, on_device = owner.call("create", torch.arange(64, dtype=torch.float32), "openreg")
    _, on_cpu = owner.call("create", torch.arange(64, dtype=torch.float32), "cpu")
    # (sending CPU tensors through the pipe started multiprocessing's fd-passing socket)
    fds, maps, mapped = open_fds(), foreign_memfd_maps(), devipc.stats()["mapped"]
    endpoint = p2p.Endpoint()
    connection = endpoint.connect(owner.metadata)
    assert bool(connection._link._peer._lifeline) == (liveness == "lifeline")
    connection.read(local, on_device)
    connection.read(torch.zeros(64), on_cpu)
    owner.proc.kill()
    owner.proc.join(TIMEOUT)
    with pytest.raises(p2p.PeerGoneError, match=f"{owner.pid} has exited"):
        connection.read(local, on_device)
    assert connection.mapped() == 0
    with pytest.raises(p2p.PeerGoneError):
        endpoint.connect(owner.metadata)
    endpoint.close()
    _settle()
    assert devipc.stats()["mapped"] == mapped
    wait_until(lambda: foreign_memfd_maps() <= maps, "no mapping of the dead owner's memory")
    wait_until(lambda: open_fds() <= fds, "no descriptor left")


def test_an_owner_whose_lifeline_was_never_marked_is_still_found_dead(children):
    """The OOM killer's reaper may free a dying process's memory before the kernel walks its
    robust list, so its lifeline word may never be marked: the pidfd, polled every
    _POLL_EVERY reads of the word, still finds the owner dead."""
    owner = Owner(children)
    _, remote = owner.call("create", torch.arange(64, dtype=torch.float32), "openreg")
    local = torch.zeros(64, device="openreg")
    with p2p.Endpoint() as endpoint:
        connection = endpoint.connect(owner.metadata)
        connection.read(local, remote)
        peer = connection._link._peer
        assert peer._lifeline
        peer._head = memoryview(array.array("q", [peer._lifeline]))  # a word left unmarked
        owner.proc.kill()
        owner.proc.join(TIMEOUT)
        with pytest.raises(p2p.PeerGoneError, match=f"{owner.pid} has exited"):
            for _ in range(_remote._POLL_EVERY):
                connection.read(local, remote)  # the short path, on the word: still copies
        assert connection.mapped() == 0


def test_several_peers_at_once(children):
    """Two spawned peers and this process's own connection write and read one tensor."""
    peers = 2
    tensor, tensor_id = p2p.create_tensor(((peers + 1) * 64,), torch.uint8, "openreg")
    tensor.zero_()
    with p2p.Endpoint() as endpoint:
        whole = endpoint.advertise(tensor)
        pipes = [
            children.start_piped(
                _p2p_workers.peer,
                endpoint.metadata(),
                whole,
                endpoint.advertise(tensor_id, 64 * i, 64),
                i + 1,
            )[1]
            for i in range(peers)
        ]
        ourselves = endpoint.connect(endpoint.metadata())
        ourselves.write(
            torch.full((64,), peers + 1, dtype=torch.uint8, device="openreg"),
            endpoint.advertise(tensor_id, 64 * peers, 64),
        )
        assert [recv(pipe) for pipe in pipes] == ["written"] * peers
        expected = [i + 1 for i in range(peers + 1) for _ in range(64)]
        assert tensor.cpu().tolist() == expected
        for pipe in pipes:
            pipe.send("read")
        assert [recv(pipe) for pipe in pipes] == [expected] * peers
        mine = torch.empty_like(tensor)
        ourselves.read(mine, whole)
        assert mine.cpu().tolist() == expected
        for pipe in pipes:
            pipe.send("exit")
        children.join_ok()
    del tensor
    wait_until(
        lambda: devipc.stats()["exports"] == 0,
        "the peers' slots ended after they exited",
        collect=True,
    )


def test_a_peer_killed_while_it_maps_the_memory_leaves_nothing_held(children):
    """The owner frees a tensor that a SIGKILLed peer had opened: the core reclaims the dead
    peer's slot, and the memory goes."""
    tensor, _ = p2p.create_tensor((4096,), torch.uint8, "openreg")
    tensor.fill_(1)
    memory = torch.accelerator.memory_allocated()
    with p2p.Endpoint() as endpoint:
        proc, pipe = children.start_piped(
            _p2p_workers.read_and_wait, endpoint.metadata(), endpoint.advertise(tensor)
        )
        assert recv(pipe) == 4096
        proc.kill()
        proc.join(TIMEOUT)
        p2p.free_tensor(tensor)
        del tensor
        wait_until(
            lambda: devipc.stats()["exports"] == 0,
            "the dead peer's slot was reclaimed and the export ended",
            collect=True,
        )
    assert torch.accelerator.memory_allocated() < memory


def _freed(peer, local, descriptor) -> bool:
    try:
        peer.read(local, descriptor)
    except p2p.RemoteTensorFreedError:
        return True
    return False


@both_modes
def test_a_resized_registration_ends_and_its_old_memory_is_never_reused(owner, peer):
    """Register, resize_ the storage 4096 -> 256 bytes, advertise: the registration ended (its
    descriptor would cover memory the storage no longer has), and a peer's writes through an
    older descriptor never reach another tensor of the owner."""
    tensor_id, whole = owner.call("create", torch.zeros(1024), "openreg")
    local = torch.empty(1024, device="openreg")
    peer.read(local, whole)  # the peer maps the registration's memory
    owner.call("resize", tensor_id, 256)
    refused = owner.call("advertise", tensor_id, 0, None)
    assert isinstance(refused, p2p.NotRegisteredError) and "resized" in str(refused)
    neighbour_id, _ = owner.call("create", torch.arange(1024.0), "openreg")
    with pytest.raises(p2p.RemoteTensorFreedError):
        peer.write(torch.full((1024,), -1.0, device="openreg"), whole)
    assert torch.equal(owner.call("get", neighbour_id), torch.arange(1024.0))
    # Resized with no advertisement after it: the collector ends the registration by itself.
    other_id, other = owner.call("create", torch.ones(1024), "openreg")
    peer.read(local, other)
    owner.call("resize", other_id, 0)
    wait_until(lambda: _freed(peer, local, other), "the resized registration ended")
    assert torch.equal(owner.call("get", neighbour_id), torch.arange(1024.0))
    for dropped in (tensor_id, neighbour_id, other_id):
        owner.call("drop", dropped)
    _settle()
    _owner_idle(owner)


def test_the_modules_owner_waits_for_its_next_command_however_long_the_tests_between_take(children):
    """One owner serves the whole module: a slow test between two commands must not find it
    gone (its bound is cut to 0.2 s here)."""
    ours, theirs = children.ctx.Pipe()
    proc = children.start(_workers.with_short_bounds, _p2p_workers.owner, theirs)
    assert recv(ours)[0] == "ready"
    proc.join(2)
    assert proc.is_alive(), "the owner left before its next command"
    ours.send(("stats",))
    assert recv(ours)["live"] == 0
    ours.send(("exit",))
    assert recv(ours) == "bye"
