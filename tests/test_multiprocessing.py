"""torch's own multiprocessing tools on openreg tensors: DataLoader workers and Hogwild."""
import _workers
import pytest
import torch
from _support import TIMEOUT

pytestmark = pytest.mark.usefixtures("ipc_mode")


def test_dataloader_with_spawn_workers_returns_device_tensors():
    loader = torch.utils.data.DataLoader(_workers.DeviceDataset(), batch_size=2, num_workers=2,
                                         multiprocessing_context="spawn", timeout=TIMEOUT)
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
