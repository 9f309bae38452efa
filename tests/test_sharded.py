"""Sharded weight sync: trainer ranks in spawned processes each publish their shards (uneven,
nested, replicated, in DTensor's and vLLM's placement forms), engines of tensor-parallel size 1,
2 and 4 read only their slices and find them equal to the full model's every generation; a rank
killed mid-generation; FSDP2 over gloo; bad input."""

import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import _sharded_workers
import pytest
import torch
from _sharded_workers import full_model, shard_of
from _support import (
    FRESH_TIMEOUT,
    TIMEOUT,
    Children,
    fresh_env,
    nixl_missing,
    recv,
    use_ucx_loopback,
)

import devipc
from devipc import ParamLayout, p2p

Shard = pytest.importorskip("torch.distributed.tensor").Shard
Replicate = pytest.importorskip("torch.distributed.tensor").Replicate

ROOT = Path(__file__).resolve().parent.parent

# Each engine's tensor-parallel dim per parameter (None: it serves the whole tensor).
TP_DIMS = {"w1": 0, "w2": 1, "b": 0, "norm": None, "scalar": None, "e": 0, "tiny": 0}


def two_ranks():
    """Uneven shards (7 rows as 4 + 3), a dim-1 shard, a replicated norm and scalar."""
    return {
        "w1": ParamLayout((7, 5), (2,), [Shard(0)]),
        "w2": ParamLayout((6, 9), (2,), [Shard(1)]),
        "b": ParamLayout((5,), (2,), [Shard(0)]),
        "norm": ParamLayout((5,), (2,), [Replicate()]),
        "scalar": ParamLayout((), (2,), None),
    }


def four_ranks():
    """A 2 x 2 mesh: a dim sharded twice (7 -> 4 + 3 -> 2 + 2, 2 + 1), two dims sharded, HSDP
    (replicated across one axis), vLLM's int codes with owners out of order, and a tensor of 3
    rows over 4 ranks (one shard empty)."""
    return {
        "w1": ParamLayout((7, 5), (2, 2), [Shard(0), Shard(0)]),
        "w2": ParamLayout((6, 9), (2, 2), [Shard(0), Shard(1)]),
        "b": ParamLayout((5,), (2, 2), [Replicate(), Shard(0)]),
        "norm": ParamLayout((5,), (2, 2), [Replicate(), Replicate()]),
        "e": ParamLayout((9, 4), (2, 2), [1, -1], owners=[3, 2, 1, 0]),
        "tiny": ParamLayout((3,), (2, 2), [Shard(0), Shard(0)]),
    }


def expected_slices(layout, slices, generation):
    full = full_model(layout, generation)
    return {
        name: full[name]
        if asked is None
        else full[name].narrow(asked[0], asked[1], asked[2] - asked[1])
        for name, asked in slices.items()
    }


# -- the layout -----------------------------------------------------------------------------------
def test_each_rank_holds_the_box_dtensor_gives_it():
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as dtensor

    checked = 0
    for mesh in [(2,), (3,), (4,), (2, 2), (2, 3)]:
        for shape in [(5, 3), (7,), (4, 9), (1, 6), (0, 4)]:
            choices = [Replicate()] + [Shard(dim) for dim in range(len(shape))]
            grid = torch.arange(torch.Size(mesh).numel()).view(mesh)
            for first in choices:
                for second in choices if len(mesh) == 2 else [None]:
                    placements = [first] if second is None else [first, second]
                    layout = ParamLayout(shape, mesh, placements)
                    for rank in range(grid.numel()):
                        coordinate = (grid == rank).nonzero()[0].tolist()
                        size, offset = dtensor(shape, mesh, coordinate, placements)
                        box = layout.box(rank)
                        assert tuple(stop - start for start, stop in box) == tuple(size)
                        assert all(start == at for (start, _), at, n in zip(box, offset, size) if n)
                        checked += 1
    assert checked > 300


