"""torch's own multiprocessing tools on openreg tensors: DataLoader workers and Hogwild."""

import _workers
import pytest
import torch
from _support import TIMEOUT, foreign_memfd_maps, open_fds, wait_until

import devipc

pytestmark = pytest.mark.usefixtures("ipc_mode")


def test_dataloader_with_spawn_workers_returns_device_tensors():
    loader = torch.utils.data.DataLoader(
        _workers.DeviceDataset(),
        batch_size=2,
        num_workers=2,
        multiprocessing_context="spawn",
        timeout=TIMEOUT,
    )
    batches = list(loader)
    assert [b.device.type for b in batches] == ["openreg"] * 4
    assert torch.equal(torch.cat([b.cpu() for b in batches])[:, 0], torch.arange(8.0))


def test_hogwild_children_train_the_parents_parameters(children):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to("openreg")
    model.share_memory()
    data = torch.randn(64, 4)
    target = data @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 1.0
    data, target = data.to("openreg"), target.to("openreg")
    before = torch.nn.functional.mse_loss(model(data), target).item()
    initial = [p.detach().cpu().clone() for p in model.parameters()]
    done = children.ctx.Queue()
    for _ in range(3):
        children.start(_workers.hogwild_train, model, data, target, 40, done)
    for _ in range(3):
        assert done.get(timeout=TIMEOUT) == "trained"
    children.join_ok()
    after = torch.nn.functional.mse_loss(model(data), target).item()
    assert all(not torch.equal(p.detach().cpu(), q) for p, q in zip(model.parameters(), initial))
    assert after < before / 10, (before, after)


def test_thousands_of_new_tensors_through_a_queue_leave_nothing_behind(children):
    """A new tensor every send, as a DataLoader worker makes them: each send its own allocation
    (sizes vary), opened and dropped by the consumer; afterwards neither side holds an fd, a
    mapping or memory of them."""
    count = 2000
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.read_new_tensors, inbox, outbox, count)
    scratch = torch.zeros(4, device="openreg")  # this process's counter file, made once
    devipc.rfc.release_ipc_counter_device(*devipc.rfc.share_device(scratch.untyped_storage())[4:6])
    del scratch
    wait_until(lambda: devipc.stats()["sent"] == 0, "earlier sends ended", collect=True)
    torch.accelerator.synchronize()
    torch.accelerator.empty_cache()
    memory = torch.accelerator.memory_allocated()
    fds, maps = open_fds(), foreign_memfd_maps()
    for i in range(count):
        inbox.put(torch.full((64 + 1024 * (i % 7),), float(i), device="openreg"))
    total, fds_left, maps_left, mapped = outbox.get(timeout=TIMEOUT)
    assert total == sum(range(count))
    assert (fds_left, maps_left, mapped) == (0, [], 0)
    children.join_ok()
    wait_until(lambda: devipc.stats()["sent"] == 0, "every send ended", collect=True)
    wait_until(
        lambda: torch.accelerator.memory_allocated() <= memory,
        "the producer's memory is back to its baseline",
    )
    torch.accelerator.empty_cache()  # the allocator's cached segments: memfds of its own
    wait_until(lambda: open_fds() <= fds, f"fds back to {fds}", collect=True)  # (a counter file
    assert foreign_memfd_maps() <= maps  # that filled up meanwhile closes once its sends ended)
