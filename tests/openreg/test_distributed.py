"""The "oreg" process-group backend: registered as vendors register theirs, each op across 2 and 3
spawned processes against values computed on CPU, stream ordering, errors, a dead peer, leaks.

The backend moves bytes with gloo over CPU aliases of openreg memory, never with devipc handles,
so openreg's IPC modes do not apply here.
"""

import functools
import threading

import pytest
import torch
import torch.distributed as dist
from _distributed_workers import collectives, lost_peer, rank_input
from _support import recv

import devipc_openreg  # noqa: F401  (registers the device and the backend)
from devipc_openreg import _distributed


def _reduced(world, op, dtype=torch.float32):
    inputs = torch.stack([rank_input(r, dtype) for r in range(world)])
    if op == "AVG":
        return inputs.sum(0) / world
    return {
        "SUM": inputs.sum(0),
        "MAX": inputs.amax(0),
        "MIN": inputs.amin(0),
        "PRODUCT": inputs.prod(0),
    }[op]


def _expected(rank, world, ddp):
    """What `collectives` must report on `rank`, computed on CPU."""
    total = _reduced(world, "SUM")
    expected = {
        f"all_reduce_{op}": _reduced(world, op) for op in ("SUM", "MAX", "MIN", "PRODUCT", "AVG")
    }
    expected.update(
        {
            "all_reduce_int64": _reduced(world, "SUM", torch.int64),
            "all_reduce_BOR": functools.reduce(
                torch.bitwise_or, [rank_input(r, torch.int64) for r in range(world)]
            ),
            "scatter": rank_input(rank) * 10,
            "all_to_all_single": torch.cat([rank_input(j) + 100 * rank for j in range(world)]),
            "all_to_all": torch.cat([rank_input(j) + 100 * rank for j in range(world)]),
            "all_reduce_coalesced": torch.cat([total, total[:2]]),
            "all_reduce_view": torch.cat([torch.zeros(2), total, torch.zeros(2)]),
            "broadcast": rank_input(world - 1),
            "all_gather": torch.stack([rank_input(r) for r in range(world)]),
            "all_gather_single": torch.cat([rank_input(r) for r in range(world)]),
            "reduce_scatter": total * (rank + 1),
            "reduce_scatter_single": total * (rank + 1),
            "recv": rank_input((rank - 1) % world),
            "all_reduce_async": total,
            "subgroup_all_reduce": rank_input(0) + rank_input(1) if rank < 2 else rank_input(rank),
        }
    )
    if rank == 0:
        expected["reduce"] = total
        expected["gather"] = torch.stack([rank_input(r) for r in range(world)])
    if ddp:  # 3 rows of the rank's input, the gradients averaged
        expected["ddp_weight_grad"] = _reduced(world, "SUM").mul(3 / world).expand(2, -1)
    return expected


def test_registered_the_way_vendors_register_theirs():
    assert dist.Backend("oreg") == "oreg" == dist.Backend.OREG
    assert dist.Backend.default_device_backend_map["openreg"] == "oreg"
    assert dist.get_default_backend_for_device("openreg") == "oreg"
    assert "openreg" in dist.Backend.backend_capability["oreg"]
    _distributed.register()  # idempotent
    assert dist.Backend.backend_list.count("oreg") == 1


@pytest.mark.parametrize("world, backend", [(2, "oreg"), (3, None)])
def test_collectives_match_cpu(children, tmp_path, world, backend):
    """backend None: on a machine whose accelerator is openreg, the default picks "oreg"."""
    store = tmp_path / "store"
    ddp = world == 2  # once is enough: DDP imports dynamo in every rank
    conns = [
        children.start_piped(collectives, rank, world, str(store), backend, ddp)[1]
        for rank in range(world)
    ]
    results = [recv(conn) for conn in conns]
    children.join_ok()
    for rank, got in enumerate(results):
        assert got["config"] == ("openreg:oreg" if backend is None else "openreg:oreg,cpu:oreg")
        assert got["name"] == "oreg"
        assert ("ddp_weight_grad" in got) == ddp
        for op, want in _expected(rank, world, ddp).items():
            torch.testing.assert_close(
                torch.tensor(got[op], dtype=want.dtype),
                want,
                msg=lambda m, op=op, rank=rank: f"rank {rank}, {op}: {m}",
            )
        assert got["all_gather_object"] == [{"rank": r} for r in range(world)]
        before, after = got["counts"]
        assert after == before, "descriptors or /dev/shm entries left after the group's end"


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_lost_peer_raises_instead_of_hanging(children, tmp_path, how):
    conns = [
        children.start_piped(lost_peer, rank, 2, str(tmp_path / "store"), how)[1]
        for rank in range(2)
    ]
    error = recv(conns[0])
    if how == "stalls":
        conns[1].send("go on")
    children.join_ok()
    assert error is not None and "all_reduce on the 'oreg' (openreg) process group" in error


