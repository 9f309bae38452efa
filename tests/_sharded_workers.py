"""Child-process bodies of tests/test_sharded.py (spawn must import them): trainer ranks that
publish their shards of a model whose every generation is known, and an FSDP2 trainer."""

import os

import torch
from _support import TIMEOUT

import devipc


def full_model(layout, generation):
    """The whole model at `generation`: distinct values per parameter and generation, exact in
    float32."""
    return {
        name: (
            torch.arange(max(1, torch.Size(param.shape).numel()), dtype=torch.float32)[
                : torch.Size(param.shape).numel()
            ].view(param.shape)
            + 1000 * generation
            + 100_000 * index
        )
        for index, (name, param) in enumerate(sorted(layout.items()))
    }


def shard_of(tensor, box):
    return tensor[tuple(slice(start, stop) for start, stop in box)]


def trainer_rank(conn, rank, layout, engines, device, transport="ipc"):
    """Rank `rank`: its shards packed in one allocation (copy=False), one token per engine;
    then at each "publish" from the test writes the next generation's shards in place and
    publishes it (with its checksum), reporting once every engine took it; "stop" ends it."""
    import devipc_openreg  # noqa: F401

    full = full_model(layout, 0)
    local = devipc.pack(
        {
            name: shard_of(full[name], param.box(rank)).to(device)
            for name, param in layout.items()
            if param.box(rank) is not None
        }
    )
    with devipc.ShardedPublisher(local, layout, rank=rank, transport=transport) as publisher:
        conn.send([publisher.token() for _ in range(engines)])
        generation = 0
        while conn.recv() == "publish":
            full = full_model(layout, generation)
            with torch.no_grad():
                for name, tensor in local.items():
                    tensor.copy_(shard_of(full[name], layout[name].box(rank)))
            conn.send(("published", publisher.publish(timeout=TIMEOUT, checksum=True)))
            generation += 1
    conn.send("closed")


def fsdp_trainer(conn, rank, world, port, engines, generations):
    """FSDP2 over gloo on the CPU: a model `fully_shard`ed over `world` ranks publishes each
    optimizer step's shards (copy=True: FSDP2's shards lie in one tensor each); sends the
    layout and its tokens first, then each generation's full weights (`full_tensor`, a
    collective) for the test to check the engines against."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 5))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with devipc.ShardedPublisher(model, rank=rank, copy=True) as publisher:
            conn.send((publisher.layout, [publisher.token() for _ in range(engines)]))
            for _ in range(generations):
                model(torch.randn(3, 6)).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                full = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
                conn.send({name: tensor.tolist() for name, tensor in full.items()})
                publisher.publish(timeout=TIMEOUT)
        conn.send("closed")
    finally:
        dist.destroy_process_group()
