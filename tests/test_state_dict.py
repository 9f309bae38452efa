"""share_state_dict / open_state_dict: a model's weights in one send, ties kept."""

import pytest
import torch
from _support import wait_until

import devipc


def test_a_state_dict_round_trips_with_its_ties():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)).to("openreg")
    model[1].weight = model[0].weight  # tied
    state = model.state_dict()
    sent = devipc.stats()["sent"]
    handle = devipc.share_state_dict(state)
    opened = devipc.open_state_dict(bytes(handle))
    assert list(opened) == list(state)
    for name, tensor in state.items():
        assert torch.equal(opened[name].cpu(), tensor.cpu()), name
    assert opened["0.weight"].data_ptr() == opened["1.weight"].data_ptr()  # still tied
    copy = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)).to("openreg")
    copy.load_state_dict(opened)
    assert torch.equal(copy[1].bias.cpu(), model[1].bias.detach().cpu())
    del opened
    torch.accelerator.synchronize()
    wait_until(
        lambda: devipc.stats()["sent"] <= sent, "the send ended", collect=True
    )  # <=: earlier tests' sends may end too


def test_weights_kept_packed_are_sent_without_a_copy():
    """The trainer's pattern: weights live in devipc.pack's allocation, each sync one handle."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)).to("openreg")
    model[1].weight = model[0].weight  # tied
    packed = devipc.pack(model.state_dict())
    assert packed["0.weight"] is not packed["1.weight"]
    assert packed["0.weight"].data_ptr() == packed["1.weight"].data_ptr()  # still tied
    for name, parameter in model.named_parameters():
        parameter.data = packed[name]
    with torch.no_grad():
        model[1].bias.add_(1)  # a training step writes the packed memory
    allocated, sent = torch.openreg.memory_allocated(), devipc.stats()["sent"]
    opened = devipc.open_state_dict(bytes(devipc.share_state_dict(model.state_dict(), copy=False)))
    assert torch.openreg.memory_allocated() <= allocated  # no copy (earlier tests' may go)
    assert torch.equal(opened["1.bias"].cpu(), model[1].bias.detach().cpu())
    with torch.no_grad():
        model[1].bias.zero_()  # the next step: the opened weights are the same memory
    assert opened["1.bias"].cpu().tolist() == [0.0] * 10
    del opened
    torch.accelerator.synchronize()
    wait_until(
        lambda: devipc.stats()["sent"] <= sent,  # an earlier test's sends may be held
        "the send ended",
        collect=True,
    )


def test_what_is_not_a_tensor_is_refused():
    with pytest.raises(TypeError, match="_extra_state"):
        devipc.share_state_dict({"w": torch.ones(1, device="openreg"), "_extra_state": 3})
    with pytest.raises(TypeError, match="mapping"):
        devipc.share_state_dict([torch.ones(1)])