def test_placements_in_each_form_and_bad_ones_refused():
    dtensor = ParamLayout((8, 4), (2, 2), [Replicate(), Shard(1)], owners=[0, 1, 2, 3])
    codes = ParamLayout((8, 4), (2, 2), [-1, 1])
    assert dtensor == codes and dtensor.box(3) == ((0, 8), (2, 4))
    assert ParamLayout((8,), (4,), None).box(2) == ((0, 8),)  # whole on every owner
    assert ParamLayout((8,), (2,), [0], owners=[5, 7]).box(3) is None
    with pytest.raises(ValueError, match="Partial"):
        ParamLayout((8,), (2,), [object()])
    with pytest.raises(ValueError, match="one per axis"):
        ParamLayout((8,), (2, 2), [0])
    with pytest.raises(ValueError, match="lacks"):
        ParamLayout((8,), (2,), [1])
    with pytest.raises(ValueError, match="distinct"):
        ParamLayout((8,), (2,), [0], owners=[1, 1])


def test_tp_slices_split_as_torch_chunk_and_the_plan_reads_two_shards_for_a_spanning_slice():
    from devipc._weights._shard_layout import plan

    layout = {"w": ParamLayout((7, 5), (2,), [Shard(0)]), "n": ParamLayout((5,), (2,))}
    slices = devipc.tp_slices(layout, 1, 3, {"w": 0})
    assert slices == {"w": (0, 3, 6), "n": None}
    pieces = plan(layout, slices)
    assert pieces["w"][0] == (3, 5)
    assert [(p.rank, p.source[0], p.target[0]) for p in pieces["w"][1]] == [
        (0, slice(3, 4), slice(0, 1)),
        (1, slice(0, 2), slice(1, 3)),
    ]
    assert [p.rank for p in pieces["n"][1]] == [0]  # of replicas, one
    with pytest.raises(ValueError, match="outside"):
        plan(layout, {"w": (0, 5, 9)})
    with pytest.raises(KeyError, match="no parameters named"):
        plan(layout, {"x": None})


# -- across processes -----------------------------------------------------------------------------
def _engines(layout):
    """Engines of tensor-parallel size 1 (every tensor whole), 2 and 4: (size, rank, slices)."""
    return [(1, 0, {name: None for name in layout})] + [
        (size, rank, devipc.tp_slices(layout, rank, size, TP_DIMS))
        for size in (2, 4)
        for rank in range(size)
    ]


def _start_trainers(children, layout, engines, transport="ipc"):
    world = 1 + max(max(param.owners) for param in layout.values())
    conns = [
        children.start_piped(
            _sharded_workers.trainer_rank, rank, layout, engines, "openreg:0", transport
        )[1]
        for rank in range(world)
    ]
    tokens = [recv(conn) for conn in conns]  # tokens[rank][engine]
    return conns, tokens


@pytest.mark.parametrize("layout", [two_ranks(), four_ranks()], ids=["2 ranks", "4 ranks"])
def test_every_engine_holds_its_slices_of_the_full_model_every_generation(layout):
    engines = _engines(layout)
    children = Children()
    try:
        conns, tokens = _start_trainers(children, layout, len(engines))
        subscribers = [
            devipc.ShardedSubscriber(
                [tokens[rank][index] for rank in range(len(conns))],
                layout,
                slices,
                device="openreg:0",
            )
            for index, (_, _, slices) in enumerate(engines)
        ]
        # the TP-2 rank 0 engine keeps its own bf16 tensors, under other names
        own = {
            f"model.{name}": torch.empty(tensor.shape, dtype=torch.bfloat16)
            for name, tensor in expected_slices(layout, engines[1][2], 0).items()
        }
        for generation in range(3):
            for conn in conns:
                conn.send("publish")
            for subscriber, (_, _, slices) in zip(subscribers, engines):
                assert subscriber.wait(TIMEOUT) == generation
                subscriber.verify()
                expected = expected_slices(layout, slices, generation)
                held = subscriber.tensors()
                assert set(held) == set(expected)
                for name, tensor in held.items():
                    assert tensor.device == torch.device("openreg:0")
                    assert torch.equal(tensor.cpu(), expected[name]), name
                assert dict(subscriber.weights()).keys() == expected.keys()
            subscribers[1].copy_into(own, names=lambda name: "model." + name)
            for name, tensor in expected_slices(layout, engines[1][2], generation).items():
                assert torch.equal(own["model." + name], tensor.bfloat16())
            for subscriber in subscribers:
                subscriber.ack()
            for conn in conns:
                assert recv(conn) == ("published", generation)
        # a slice one rank holds is a view of that rank's memory; one that spans ranks, a
        # buffer of the engine's, the same each generation
        whole = subscribers[0].tensors()
        assert devipc.received_via_ipc(subscribers[-1].tensors()["w1"])
        assert not devipc.received_via_ipc(whole["w1"])
        for subscriber in subscribers:
            subscriber.close()
        for conn in conns:
            conn.send("stop")
            assert recv(conn) == "closed"
        children.join_ok()
    finally:
        children.reap()


