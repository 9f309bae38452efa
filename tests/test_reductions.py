"""torch.multiprocessing integration: what crosses a Queue, and what stays torch's."""

import dataclasses
import pickle
import socket
import textwrap
import warnings
from multiprocessing.reduction import ForkingPickler

import _workers
import pytest
import torch
import torch.multiprocessing.reductions as torch_reductions
from _support import TIMEOUT, json_of, run_python, wait_until

import devipc
from devipc._core import _sharing, _wire
from devipc._core._refcount import SENT

pytestmark = pytest.mark.usefixtures("ipc_mode")

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]


def _cases():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    yield "contiguous", base
    yield "prefix", base[:2]
    yield "offset", base[1:]
    yield "scalar", torch.tensor(3.5)
    yield "nine dimensions", torch.arange(512.0).reshape((2,) * 9)
    yield "odd stride of a unit dimension", base.as_strided((1, 6), (99, 1))
    yield "strided", base[:, ::2]
    yield "transposed", base.t()
    yield "empty", torch.empty(0, 3)
    for dtype in DTYPES:
        yield str(dtype), (torch.arange(10) % 3).to(dtype)


def _roundtrip(children, items):
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.check_received, inbox, outbox)
    reports = []
    try:
        for tensor, expected in items:
            inbox.put((tensor, expected))
            reports.append(outbox.get(timeout=TIMEOUT))
    finally:
        inbox.put(None)
    children.join_ok()
    return reports


def test_views_dtypes_and_empty_tensors_round_trip(children):
    names, items = [], []
    for name, cpu in _cases():
        names.append(name)
        device_base = cpu._base.to("openreg") if cpu._base is not None else None
        if device_base is not None:  # keep the view's layout: build it from a device base
            tensor = device_base.as_strided(cpu.size(), cpu.stride(), cpu.storage_offset())
        else:
            tensor = cpu.to("openreg")
        items.append((tensor, cpu))
    for name, (tensor, cpu), report in zip(names, items, _roundtrip(children, items)):
        assert report["equal"], name
        assert report["device"] == "openreg:0", name
        assert (report["dtype"], report["shape"], report["stride"], report["offset"]) == (
            cpu.dtype,
            tuple(cpu.shape),
            tensor.stride(),
            tensor.storage_offset(),
        ), name
        assert report["received"] == (tensor.numel() > 0), name


def test_work_queued_before_sending_is_complete_when_the_consumer_reads(children):
    source = torch.full((8 << 20,), 7, dtype=torch.int32)
    expected = source.clone()  # not the source: sharing a CPU tensor that queued copies still
    # read moves it into shared memory under them (a known limit of openreg's pageable copies)
    target = torch.zeros(8 << 20, dtype=torch.int32, device="openreg")
    for _ in range(4):
        target.copy_(source, non_blocking=True)  # still queued when put() pickles it
    [report] = _roundtrip(children, [(target, expected)])
    assert report["equal"]


def test_producer_may_exit_before_the_consumer_reads(children):
    outbox = children.ctx.Queue()
    producer = children.start(_workers.produce_and_exit, outbox)
    tensor = outbox.get(timeout=TIMEOUT)
    producer.join(TIMEOUT)
    assert producer.exitcode == 0
    assert tensor.cpu().tolist() == [0.0, 10.0, 20.0, 30.0]
    tensor += 1  # still our mapping: writable, nothing to release on the dead side
    assert tensor.cpu().tolist() == [1.0, 11.0, 21.0, 31.0]


def test_a_killed_producer_leaves_the_consumer_its_memory(children):
    outbox = children.ctx.Queue()
    producer = children.start(_workers.produce_and_wait, outbox)
    tensor = outbox.get(timeout=TIMEOUT)
    producer.kill()
    producer.join(TIMEOUT)
    assert producer.exitcode == -9
    assert tensor.cpu().tolist() == [0.0, 10.0, 20.0, 30.0]
    tensor.mul_(2)
    assert tensor.cpu().tolist() == [0.0, 20.0, 40.0, 60.0]
    del tensor  # releasing into a dead producer's counter file is harmless


