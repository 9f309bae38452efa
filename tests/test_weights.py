"""A generation into an engine's own tensors (`WeightSubscriber.copy_into`, `weights()`), as
engines take weights: another floating dtype (an fp32 trainer, a bf16 engine), other names, and
an engine's own loader that fuses q/k/v as vLLM's and SGLang's models do."""

import _workers
import pytest
import torch
from _support import TIMEOUT

import devipc


class Attention(torch.nn.Module):
    """A trainer's attention block, Hugging Face style: q, k and v projections of their own."""

    def __init__(self, width=8, dtype=torch.float32):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, torch.nn.Linear(width, width, device="openreg", dtype=dtype))


class FusedEngine(torch.nn.Module):
    """An engine's attention block as vLLM's models lay it out: q, k and v stacked in one
    `qkv_proj`, filled by the engine's own `load_weights(weights)` as it reads them."""

    STACKED = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2))

    def __init__(self, width=8, dtype=torch.bfloat16):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(width, 3 * width, device="openreg", dtype=dtype)
        self.o_proj = torch.nn.Linear(width, width, device="openreg", dtype=dtype)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                for fused, part, shard in self.STACKED:
                    if name.startswith(part + "."):
                        target = params[fused + name[len(part) :]]
                        rows = target.shape[0] // 3
                        target[shard * rows : (shard + 1) * rows].copy_(tensor)
                        loaded.add(fused + name[len(part) :])
                        break
                else:
                    params[name].copy_(tensor)
                    loaded.add(name)
        return loaded


def _published(model):
    """A publisher of `model` (packed), a subscriber in this process, generation 0 held."""
    devipc.pack_module(model)
    publisher = devipc.WeightPublisher(model)
    subscriber = devipc.WeightSubscriber(publisher.token())
    publisher.publish(wait=False)
    assert subscriber.wait(timeout=TIMEOUT) == 0
    return publisher, subscriber


def _close(publisher, subscriber):
    subscriber.ack()
    publisher.wait_acks(0, timeout=TIMEOUT)
    subscriber.close()
    publisher.close()


def _cpu(state):
    return {name: tensor.cpu() for name, tensor in state.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_an_fp32_trainer_feeds_an_engine_of_another_floating_dtype_exact_to_its_rounding(dtype):
    model = _workers.TinyGPT()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape) * 3)
    publisher, subscriber = _published(model)
    engine = _workers.TinyGPT().to(dtype)
    subscriber.copy_into(engine)
    want = {name: tensor.to(dtype) for name, tensor in _cpu(model.state_dict()).items()}
    got = _cpu(engine.state_dict())
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == dtype and torch.equal(got[name], want[name]), name
    _close(publisher, subscriber)


def test_integer_and_bool_dtypes_must_match_and_shapes_always():
    model = _workers.TinyGPT()
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64, device="openreg"))
    publisher, subscriber = _published(model)
    for wrong, words in [
        (torch.zeros(3, dtype=torch.int32), "int32 \\(3,\\).*int64"),
        (torch.zeros(3, dtype=torch.float32), "float32 \\(3,\\).*int64"),
        (torch.zeros(3, dtype=torch.bool), "bool \\(3,\\).*int64"),
        (torch.zeros(4, dtype=torch.int64), "int64 \\(4,\\).*int64 \\(3,\\)"),
    ]:
        engine = {**_workers.TinyGPT().state_dict(), "steps": wrong.to("openreg")}
        with pytest.raises(ValueError, match=f"'steps'.*{words}.*only floating dtypes convert"):
            subscriber.copy_into(engine)
    _close(publisher, subscriber)


def test_names_rename_and_leave_out_published_tensors():
    model = _workers.TinyGPT()
    publisher, subscriber = _published(model)
    published = _cpu(model.state_dict())
    prefixed = torch.nn.Sequential(_workers.TinyGPT())  # the engine's names start with "0."
    with pytest.raises(KeyError, match="block.weight.*names="):
        subscriber.copy_into(prefixed)
    subscriber.copy_into(prefixed, names=lambda name: "0." + name)
    assert all(
        torch.equal(tensor.cpu(), published[name[2:]])
        for name, tensor in prefixed.state_dict().items()
    )
    # a dict renames what it names and leaves the rest as published; None leaves one out
    engine = {
        "weight": torch.zeros(8, 8, device="openreg"),
        "bias": torch.zeros(8, device="openreg"),
    }
    subscriber.copy_into(
        engine,
        names={
            "block.weight": "weight",
            "block.bias": "bias",
            "embed.weight": None,
            "head.weight": None,
            "mask": None,
        },
    )
    assert torch.equal(engine["weight"].cpu(), published["block.weight"])
    assert torch.equal(engine["bias"].cpu(), published["block.bias"])
    with pytest.raises(TypeError, match="names is a dict or a callable"):
        subscriber.copy_into(engine, names=["weight"])
    with pytest.raises(TypeError, match="an engine's name is a str"):
        subscriber.copy_into(engine, names=lambda name: 7)
    _close(publisher, subscriber)


def test_names_mapping_two_published_tensors_onto_one_is_refused_before_any_copy():
    model = torch.nn.ModuleDict(
        {"a": torch.nn.Linear(8, 8, device="openreg"), "b": torch.nn.Linear(8, 8, device="openreg")}
    )
    publisher, subscriber = _published(model)
    engine = {name: torch.zeros(8, 8, device="openreg") for name in ("a.weight", "weight")}
    engine |= {name: torch.zeros(8, device="openreg") for name in ("a.bias", "bias")}
    for names, onto in [  # onto a name another published tensor keeps; two renames onto one
        ({"b.weight": "a.weight", "b.bias": "a.bias"}, "a.weight"),
        (lambda name: name.split(".")[1], "weight"),
    ]:
        with pytest.raises(
            ValueError,
            match=f"names maps both 'a.weight' and 'b.weight' onto "
            f"the engine's '{onto}': map one of them to None",
        ):
            subscriber.copy_into(engine, names=names)
        assert not any(tensor.cpu().any() for tensor in engine.values())  # nothing copied
    _close(publisher, subscriber)


def test_an_engine_with_fused_qkv_loads_a_generation_through_weights():
    trainer = Attention()
    with torch.no_grad():
        for parameter in trainer.parameters():
            parameter.copy_(torch.randn(parameter.shape))
    publisher, subscriber = _published(trainer)
    pairs = list(subscriber.weights())
    assert [name for name, _ in pairs] == list(trainer.state_dict())
    assert all(tensor.device.type == "openreg" for _, tensor in pairs)  # the held views
    engine = FusedEngine()
    loaded = engine.load_weights(subscriber.weights())
    assert loaded == {"qkv_proj.weight", "qkv_proj.bias", "o_proj.weight", "o_proj.bias"}
    want = _cpu(trainer.state_dict())
    for suffix in ("weight", "bias"):
        stacked = torch.cat([want[f"{part}.{suffix}"] for part in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(getattr(engine.qkv_proj, suffix).cpu(), stacked.to(torch.bfloat16))
        assert torch.equal(
            getattr(engine.o_proj, suffix).cpu(), want[f"o_proj.{suffix}"].to(torch.bfloat16)
        )
    _close(publisher, subscriber)
