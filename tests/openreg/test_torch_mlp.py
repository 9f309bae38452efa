"""A two-layer MLP trained with Adam on openreg follows the CPU run step for step."""

import torch

import devipc_openreg  # noqa: F401  (registers the device where autoload is off)

STEPS = 20


def train(model, x, y):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_mlp_with_adam_matches_cpu():
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    device_model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )
    device_model.load_state_dict(cpu_model.state_dict())  # same initial weights
    device_model.to("openreg")
    assert all(p.device.type == "openreg" for p in device_model.parameters())

    cpu_losses = train(cpu_model, x, y)
    device_losses = train(device_model, x.to("openreg"), y.to("openreg"))

    assert cpu_losses[-1] < cpu_losses[0]  # it did learn
    torch.testing.assert_close(
        torch.tensor(device_losses), torch.tensor(cpu_losses), rtol=0, atol=1e-5
    )
    for p_dev, p_cpu in zip(device_model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p_dev.detach().cpu(), p_cpu.detach(), rtol=0, atol=1e-5)