def test_no_descriptor_is_left_open_on_either_side(children):
    from _support import open_fds

    tensor = torch.ones(1024, device="openreg")
    shared = devipc.rfc.share_device(tensor.untyped_storage())  # the counter file now exists
    devipc.rfc.release_ipc_counter_device(shared[4], shared[5])
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.count_fds_around_a_receive, inbox, outbox)
    before = open_fds()
    inbox.put(tensor)
    value, consumer_extra_fds, idle_counter_files = outbox.get(timeout=TIMEOUT)
    # The one descriptor left is the producer's counter file, kept open (with its mapping) for
    # the producer's next send: a bounded cache of ConsumerCounters.IDLE_KEPT files.
    assert value == 1024.0 and consumer_extra_fds == idle_counter_files == 1
    assert open_fds() == before  # sharing opened nothing on the producer's side either
    children.join_ok()
    del tensor, shared
    devipc.ipc_collect()
    torch.accelerator.empty_cache()
    assert open_fds() <= before


def test_parameter_keeps_requires_grad(children):
    parameter = torch.nn.Parameter(torch.ones(3, device="openreg"))
    frozen = torch.nn.Parameter(torch.ones(3, device="openreg"), requires_grad=False)
    reports = _roundtrip(children, [(parameter, torch.ones(3)), (frozen, torch.ones(3))])
    assert [(r["type"], r["requires_grad"]) for r in reports] == [
        ("Parameter", True),
        ("Parameter", False),
    ]


def test_writes_cross_both_ways(children):
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.mutate_both_ways, inbox, outbox)
    tensor = torch.zeros(4, device="openreg")
    inbox.put(tensor)
    assert outbox.get(timeout=TIMEOUT) == "added"
    assert tensor.cpu().tolist() == [1.0] * 4
    tensor.fill_(7)
    torch.accelerator.synchronize()
    inbox.put("filled")
    assert outbox.get(timeout=TIMEOUT) == [7.0] * 4
    children.join_ok()


def test_views_of_one_storage_arrive_as_views_of_one_storage(children):
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.views_of_one_storage, inbox, outbox)
    whole = torch.zeros(6, device="openreg")
    inbox.put((whole, whole[:3], whole[3:]))
    report = outbox.get(timeout=TIMEOUT)
    assert report == {"same_storage": True, "whole": [5.0, 5.0, 5.0, 0.0, 0.0, 0.0]}
    children.join_ok()


def test_a_received_tensor_is_forwarded_and_outlives_its_forwarder(children):
    """A -> B -> C: C maps A's memory, its writes reach A, and A's memory stays allocated until
    both B and C let go, also when B exits first."""
    torch.accelerator.synchronize()
    wait_until(lambda: devipc.stats()["sent"] == 0, "earlier sends ended", collect=True)
    baseline = torch.accelerator.memory_allocated()
    to_b, from_b = children.ctx.Queue(), children.ctx.Queue()
    to_c, from_c = children.ctx.Queue(), children.ctx.Queue()
    b = children.start(_workers.forward_to, to_b, to_c, from_b)
    children.start(_workers.write_and_hold, to_c, from_c, 5.0)
    tensor = torch.zeros(1 << 18, device="openreg")  # 1 MiB
    to_b.put(tensor)
    assert from_b.get(timeout=TIMEOUT) == "forwarded"
    assert from_c.get(timeout=TIMEOUT) == ("written", True)
    assert tensor.sum().item() == 5 * (1 << 18), "C's write did not reach A"
    to_b.put("exit")
    b.join(TIMEOUT)
    assert b.exitcode == 0
    del tensor
    devipc.ipc_collect()
    assert torch.accelerator.memory_allocated() >= baseline + (1 << 20), "freed while C holds it"
    to_c.put("drop")
    assert from_c.get(timeout=TIMEOUT) == "dropped"
    wait_until(
        lambda: torch.accelerator.memory_allocated() == baseline,
        "A's memory freed",
        10,
        collect=True,
    )
    to_c.put("exit")
    children.join_ok()