@pytest.fixture
def group():
    """A one-rank group in this process, destroyed whatever happens."""
    dist.init_process_group("oreg", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_reads_inputs_only_after_the_current_stream_wrote_them(group, gate):
    x = torch.zeros(1 << 16, device="openreg")
    stream = torch.accelerator.current_stream()
    gate.hold_torch_stream(stream)
    x.copy_(torch.full((1 << 16,), 3.0), non_blocking=True)  # queued behind the gate
    gathered = [torch.empty_like(x)]
    threading.Timer(0.2, gate.open).start()  # when it opens does not change the outcome
    dist.all_gather(gathered, x)  # gloo copies x into gathered[0] on the host
    assert torch.equal(gathered[0].cpu(), torch.full((1 << 16,), 3.0))


def test_async_work_completes_and_its_future_gives_the_openreg_tensors(group):
    x = torch.arange(8.0, device="openreg")
    work = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
    assert work.wait() and work.is_completed() and work.is_success()
    assert torch.equal(x.cpu(), torch.arange(8.0))
    future = dist.broadcast(x, src=0, async_op=True).get_future()
    assert future.wait()[0] is x  # the openreg tensor, not gloo's host alias of it


def _ones(dtype=torch.float32):
    return torch.ones(2, dtype=dtype, device="openreg")


@pytest.mark.parametrize(
    "call, error, match",
    [  # tensors made in the test, not at collection
        (
            lambda: dist.all_reduce(torch.zeros(2, device="meta")),
            ValueError,
            "serves openreg and cpu tensors; all_reduce got a tensor on meta",
        ),
        (
            lambda: dist.all_reduce(_ones(torch.int64), op=dist.ReduceOp.AVG),
            TypeError,
            "AVG .* needs floating point",
        ),
        (
            lambda: dist.reduce(_ones(), 0, op=dist.ReduceOp.AVG),
            ValueError,
            "reduce on the 'oreg' process group does not support AVG",
        ),
        (
            lambda: dist.all_reduce(_ones(), op=dist._make_nccl_premul_sum(2.0)),
            RuntimeError,
            "all_reduce on the 'oreg' \\(openreg\\) process group: .*PREMUL_SUM",
        ),
        (lambda: dist.all_reduce(torch.ones(2).to_sparse()), ValueError, "needs dense tensors"),
    ],
    ids=["meta", "avg-int", "reduce-avg", "premul-sum", "sparse"],
)
def test_bad_calls_raise_errors_that_name_the_backend(group, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_coalescing_is_refused_clearly(group):
    x = torch.ones(2, device="openreg")
    with pytest.raises(NotImplementedError, match="'oreg' .* does not coalesce"):
        with dist._coalescing_manager(device=x.device):
            dist.all_reduce(x)


def test_a_shut_down_group_refuses_work(group):
    dist.destroy_process_group(group)
    with pytest.raises(RuntimeError, match="was shut down"):
        group.allreduce([torch.ones(2, device="openreg")], dist.AllreduceOptions())


def test_the_ops_called_without_options_take_their_defaults(group):
    # torch always passes options; a caller of the process group itself may not
    backend = dist.distributed_c10d._get_default_group()
    x = torch.arange(4.0, device="openreg")
    gathered, single = [torch.empty_like(x)], torch.empty_like(x)
    for work in (
        backend.allgather([gathered], [x]),
        backend.all_gather_single(single, x),
        backend.allgather_coalesced([gathered], [x]),
    ):
        work.wait()
    assert torch.equal(gathered[0].cpu(), x.cpu()) and torch.equal(single.cpu(), x.cpu())
