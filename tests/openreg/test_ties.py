"""Tied parameters through module.to("openreg") and back (devipc_openreg._ties)."""

import torch

from devipc_openreg import _ties


def _tied_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    model[1].weight = model[0].weight  # an LM head tied to its embedding
    return model


def _losses(model, device, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens = torch.arange(12).remainder(16).to(device)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(tokens[:-1]), tokens[1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_tied_model_moved_to_openreg_stays_tied_and_trains_as_on_the_cpu():
    on_cpu = _losses(_tied_model(), "cpu")
    model = _tied_model().to("openreg")
    assert model[0].weight is model[1].weight and model[0].weight.device.type == "openreg"
    assert len(list(model.parameters())) == 2  # the tie, the bias
    on_openreg = _losses(model, "openreg")
    assert torch.allclose(torch.tensor(on_openreg), torch.tensor(on_cpu), atol=1e-5), (
        on_openreg,
        on_cpu,
    )
    back = model.to("cpu")
    assert back[0].weight is back[1].weight and back[0].weight.device.type == "cpu"


def test_torchs_own_apply_unties_them_which_is_what_openreg_closes(monkeypatch):
    monkeypatch.setattr(torch.nn.Module, "_apply", _ties._torchs_own)
    model = _tied_model().to("openreg")
    assert model[0].weight is not model[1].weight  # torch alone: two copies


def test_untied_models_and_other_conversions_are_torchs_own():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to("openreg")
    assert model[0].weight is not model[1].weight
    tied = _tied_model().double()  # CPU to CPU: torch keeps the Parameter itself
    assert tied[0].weight is tied[1].weight and tied[0].weight.dtype == torch.float64