def test_handle_survives_plain_pickle_over_a_socket(children):
    tensor = torch.arange(5, dtype=torch.float32, device="openreg")
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    assert rebuild is torch_reductions.rebuild_device_tensor and len(args) == 15
    payload = pickle.dumps((rebuild, args))
    outbox = children.ctx.Queue()
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(TIMEOUT)
        children.start(_workers.read_from_socket, server.getsockname()[1], outbox)
        conn, _ = server.accept()
        with conn:
            conn.sendall(payload)
    assert outbox.get(timeout=TIMEOUT) == [0.0, 1.0, 2.0, 3.0, 4.0]
    children.join_ok()


def test_storages_sent_on_their_own_are_shared_too():
    tensor = torch.arange(4, dtype=torch.float32, device="openreg")
    untyped = tensor.untyped_storage()
    typed = torch.TypedStorage(wrap_storage=untyped, dtype=torch.float32, _internal=True)
    for storage in (untyped, typed):
        received = ForkingPickler.loads(ForkingPickler.dumps(storage))
        assert type(received) is type(storage)
        if isinstance(received, torch.TypedStorage):
            received = received._untyped_storage
        assert received.device == tensor.device
        view = torch.tensor([], dtype=torch.float32, device="openreg").set_(received)
        view[0] = 42
        assert tensor[0].item() == 42
        tensor[0] = 0
        del received, view
    del tensor
    devipc.ipc_collect()


def test_rfc_names_exist():
    assert callable(torch_reductions._device_supports_ipc)
    assert torch_reductions._device_supports_ipc("openreg") is True
    assert torch_reductions._device_supports_ipc("cpu") is False
    assert callable(torch_reductions.rebuild_device_tensor)
    for name in ("_share_device_", "_new_shared_device", "_release_ipc_counter_device"):
        assert hasattr(torch.UntypedStorage, name), name
    shared = torch.ones(2, device="openreg").untyped_storage()._share_device_()
    storage = torch.UntypedStorage._new_shared_device(*shared)
    assert storage.nbytes() == 8
    del storage
    devipc.ipc_collect()


@pytest.mark.parametrize(
    "field, value, error",
    [
        (7, b"\x00" * 64, devipc.InvalidHandleError),  # forged memory handle
        (7, b"short", devipc.InvalidHandleError),  # truncated memory handle
        (11, b"\x01" * 36, devipc.InvalidHandleError),  # forged ref-counter handle
        (12, 10**9, devipc.InvalidHandleError),  # ref-counter offset out of range
        # found by benchmarks/fuzz_handles.py: each was a TypeError/RuntimeError or was accepted
        (6, None, devipc.InvalidHandleError),  # not a device
        (6, "garbage", devipc.InvalidHandleError),
        (6, -1, devipc.InvalidHandleError),
        (7, None, devipc.InvalidHandleError),  # no memory handle, real slot: leaked it
        (8, 0, devipc.InvalidHandleError),  # forged empty storage: leaked the slot
        (8, 4, devipc.InvalidHandleError),  # the view does not fit the storage
        (13, None, devipc.InvalidHandleError),  # an event handle that is not bytes
    ],
)
def test_forged_or_truncated_handles_raise(field, value, error):
    tensor = torch.ones(4, device="openreg")
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    args = list(args)
    args[field] = value
    if field == 13:
        args[14] = True
    with pytest.raises(error):
        rebuild(*args)
    devipc.revoke(tensor)  # refused before its slot was opened: take the send back
    del tensor
    devipc.ipc_collect()


def test_sent_arguments_pickle_without_globals_and_come_back_as_the_15():
    """reduce_tensor's arguments pickle the classes and dtype by name and leave the device to
    the wrapped handle (each global costs an import lookup on both sides); unpickled, they are
    torch's 15 arguments again, a plain tuple, args[6] as the producer wrote it."""
    tensor = torch.arange(6, dtype=torch.float16, device="openreg").reshape(2, 3)
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    payload = pickle.dumps(args)
    assert b"float16" in payload and b"UntypedStorage" not in payload and b"device" not in payload
    assert b"devipc._reductions" in payload  # the path a peer of the flat layout knows
    back = pickle.loads(payload)
    assert type(back) is tuple and back == tuple(args) and back[6] == tensor.device
    received = rebuild(*back)
    assert torch.equal(received.cpu(), tensor.cpu()) and received.dtype == torch.float16
    overwritten = list(args)
    overwritten[6] = 0  # what frameworks do: a plain list, pickled in full, means device 0
    assert pickle.loads(pickle.dumps(overwritten))[6] == 0
    del received
    devipc.ipc_collect()