def test_a_rank_killed_mid_generation_leaves_every_engine_its_generation_and_names_it():
    layout = two_ranks()
    children = Children()
    try:
        conns, tokens = _start_trainers(children, layout, 1)
        slices = devipc.tp_slices(layout, 0, 2, TP_DIMS)
        subscriber = devipc.ShardedSubscriber([tokens[0][0], tokens[1][0]], layout, slices)
        own = {name: torch.zeros(t.shape) for name, t in expected_slices(layout, slices, 0).items()}
        for conn in conns:
            conn.send("publish")
        assert subscriber.wait(TIMEOUT) == 0
        subscriber.copy_into(own)
        subscriber.ack()
        for conn in conns:
            assert recv(conn) == ("published", 0)
        conns[0].send("publish")  # rank 0 publishes generation 1; rank 1 dies before it does
        children.procs[1].kill()
        children.procs[1].join(TIMEOUT)
        with pytest.raises(
            devipc.PeerGoneError,
            match=r"trainer rank 1 of 2 is gone .* generation 1 is incomplete; "
            r"this engine keeps generation 0",
        ):
            subscriber.wait(TIMEOUT)
        assert subscriber.generation == 0
        for name, tensor in expected_slices(layout, slices, 0).items():
            assert torch.equal(own[name], tensor)
        subscriber.close()  # rank 0 no longer waits for this engine
        assert recv(conns[0]) == ("published", 1)
        conns[0].send("stop")
        assert recv(conns[0]) == "closed"
        children.procs[0].join(TIMEOUT)
        assert children.procs[0].exitcode == 0
    finally:
        children.reap()


@pytest.mark.skipif(nixl_missing() is not None, reason=f"NIXL is not installed ({nixl_missing()})")
def test_across_hosts_an_engine_pulls_only_the_blocks_of_its_slices_and_verifies_them(monkeypatch):
    use_ucx_loopback(monkeypatch)
    layout = two_ranks()
    children = Children()
    try:
        conns, tokens = _start_trainers(children, layout, 2, transport="nixl")
        slices = devipc.tp_slices(layout, 1, 2, TP_DIMS)  # w1 rows 4..7: all in rank 1
        partial = devipc.ShardedSubscriber([tokens[0][0], tokens[1][0]], layout, slices, "cpu")
        whole = devipc.ShardedSubscriber([tokens[0][1], tokens[1][1]], layout, None, "cpu")
        served = sum(tensor.nbytes for tensor in expected_slices(layout, slices, 0).values())
        assert partial.pull_bytes < whole.pull_bytes / 1.5
        assert partial.pull_bytes == served  # without a checksum: exactly the slices' bytes
        prepared = []  # each rank's read of the engine's runs is described once, then reposted
        real_prepare = p2p.Connection.prepare
        monkeypatch.setattr(
            p2p.Connection,
            "prepare",
            lambda *args, **kwargs: prepared.append(1) or real_prepare(*args, **kwargs),
        )
        made = []
        for generation in range(3):
            for conn in conns:
                conn.send("publish")
            for subscriber, asked in ((partial, slices), (whole, dict.fromkeys(layout))):
                assert subscriber.wait(TIMEOUT) == generation
                expected = expected_slices(layout, asked, generation)
                for name, tensor in subscriber.tensors().items():
                    assert torch.equal(tensor, expected[name]), name
            # what the partial engine holds beyond the blocks of its slices never came
            for sub in partial._subs:
                pulled = torch.zeros(sub._local.numel(), dtype=torch.bool)
                for start, length in sub._checked_runs:
                    pulled[start : start + length] = True
                assert not sub._local[~pulled].any()
            partial.verify()  # every block pulled, against the sums rank by rank
            served_row = partial._subs[1].tensors()["w1"][1]  # row 5: in the engine's slice
            served_row[2] += 1  # damaged after the pull
            with pytest.raises(
                devipc.ChecksumError, match=f"generation {generation} holds other bytes"
            ):
                partial.verify()
            served_row[2] -= 1
            partial.verify()
            for subscriber in (partial, whole):
                subscriber.ack()
            for conn in conns:
                assert recv(conn) == ("published", generation)
            made.append(len(prepared))
        assert made[0] > 0 and made[2] == made[1]  # (a publisher has one or two buffers)
        # with a checksum, the slices' bytes rounded out to whole blocks (of 64 bytes here),
        # each replicated tensor from one rank
        for subscriber, nbytes in (
            (partial, served),
            (whole, sum(t.nbytes for t in full_model(layout, 0).values())),
        ):
            runs = [run for sub in subscriber._subs for run in sub._checked_runs]
            assert subscriber.pull_bytes == sum(length for _, length in runs)
            assert nbytes <= subscriber.pull_bytes <= nbytes + 2 * 64 * len(runs)
        for subscriber in (partial, whole):
            subscriber.close()
        for conn in conns:
            conn.send("stop")
            assert recv(conn) == "closed"
        children.join_ok()
    finally:
        children.reap()


