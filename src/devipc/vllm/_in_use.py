"""What a vLLM model computes with, to check an update against the trainer's weights: on CPU an
unquantized linear layer moves its weight into a oneDNN handle once loaded (its parameter then
reads empty), so reading parameters says nothing about it."""

import torch
from vllm.model_executor.layers.linear import LinearBase


def weights_in_use(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of a vLLM model by its own names (`qkv_proj`, `gate_up_proj`, ...): each
    linear layer's as it multiplies (the layer run on an identity matrix: exact in float32),
    the other parameters as they are. Run it in vLLM's worker: `llm.apply_model(weights_in_use)`
    (with multiprocessing, VLLM_ALLOW_INSECURE_SERIALIZATION=1)."""
    found = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                eye = torch.eye(module.input_size, dtype=module.params_dtype)
                found[f"{name}.weight"] = module(eye)[0].t().contiguous()
        for name, param in model.named_parameters():
            if name not in found and param.numel():
                found[name] = param.detach().clone()
    return found