@pytest.mark.parametrize(
    "field, value",
    [
        (0, "Module"),
        (0, ["unhashable"]),
        (1, "not_a_dtype"),
        (1, "Tensor"),
        (5, b"not a wrapped handle"),
        (5, None),
        (5, b"DVIP\x04\x00truncated"),
    ],
)
def test_forged_sent_arguments_raise(field, value):
    tensor = torch.ones(4, device="openreg")
    _, args = torch_reductions.reduce_tensor(tensor)
    expand, compact = args.__reduce__()
    compact = list(compact)
    compact[field] = value
    with pytest.raises(devipc.InvalidHandleError):
        expand(*compact)
    devipc.revoke(tensor)
    del tensor
    devipc.ipc_collect()


def test_a_bytearray_memory_handle_is_refused():
    tensor = torch.ones(4, device="openreg")
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    args = list(args)
    args[7] = bytearray(args[7])  # was: TypeError, unhashable in the shared cache
    with pytest.raises(devipc.InvalidHandleError):
        rebuild(*args)
    assert devipc.revoke(tensor) == 1  # refused before its slot was opened
    del tensor
    devipc.ipc_collect()


def test_a_memory_handle_of_a_device_not_visible_here_is_an_invalid_handle():
    import struct

    tensor = torch.ones(4, device="openreg")
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    args = list(args)
    sender, raw = _wire.unwrap_storage_handle(args[7])
    handle = bytearray(raw)
    struct.pack_into("=i", handle, 24, 4096)  # physical device 4096: was an OpenRegError
    args[7] = _wire.wrap_storage_handle(sender, bytes(handle))
    with pytest.raises(devipc.InvalidHandleError, match="forged or stale|physical device 4096"):
        rebuild(*args)
    assert devipc.revoke(tensor) == 1  # refused before its slot was taken: still unopened
    del tensor
    devipc.ipc_collect()


def test_a_forged_event_handle_is_refused_and_the_genuine_bytes_still_open():
    """The event is opened before the send's slot is taken (issue 27, defect 6)."""
    tensor = torch.ones(4, device="openreg")
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    forged = list(args)
    forged[13], forged[14] = b"\x00" * 64, True
    with pytest.raises(devipc.InvalidHandleError):
        rebuild(*forged)
    counter = _sharing._counters._open(args[11])
    try:
        assert counter.state(args[12]) == SENT  # still the send's
    finally:
        _sharing._counters._put(args[11])
    assert rebuild(*args).cpu().tolist() == [1.0] * 4
    del tensor


def test_handle_of_an_exited_producer_says_peer_gone(children):
    outbox = children.ctx.Queue()
    children.start(_workers.reduce_and_exit, outbox)
    payload = outbox.get(timeout=TIMEOUT)
    children.join_ok()
    rebuild, args = pickle.loads(payload)
    with pytest.raises(devipc.PeerGoneError, match="exited"):
        rebuild(*args)


def test_cpu_tensors_keep_torch_path():
    rebuild, _ = torch_reductions.reduce_tensor(torch.ones(2))
    assert rebuild is torch_reductions.rebuild_tensor


class _FakeCudaStorage:
    """Stands in for a CUDA storage where no GPU exists: only the driver call is faked."""

    calls = []

    class _untyped_storage:  # mirrors TypedStorage's attribute
        device = torch.device("cuda", 0)

    def __init__(self):
        self._real = torch.UntypedStorage(8)

    def _weak_ref(self):  # torch's shared cache keeps a weak reference to what it sends
        return self._real._weak_ref()

    def _share_cuda_(self):
        self.calls.append("share_cuda")
        return (0, b"cuda-ipc-handle", 8, 0, b"rc", 0, b"ev", True)


