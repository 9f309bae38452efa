"""devipc.p2p through NIXL (`Endpoint(transport="nixl")`): two processes, UCX over TCP loopback.
Skipped, with the reason, where NIXL is not installed; the error without it is tested anyway."""

import types

import _p2p_workers
import pytest
import torch
from _support import TIMEOUT, nixl_missing, open_fds, recv, run_python, use_ucx_loopback, wait_until

import devipc.p2p as p2p
from devipc import InvalidHandleError, PeerGoneError, UnsupportedDeviceError
from devipc._core._errors import RemoteTensorFreedError, TransferSizeError

NIXL = nixl_missing()
needs_nixl = pytest.mark.skipif(NIXL is not None, reason=f"NIXL is not installed ({NIXL})")


@pytest.fixture
def loopback(monkeypatch):
    """Two endpoints of this host reach each other as across hosts."""
    import devipc_openreg  # noqa: F401 - openreg tensors in this process too

    use_ucx_loopback(monkeypatch)


@pytest.fixture
def owner(children, loopback):
    """(control pipe, connection to it): a child whose endpoint goes through NIXL."""
    proc, conn = children.start_piped(_p2p_workers.owner, "nixl")
    ready, _, metadata = recv(conn)
    assert ready == "ready"
    endpoint = p2p.Endpoint(transport="nixl")
    try:
        yield conn, endpoint.connect(metadata)
        conn.send(("exit",))
        assert recv(conn) == "bye"
    finally:
        endpoint.close()


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x41]) + data[at + 1 :]


def ask(conn, *command):
    conn.send(command)
    return recv(conn)


@needs_nixl
@pytest.mark.parametrize("device", ["openreg", "cpu"])
def test_read_and_write_whole_tensors_and_byte_ranges(owner, device):
    conn, connection = owner
    values = torch.arange(256, dtype=torch.float32)
    tensor_id, whole = ask(conn, "create", values, device)
    local = torch.zeros(256, dtype=torch.float32, device="openreg")
    connection.read(local, whole)
    assert torch.equal(local.cpu(), values)
    part = ask(conn, "advertise", tensor_id, 16 * 4, 8 * 4)  # elements 16..23
    small = torch.zeros(8, dtype=torch.float32)  # a CPU tensor devipc never registered
    connection.read(small, part)
    assert torch.equal(small, values[16:24])
    connection.write(torch.full((8,), -1.0), part)
    connection.write(
        torch.full((4,), 7, dtype=torch.int64, device="openreg"),
        ask(conn, "advertise", tensor_id, 0, 32),
    )
    expected = values.clone()
    expected[16:24] = -1.0
    expected[:8] = torch.full((4,), 7, dtype=torch.int64).view(torch.float32)
    assert torch.equal(ask(conn, "get", tensor_id), expected)


@needs_nixl
def test_readv_writev_and_async_transfers(owner):
    conn, connection = owner
    values = torch.arange(4096, dtype=torch.int32)
    tensor_id, _ = ask(conn, "create", values, "openreg")
    other_id, other = ask(conn, "create", torch.arange(100, dtype=torch.uint8), "cpu")
    ranges = [ask(conn, "advertise", tensor_id, i * 1024, 512) for i in range(16)] + [other]
    locals_ = [torch.zeros(128, dtype=torch.int32, device="openreg") for _ in range(16)]
    locals_.append(torch.zeros(100, dtype=torch.uint8))
    connection.readv(locals_, ranges)
    for i in range(16):
        assert torch.equal(locals_[i].cpu(), values[i * 256 : i * 256 + 128])
    assert torch.equal(locals_[16], torch.arange(100, dtype=torch.uint8))
    connection.writev([t * 0 + 9 for t in locals_], ranges)
    got = ask(conn, "get", tensor_id).view(16, 256)
    assert (got[:, :128] == 9).all() and torch.equal(got[:, 128:], values.view(16, 256)[:, 128:])
    assert (ask(conn, "get", other_id) == 9).all()
    transfer = connection.read_async(locals_[0], ranges[1])
    transfer.wait(TIMEOUT)
    assert transfer.done() and torch.equal(locals_[0].cpu(), torch.full((128,), 9))
    transfer = connection.writev_async(locals_[:2], ranges[2:4])
    transfer.wait(TIMEOUT)
    assert transfer.done()


