"""torch.multiprocessing as users meet it: Queues carrying many tensors, and DataLoader workers
(spawned by the DataLoader itself) returning device tensors."""

from __future__ import annotations

import functools

import torch

from . import _tasks
from ._check import check, expect
from ._compare import compare
from ._kit import Kit

TIMEOUT = 60.0


@check(
    "mp.queue",
    "many tensors in a row cross a torch.multiprocessing Queue, and the peer's own device "
    "tensors cross back",
)
def queue(kit: Kit) -> str:
    peer = kit.peer()
    sent = [torch.full((100,), float(i), device=kit.device) for i in range(20)]
    for tensor in sent:
        peer.send(_tasks.describe, [tensor])
    for i, tensor in enumerate(sent):
        compare(f"message {i}", tensor, peer.reply(_tasks.describe)[0])
    made = peer.call(_tasks.make, kit.target, 20)
    for i, tensor in enumerate(made):
        expect(
            tensor.device.type == kit.device.type
            and torch.equal(tensor.cpu(), torch.full((100,), float(i))),
            f"the peer's tensor {i} differs",
        )
    return "20 messages each way"


@check("mp.dataloader", "DataLoader workers (spawn) return batches made on the device")
def dataloader(kit: Kit) -> str:
    loader = torch.utils.data.DataLoader(
        _tasks.DeviceDataset(kit.target, 8),
        batch_size=2,
        num_workers=1,
        multiprocessing_context="spawn",
        timeout=TIMEOUT,
        worker_init_fn=functools.partial(_tasks.start_worker, kit.modules),
    )
    batches = list(loader)
    expect(
        [batch.device for batch in batches] == [kit.device] * 4,
        f"batches arrived on {[str(batch.device) for batch in batches]}",
    )
    column = torch.cat([batch.cpu() for batch in batches])[:, 0]
    expect(torch.equal(column, torch.arange(8.0)), f"batches hold {column.tolist()}")
    return "4 batches from 1 worker"