class _FakeCudaTensor(torch.Tensor):
    @property
    def device(self):
        return torch.device("cuda", 0)

    def _typed_storage(self):
        return _FakeCudaStorage()


def test_cuda_tensors_still_reach_torchs_rebuild_cuda_tensor():
    """With devipc installed, a CUDA tensor goes through torch's own reduce_tensor and comes
    back as rebuild_cuda_tensor."""
    _FakeCudaStorage.calls.clear()
    tensor = torch.Tensor._make_subclass(_FakeCudaTensor, torch.empty(2))
    reducer = ForkingPickler._extra_reducers[torch.Tensor]
    assert reducer is devipc._core._reductions.reduce_tensor
    rebuild, args = reducer(tensor)
    assert rebuild is torch_reductions.rebuild_cuda_tensor
    assert _FakeCudaStorage.calls == ["share_cuda"] and args[7] == b"cuda-ipc-handle"


def test_install_is_idempotent_and_uninstall_restores_torch():
    original = devipc._core._reductions._saved["reduce_tensor"]
    devipc.rfc.install()
    assert torch_reductions.reduce_tensor is devipc._core._reductions.reduce_tensor
    devipc.rfc.uninstall()
    try:
        assert torch_reductions.reduce_tensor is original
        assert ForkingPickler._extra_reducers[torch.Tensor] is original
        assert not hasattr(torch_reductions, "rebuild_device_tensor")
        assert not hasattr(torch.UntypedStorage, "_share_device_")
        devipc.rfc.uninstall()
    finally:
        devipc.rfc.install()
    assert ForkingPickler._extra_reducers[torch.Tensor] is devipc._core._reductions.reduce_tensor


@dataclasses.dataclass
class _UpstreamMemHandle:
    """The memory-handle record of the RFC's pull requests: IpcMemHandle{offset, handle}."""

    offset: int
    handle: bytes


class _UpstreamSpelling(devipc.hooks.IpcHooks):
    """openreg's hooks as code written against the PR branches spells them: a record for the
    memory handle, requires_event_sync() and no ipc_event_handle_size()."""

    def __init__(self, inner):
        self.inner = inner

    def supports_ipc(self):
        return self.inner.supports_ipc()

    def get_ipc_mem_handle(self, ptr):
        handle, offset = self.inner.get_ipc_mem_handle(ptr)
        return _UpstreamMemHandle(offset=offset, handle=handle)

    def get_ipc_event_handle(self, device):
        return self.inner.get_ipc_event_handle(device)

    def open_ipc_mem_handle(self, handle):
        return self.inner.open_ipc_mem_handle(handle)

    def wait_ipc_event(self, event_handle, stream):
        self.inner.wait_ipc_event(event_handle, stream)

    def requires_event_sync(self):
        return self.inner.ipc_event_handle_size() > 0


def test_hooks_in_the_rfc_prs_spelling_share_unchanged(children, ipc_mode):
    inner = devipc.hooks.get_ipc_hooks("openreg")
    upstream = _UpstreamSpelling(inner)
    assert upstream.ipc_event_handle_size() == 0  # the core asks requires_event_sync() alone
    devipc.hooks.register_ipc_hooks("openreg", upstream, replace=True)
    try:
        cpu = torch.arange(12.0).reshape(3, 4)
        (report,) = _roundtrip(children, [(cpu.to("openreg")[1:], cpu[1:])])
    finally:
        devipc.hooks.register_ipc_hooks("openreg", inner, replace=True)
    assert report["equal"] and report["received"] and report["offset"] == 4


def test_torchs_own_event_reducers_stay_as_torch_made_them():
    """torch 2.15 replaced reduce_event by _reduce_event (registered for cuda and xpu events);
    devipc's install re-runs torch's init_reductions and touches neither."""
    own = getattr(torch_reductions, "_reduce_event", None) or torch_reductions.reduce_event
    assert devipc.rfc.installed()
    events = [torch.cuda.Event] + ([torch.xpu.Event] if hasattr(torch.xpu, "Event") else [])
    for event_class in events:
        assert ForkingPickler._extra_reducers.get(event_class) in (own, None), event_class
    assert ForkingPickler._extra_reducers[torch.cuda.Event] is own