@needs_nixl
@pytest.mark.parametrize("how", ["deregister", "drop"])
def test_ending_a_registration_undoes_the_nixl_registration_and_peers_see_it(owner, how):
    conn, connection = owner
    tensor_id, whole = ask(conn, "create", torch.ones(64), "openreg")
    local = torch.zeros(64)
    connection.read(local, whole)
    assert ask(conn, "registered", tensor_id) is True
    if how == "deregister":
        assert ask(conn, "deregister", tensor_id) is True
    else:
        assert ask(conn, "drop", tensor_id) == "ok"  # the garbage collector ends it
    assert ask(conn, "registered", tensor_id) is False  # NIXL's agent no longer has it
    with pytest.raises(RemoteTensorFreedError, match="freed or deregistered"):
        connection.read(local, whole)
    with pytest.raises(RemoteTensorFreedError):
        connection.write(local, whole)
    tensor_id, whole = ask(conn, "create", torch.full((64,), 3.0), "openreg")
    connection.read(local, whole)  # a registration made after connecting: reached as well
    assert (local == 3).all()


@needs_nixl
@pytest.mark.parametrize("watcher", ["stopped at exit", "failed to start"])
def test_a_large_transfer_ends_when_the_watcher_does_not_run(owner, monkeypatch, watcher):
    """A transfer of WATCHED_FROM bytes or more is polled by the watcher thread; when that does
    not run (stopped at interpreter exit, say a last pull in an atexit handler, or its thread
    failed to start), its waiter polls it itself instead of waiting forever."""
    from devipc._core import _background
    from devipc.p2p import _nixl

    idle = _background.Background("devipc-test-watcher", _nixl._watch_round, share=None)
    if watcher == "stopped at exit":
        idle._stop_at_exit()
    else:

        def fail(*_):
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(_background, "_thread", types.SimpleNamespace(start_new_thread=fail))
    monkeypatch.setattr(_nixl, "_watcher", idle)
    conn, connection = owner
    values = torch.arange(_nixl.WATCHED_FROM // 4, dtype=torch.int32)
    _, whole = ask(conn, "create", values, "cpu")
    local = torch.zeros_like(values)
    transfer = connection.read_async(local, whole)
    transfer.wait(TIMEOUT)  # before the fix: TimeoutError
    assert transfer.done() and torch.equal(local, values)
    assert not idle.running()
    local.zero_()
    transfer = connection.read_async(local, whole)
    wait_until(transfer.done, "a large transfer polled through done()")
    assert torch.equal(local, values)


@needs_nixl
def test_a_repeated_synchronous_copy_reposts_nixl_requests_prepared_once(owner, monkeypatch):
    """Issue 47, item 8: `read`/`write` of a registered local tensor and a descriptor seen
    before repost the NIXL requests prepared at the first call (NIXL's own prepared transfer),
    instead of a new request per call; what ends on either side is still seen."""
    from devipc.p2p import _nixl

    conn, connection = owner
    values = torch.arange(1024, dtype=torch.float32)
    tensor_id, whole = ask(conn, "create", values, "openreg")
    local, local_id = p2p.create_tensor((1024,), torch.float32, "openreg")
    requests = []
    request = _nixl.NixlTransport._request
    monkeypatch.setattr(
        _nixl.NixlTransport, "_request", lambda *args: requests.append(args[1]) or request(*args)
    )
    for step in range(20):
        local.fill_(-1.0)
        connection.read(local, whole)
        assert torch.equal(local.cpu(), values), step
        values += 1
        connection.write(local + 1, whole)  # a new tensor each time: its own request
        local.copy_(values)
        connection.write(local, whole)
    assert torch.equal(ask(conn, "get", tensor_id), values)
    assert requests.count("READ") <= 2 * 20, requests  # the liveness reads of the new tensors
    transport = connection._endpoint._transport
    kept = len(transport._again)
    assert kept == 2, transport._again  # read and write of (local, whole)
    p2p.deregister(local_id)  # its pairs go with its NIXL registration
    assert len(transport._again) == 0
    connection.read(local, whole)  # the full path, memory registered for the transfer
    assert torch.equal(local.cpu(), values)
    assert ask(conn, "deregister", tensor_id) is True
    again, _ = p2p.create_tensor((1024,), torch.float32, "openreg")
    connection.read(again, ask(conn, "create", values, "openreg")[1])
    with pytest.raises(RemoteTensorFreedError, match="freed or deregistered"):
        connection.read(again, whole)
    connection.close()
    assert len(transport._again) == 0, "the peer's agent unloaded: its prepared pairs go too"


@needs_nixl
def test_a_strided_view_of_a_prepared_pair_is_refused_not_reposted(owner):
    """Review of issue 47, item 8: a transposed view has the address and size of the tensor
    whose read was prepared; it must get the full path's refusal, not that request's bytes."""
    conn, connection = owner
    _, whole = ask(conn, "create", torch.arange(16, dtype=torch.float32), "openreg")
    local, local_id = p2p.create_tensor((4, 4), torch.float32, "openreg")
    for _ in range(2):
        connection.read(local, whole)  # the second prepares the pair (local, whole)
    with pytest.raises(ValueError, match="contiguous"):
        connection.read(local.t(), whole)
    p2p.deregister(local_id)


@needs_nixl
@pytest.mark.parametrize("busy", [False, True])
def test_a_storage_resized_after_its_advertisement_is_never_reached_again(owner, busy):
    """Over NIXL as over IPC: resize_ ends the registration (its old memory stays registered and
    allocated until then), so a peer never reads or writes the tensor that takes the old block.
    Busy: the owner's collector thread runs late between the registration's end, that peers see
    at once, and NIXL's deregistration."""
    conn, connection = owner
    if busy:
        assert ask(conn, "hear_late", 0.5) == "ok"
    tensor_id, whole = ask(conn, "create", torch.zeros(1024), "openreg")
    local = torch.zeros(1024)
    connection.read(local, whole)
    assert ask(conn, "resize", tensor_id, 256) == "ok"
    neighbour_id, _ = ask(conn, "create", torch.arange(1024.0), "openreg")

    def freed():
        try:
            connection.read(local, whole)
        except RemoteTensorFreedError:
            return True
        return False

    wait_until(freed, "the resized registration ended")
    with pytest.raises(RemoteTensorFreedError):
        connection.write(torch.full((1024,), -1.0), whole)
    assert torch.equal(ask(conn, "get", neighbour_id), torch.arange(1024.0))
    wait_until(
        lambda: ask(conn, "registered", tensor_id) is False,  # peers stopped first
        "NIXL's agent let go of the resized registration's memory",
    )
    refused = ask(conn, "advertise", tensor_id, 0, None)
    assert isinstance(refused, p2p.NotRegisteredError)


@needs_nixl
def test_sub_ranges_and_prepared_transfers(owner):
    conn, connection = owner
    values = torch.arange(64, dtype=torch.float32)
    tensor_id, _ = ask(conn, "create", values, "openreg")
    part = ask(conn, "advertise", tensor_id, 32 * 4, 16 * 4)  # elements 32..47
    four = torch.zeros(4, device="openreg")
    connection.read(four, part, offset=8 * 4)
    assert four.cpu().tolist() == [40.0, 41.0, 42.0, 43.0]
    connection.write(torch.full((2,), -1.0), part, offset=14 * 4)  # the advertised range's end
    with pytest.raises(TransferSizeError, match="not inside"):
        connection.read(four, part, offset=13 * 4)
    sources, targets = [torch.zeros(4), torch.zeros(2)], [torch.zeros(4), torch.zeros(2)]
    with (
        connection.prepare("write", sources, [part, part], offsets=[0, 40]) as write,
        connection.prepare("read", targets, [part, part], offsets=[0, 40]) as read,
    ):
        for step in range(1, 4):
            for source in sources:
                source.fill_(step)
            write.post().wait(TIMEOUT)
            read.post().wait(TIMEOUT)
            assert [t.tolist() for t in targets] == [[step] * 4, [step] * 2]
    expected = values.clone()
    expected[32:36], expected[42:44], expected[46:48] = 3.0, 3.0, -1.0
    assert torch.equal(ask(conn, "get", tensor_id), expected)
    with pytest.raises(ValueError, match="closed"):
        read.post()
    prepared = connection.prepare("read", [four], [part], offsets=[4])
    prepared.post().wait(TIMEOUT)
    assert ask(conn, "deregister", tensor_id) is True
    with pytest.raises(RemoteTensorFreedError, match="freed or deregistered"):
        prepared.post()
    prepared.close()


@needs_nixl
def test_closing_the_last_connection_to_a_peer_unloads_its_agent(children, loopback):
    proc, conn = children.start_piped(_p2p_workers.owner, "nixl")
    _, _, metadata = recv(conn)
    _, whole = ask(conn, "create", torch.ones(64), "openreg")
    with p2p.Endpoint(transport="nixl") as endpoint:
        first, second = endpoint.connect(metadata), endpoint.connect(metadata)
        loaded = endpoint._transport._peers
        local = torch.zeros(64)
        first.read(local, whole)
        (agent,) = loaded
        first.close()
        assert agent in loaded  # the second connection still uses it
        second.read(local, whole)
        del second  # dropped without close(): its finalizer lets go as close() would
        assert agent not in loaded
    ask(conn, "exit")


@needs_nixl
def test_bad_input_is_a_clear_error(owner):
    conn, connection = owner
    _, whole = ask(conn, "create", torch.ones(64), "openreg")
    with pytest.raises(TransferSizeError):
        connection.read(torch.zeros(63), whole)
    with pytest.raises(InvalidHandleError):
        connection.read(torch.zeros(64), whole[:-3])
    from devipc.p2p._descriptor import Descriptor, Metadata

    desc = Descriptor.from_bytes(whole)
    damaged = [b"", desc.extra[:-1], desc.extra[:20], b"DVIP" + bytes(40)]
    damaged += [flip(desc.extra, at) for at in range(0, len(desc.extra), 7)]  # NIXL's blob too
    for extra in damaged:
        forged = Descriptor(**{**desc.__dict__, "extra": extra}).to_bytes()
        with pytest.raises(InvalidHandleError):
            connection.read(torch.zeros(64), forged)
    with pytest.raises(ValueError, match="contiguous"):
        connection.read(torch.zeros(64, 2)[:, 0], whole)
    with pytest.raises(ValueError, match="cannot map"):  # across hosts: read a copy
        connection.map(whole)
    with p2p.Endpoint() as ipc, p2p.Endpoint(transport="nixl") as nixl:
        with pytest.raises(ValueError, match="transport"):  # a NIXL peer, an IPC endpoint
            ipc.connect(nixl.metadata())
        meta = Metadata.from_bytes(nixl.metadata())
        for at in range(0, len(meta.extra), 5):  # damaged bytes never reach NIXL's parser
            damaged = Metadata(**{**meta.__dict__, "extra": flip(meta.extra, at)}).to_bytes()
            with pytest.raises(InvalidHandleError):
                nixl.connect(damaged)


@needs_nixl
def test_a_killed_peer_is_a_clear_error_not_a_hang(children, loopback):
    proc, conn = children.start_piped(_p2p_workers.owner, "nixl")
    _, _, metadata = recv(conn)
    with p2p.Endpoint(transport="nixl") as endpoint:
        connection = endpoint.connect(metadata)
        _, whole = ask(conn, "create", torch.ones(1 << 16), "cpu")
        local = torch.zeros(1 << 16)
        connection.read(local, whole)
        proc.kill()
        proc.join(TIMEOUT)
        with pytest.raises(PeerGoneError):
            connection.read(local, whole)


@needs_nixl
def test_a_device_whose_hooks_name_no_memory_kind_is_refused(loopback, monkeypatch):
    from devipc_openreg._ipc_hooks import OpenRegIpcHooks

    monkeypatch.setattr(OpenRegIpcHooks, "memory_kind", lambda self, index: None)
    tensor, tensor_id = p2p.create_tensor((16,), torch.float32, "openreg")
    try:
        with p2p.Endpoint(transport="nixl") as endpoint:
            with pytest.raises(UnsupportedDeviceError, match="memory_kind"):
                endpoint.advertise(tensor)
            with p2p.Endpoint() as ipc:  # the same-host path does not need a kind
                ipc.advertise(tensor)
    finally:
        p2p.deregister(tensor_id)


def test_without_nixl_the_error_says_how_to_install_it():
    """Runs everywhere: NIXL hidden from a fresh interpreter."""
    out = run_python(
        "import sys\n"
        "for name in ('nixl', 'nixl_cu12', 'nixl_cu13'):\n"
        "    sys.modules[name] = None  # import fails as if not installed\n"
        "import torch, devipc.p2p as p2p\n"
        "p2p.Endpoint().close()  # the same-host path needs nothing more\n"
        "try:\n"
        "    p2p.Endpoint(transport='nixl')\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    ).stdout
    assert "pip install 'devipc[nixl]'" in out


@needs_nixl
def test_closed_endpoints_leave_no_descriptors_or_registrations(loopback):
    """Two NIXL endpoints of one process reach each other too; closing them gives back every fd
    (NIXL's and UCX's first use in a process keeps some: that is taken before counting)."""
    tensor, tensor_id = p2p.create_tensor((1024,), torch.float32, "openreg")
    try:
        p2p.Endpoint(transport="nixl").close()
        before = open_fds()
        for _ in range(3):
            with p2p.Endpoint(transport="nixl") as owner, p2p.Endpoint(transport="nixl") as peer:
                tensor.fill_(2.0)
                local = torch.zeros(1024, device="openreg")
                peer.connect(owner.metadata()).read(local, owner.advertise(tensor))
                assert (local == 2).all()
                transport = owner._transport
            assert transport._ranges == [] and transport.agent is None
        assert open_fds() == before
    finally:
        p2p.deregister(tensor_id)