def _no_cluster() -> str | None:
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "the emulated cluster needs ip and tc (iproute2)"
    return nixl_missing() and f"NIXL is not installed ({nixl_missing()})"


@pytest.mark.skipif(_no_cluster() is not None, reason=str(_no_cluster()))
def test_on_an_emulated_cluster_every_engine_gets_its_slices_from_the_ranks_hosts():
    """benchmarks/sharded_weight_sync.py --smoke: 4 rank hosts and 4 TP engine hosts in network
    namespaces with rate-limited links, each engine's slices checked every generation; nothing
    left behind."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "sharded_weight_sync.py"), "--smoke"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=fresh_env(),
    )
    try:
        out, err = proc.communicate(timeout=4 * FRESH_TIMEOUT)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "every engine's slices exact and verified, each generation" in out
    ours = f"dvf{proc.pid % 100000}"  # its namespaces' prefix (fleet_relay's Cluster); others'
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert [name for name in left.stdout.split() if name.startswith(ours)] == []


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_fsdp2_fully_shard_over_gloo_feeds_tensor_parallel_cpu_engines():
    children = Children()
    port, world = _free_port(), 2
    try:
        conns = [
            children.start_piped(_sharded_workers.fsdp_trainer, rank, world, port, 2, 2)[1]
            for rank in range(world)
        ]
        first = [recv(conn, 3 * TIMEOUT) for conn in conns]
        layout = first[0][0]
        assert layout["0.weight"] == ParamLayout((7, 6), (2,), [Shard(0)])
        subscribers = [
            devipc.ShardedSubscriber(
                [first[rank][1][tp] for rank in range(world)],
                layout,
                devipc.tp_slices(layout, tp, 2, lambda name: 1 if name == "1.weight" else 0),
                device="cpu",
            )
            for tp in range(2)
        ]
        for _ in range(2):
            full = {name: torch.tensor(value) for name, value in recv(conns[0]).items()}
            assert recv(conns[1]).keys() == full.keys()
            for tp, subscriber in enumerate(subscribers):
                subscriber.wait(TIMEOUT)
                for name, tensor in subscriber.tensors().items():
                    dim = 1 if name == "1.weight" else 0
                    assert torch.equal(tensor, full[name].chunk(2, dim)[tp]), name
                subscriber.ack()
        for subscriber in subscribers:
            subscriber.close()
        for conn in conns:
            assert recv(conn) == "closed"
        children.join_ok()
    finally:
        children.reap()


# -- in one process: bad input and late joins -----------------------------------------------------
def _publishers(layout, generation=0):
    full = full_model(layout, generation)
    world = 1 + max(max(param.owners) for param in layout.values())
    return [
        devipc.ShardedPublisher(
            devipc.pack(
                {
                    name: shard_of(full[name], param.box(rank)).to("openreg")
                    for name, param in layout.items()
                }
            ),
            layout,
            rank=rank,
        )
        for rank in range(world)
    ]


def test_a_rank_whose_shards_do_not_match_the_layout_is_refused():
    layout = two_ranks()
    full = full_model(layout, 0)
    wrong = {name: full[name].clone() for name in layout}  # whole tensors, not rank 1's shards
    with pytest.raises(ValueError, match="rank 1's local shard is .* its layout says"):
        devipc.ShardedPublisher(wrong, layout, rank=1)
    with pytest.raises(ValueError, match="rank 2 of a layout"):
        devipc.ShardedPublisher(wrong, layout, rank=2)
    with pytest.raises(ValueError, match="no DTensor"):
        devipc.ShardedPublisher(wrong, rank=0)


def test_tokens_of_the_wrong_count_or_order_are_refused():
    layout = two_ranks()
    publishers = _publishers(layout)
    try:
        with pytest.raises(ValueError, match="1 tokens for a trainer of 2 ranks"):
            devipc.ShardedSubscriber([publishers[0].token()], layout)
        swapped = devipc.ShardedSubscriber([p.token() for p in reversed(publishers)], layout)
        for publisher in publishers:
            publisher.publish(wait=False)
        swapped.wait(TIMEOUT)
        with pytest.raises(
            ValueError, match="token 0 publishes shards that are not trainer rank 0's"
        ):
            swapped.tensors()
        swapped.close()
    finally:
        for publisher in publishers:
            publisher.close()


def test_an_engine_never_takes_a_generation_some_rank_has_not_published():
    layout = two_ranks()
    publishers = _publishers(layout)
    try:
        subscriber = devipc.ShardedSubscriber([p.token() for p in publishers], layout)
        publishers[0].publish(wait=False)
        with pytest.raises(
            TimeoutError,
            match=r"generation 0 not published by trainer ranks "
            r"\[1\]",
        ):
            subscriber.wait(0.2)
        assert subscriber.generation == -1
        waited = []
        engine = threading.Thread(target=lambda: waited.append(subscriber.wait(TIMEOUT)))
        engine.start()
        publishers[1].publish(wait=False)
        engine.join(TIMEOUT)
        assert waited == [0]
        expected = expected_slices(layout, {name: None for name in layout}, 0)
        assert all(torch.equal(t.cpu(), expected[n]) for n, t in subscriber.tensors().items())
        subscriber.ack()
        subscriber.close()
    finally:
        for publisher in publishers:
            publisher.close()


def test_an_engine_that_joins_between_two_ranks_publishes_takes_the_next_whole_generation():
    layout = two_ranks()
    publishers = _publishers(layout)
    try:
        publishers[0].publish()  # generation 0 from rank 0 only; an engine joining now gets 1
        with devipc.ShardedSubscriber([p.token() for p in publishers], layout) as subscriber:
            publishers[1].publish(wait=False)
            waited = []
            engine = threading.Thread(target=lambda: waited.append(subscriber.wait(TIMEOUT)))
            engine.start()
            publishers[0].publish(wait=False)  # generation 1 from rank 0: the engine's first
            publishers[1].wait_acks(0, TIMEOUT)  # the engine let rank 1's generation 0 go
            publishers[1].publish(wait=False)
            engine.join(TIMEOUT)
            assert waited == [1]
            subscriber.ack()
        assert [r["state"] for r in publishers[0].subscribers().values()] == ["closed"]
    finally:
        for publisher in publishers:
            publisher.close()


def test_block_checksums_are_for_pulls_across_hosts():
    """Only a NIXL publisher pays for them (a partial pull exists only there); on one host the
    option is refused, not ignored."""
    with pytest.raises(ValueError, match="block_checksums=True .* needs transport='nixl'"):
        devipc.WeightPublisher({"w": torch.zeros(4)}, block_checksums=True)