def test_the_rfc_prs_support_query_answers_once_installed_and_goes_with_uninstall():
    query = torch._C._acc._is_privateuse1_ipc_supported
    assert query() is True  # openreg, the PrivateUse1 backend here, has hooks that share
    devipc.rfc.uninstall()
    try:
        assert not hasattr(torch._C._acc, "_is_privateuse1_ipc_supported")
    finally:
        devipc.rfc.install()
    assert torch._C._acc._is_privateuse1_ipc_supported() is True


OWN_SHARE_DEVICE = """
import json, torch
native = torch.UntypedStorage._share_fd_cpu_  # a native method, as a torch with the RFC would have
torch.UntypedStorage._share_device_ = native
import devipc
before = devipc.rfc.installed()
try:
    import devipc_openreg  # registers openreg's hooks, which installs the reductions
except devipc.DevIpcError as error:
    refused = str(error)
else:
    refused = None
print(json.dumps({"installed": before or devipc.rfc.installed(), "refused": refused,
                  "kept": torch.UntypedStorage._share_device_ is native,
                  "hooks": devipc.hooks.get_ipc_hooks("openreg") is not None}))
"""


def test_a_torch_with_its_own_share_device_is_refused_not_overwritten():
    """A future torch with the RFC merged: devipc says so and leaves torch's method in place."""
    out = json_of(OWN_SHARE_DEVICE, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out["refused"] and "has its own UntypedStorage._share_device_" in out["refused"]
    assert "will not replace it" in out["refused"]
    assert out["kept"] and not out["installed"]
    assert not out["hooks"], "the refused registration stays registered"


def test_a_non_leaf_that_requires_grad_is_refused_in_torchs_words():
    leaf = torch.ones(3, device="openreg", requires_grad=True)
    with pytest.raises(
        RuntimeError, match="Cowardly refusing to serialize non-leaf tensor which requires_grad"
    ):
        torch_reductions.reduce_tensor(leaf * 2)


def _nested(layout=torch.strided):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "prototype stage" note on strided nesting
        return torch.nested.nested_tensor(
            [torch.ones(2), torch.arange(3.0)], layout=layout, device="openreg"
        )


def test_tensors_devipc_cannot_send_fail_with_one_line_saying_what_to_do():
    nested = _nested()
    for put in (ForkingPickler.dumps, torch.multiprocessing.get_context("spawn").SimpleQueue().put):
        with pytest.raises(devipc.UnsupportedTensorError, match="nested tensor.*jagged") as info:
            put(nested)
        assert "\n" not in str(info.value) and info.value.__cause__ is None
    csr = torch.ones(3, 3).to_sparse_csr().to("openreg")
    with pytest.raises(devipc.UnsupportedTensorError, match=r"sparse tensor \(torch.sparse_csr\)"):
        ForkingPickler.dumps(csr)
    with pytest.raises(devipc.UnsupportedTensorError, match=r"share\(\): .*nested"):
        devipc.share(nested)
    with pytest.raises(TypeError):  # still a TypeError, as before, for code that caught that
        devipc.share_tensors({"n": nested})


def test_a_jagged_nested_tensor_crosses_through_its_components():
    jagged = _nested(torch.jagged)
    received = pickle.loads(ForkingPickler.dumps(jagged))
    assert received.is_nested and received.layout == torch.jagged
    assert received.values().cpu().tolist() == [1.0, 1.0, 0.0, 1.0, 2.0]
    assert devipc.received_via_ipc(received.values())  # zero-copy: devipc shared the values


def test_a_queue_feeder_prints_devipc_s_line_not_a_dispatcher_dump():
    result = run_python(
        textwrap.dedent("""
        import warnings, torch, torch.multiprocessing as mp
        import devipc
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.ones(2)], device="openreg")
        queue = mp.get_context("spawn").Queue()
        queue.put(nested)  # pickled by the feeder thread, which prints what failed
        queue.close()
        queue.join_thread()
    """)
    )
    assert "UnsupportedTensorError" in result.stderr and "jagged" in result.stderr
    assert "Could not run" not in result.stderr and "aten::" not in result.stderr, result.stderr
