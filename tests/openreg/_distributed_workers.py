"""Ranks of the process-group tests, run in spawned children: they do the collectives on openreg
tensors and send back plain lists (no tensors through pipes: those would use shared memory), so
the test compares them with values it computes on CPU."""

import datetime
import gc
import os

import torch
from _support import shm_entries

N = 6  # elements each rank contributes


def rank_input(rank: int, dtype=torch.float32) -> torch.Tensor:
    """What `rank` contributes, on CPU: distinct per rank and per element."""
    return (torch.arange(N) * (rank + 1) + rank + 1).to(dtype)


def _counts():
    """This process's descriptors and the /dev/shm entries this test run made."""
    return len(os.listdir("/proc/self/fd")), sorted(shm_entries())


def collectives(conn, rank, world, store_path, backend, ddp):
    """Every op of the backend once, and a DDP step if `ddp` (it imports dynamo: seconds); sends
    {op: result as a list} and the leak counts."""
    import torch.distributed as dist

    import devipc_openreg  # noqa: F401  (registers the device and the backend)

    warm = torch.ones(1, device="openreg")  # the allocator's first segment is not a leak
    before = _counts()
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    out = {"config": str(dist.get_backend_config()), "name": dist.group.WORLD.name()}

    def dev(dtype=torch.float32):
        return rank_input(rank, dtype).to("openreg")

    for op in ("SUM", "MAX", "MIN", "PRODUCT", "AVG"):
        x = dev()
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce_{op}"] = x.tolist()
    x = dev(torch.int64)
    dist.all_reduce(x)
    out["all_reduce_int64"] = x.tolist()

    pair = [dev(), dev()[:2]]
    dist.all_reduce_coalesced(pair)
    out["all_reduce_coalesced"] = torch.cat(pair).tolist()

    base = torch.zeros(N + 4, device="openreg")  # a view at an offset: only its elements change
    base[2 : 2 + N] = dev()
    dist.all_reduce(base[2 : 2 + N])
    out["all_reduce_view"] = base.tolist()

    x = dev()
    dist.broadcast(x, src=world - 1)
    out["broadcast"] = x.tolist()

    gathered = [torch.empty(N, device="openreg") for _ in range(world)]
    dist.all_gather(gathered, dev())
    out["all_gather"] = [g.tolist() for g in gathered]

    flat = torch.empty(world * N, device="openreg")
    dist.all_gather_single(flat, dev())
    out["all_gather_single"] = flat.tolist()

    chunks = [dev() * (r + 1) for r in range(world)]  # chunk r goes to rank r
    part = torch.empty(N, device="openreg")
    dist.reduce_scatter(part, chunks)
    out["reduce_scatter"] = part.tolist()

    part = torch.empty(N, device="openreg")
    dist.reduce_scatter_single(part, torch.cat(chunks))
    out["reduce_scatter_single"] = part.tolist()

    x = dev(torch.int64)
    dist.all_reduce(x, op=dist.ReduceOp.BOR)
    out["all_reduce_BOR"] = x.tolist()

    x = dev()
    dist.reduce(x, dst=0)
    if rank == 0:
        out["reduce"] = x.tolist()

    gathered = [torch.empty(N, device="openreg") for _ in range(world)] if rank == 0 else None
    dist.gather(dev(), gathered, dst=0)
    if rank == 0:
        out["gather"] = [g.tolist() for g in gathered]

    x = torch.empty(N, device="openreg")  # rank r gets 10 * rank_input(r) from rank 0
    pieces = [rank_input(r).mul(10).to("openreg") for r in range(world)] if rank == 0 else None
    dist.scatter(x, pieces, src=0)
    out["scatter"] = x.tolist()

    # all to all: chunk j of rank r is rank_input(r) + 100 j, and goes to rank j
    x = torch.cat([dev() + 100 * j for j in range(world)])
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    out["all_to_all_single"] = y.tolist()
    ys = [torch.empty(N, device="openreg") for _ in range(world)]
    dist.all_to_all(ys, list(x.chunk(world)))
    out["all_to_all"] = torch.cat(ys).tolist()

    received = torch.empty(N, device="openreg")  # a ring: each rank sends to the next one
    sent = dist.isend(dev(), (rank + 1) % world)
    dist.recv(received, (rank - 1) % world)
    sent.wait()
    out["recv"] = received.tolist()

    x = dev()
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    out["all_reduce_async"] = x.tolist()

    objects = [None] * world  # object collectives go through cpu tensors
    dist.all_gather_object(objects, {"rank": rank})
    out["all_gather_object"] = objects

    if ddp:  # the same model everywhere, gradients averaged over the ranks
        torch.manual_seed(0)
        model = torch.nn.Linear(N, 2).to("openreg")
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        wrapped(torch.stack([dev(), dev(), dev()])).sum().backward()
        out["ddp_weight_grad"] = model.weight.grad.tolist()
        del model, wrapped

    pair = dist.new_group([0, 1])  # a subgroup: ranks 0 and 1 only
    x = dev()
    if rank < 2:
        dist.all_reduce(x, group=pair)
    out["subgroup_all_reduce"] = x.tolist()

    dist.barrier()
    dist.destroy_process_group()
    del warm, work, sent  # gloo's work holds the group's connections
    gc.collect()
    out["counts"] = before, _counts()
    conn.send(out)


def lost_peer(conn, rank, world, store_path, how):
    """Rank 1 dies ("dies") or stops taking part ("stalls", until the test tells it to go on)
    once the group is up; rank 0's all_reduce must raise within the group's timeout."""
    import torch.distributed as dist

    import devipc_openreg  # noqa: F401

    store = dist.FileStore(store_path, world)  # the rendezvous keeps the store's long timeout
    dist.init_process_group(
        "oreg", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=3)
    )
    dist.barrier()
    if rank == 1:
        if how == "dies":
            os._exit(0)
        conn.recv()
    else:
        try:
            dist.all_reduce(torch.ones(N, device="openreg"))
        except RuntimeError as e:
            conn.send(str(e))
        else:
            conn.send(None)
    dist.destroy_process_group()
