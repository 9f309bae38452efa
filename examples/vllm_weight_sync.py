"""RL-style weight sync into a real vLLM engine through devipc: a trainer updates a small Llama
after every optimizer step and publishes it; vLLM's engine (its engine core and worker in a
process of their own, vLLM's default) loads each generation through its model's `load_weights`,
with backend "devipc", as an RL loop written for vLLM's `ipc` backend would, on any device with
devipc hooks or on CPU.

    engine:  LLM(model, weight_transfer_config=WeightTransferConfig(backend="devipc"))
    trainer: devipc.pack_module(model)
             sync = WeightTransferTrainerFactory.trainer_init(
                 DevipcTrainerInitInfo(rank=0), client=LLMClient(llm), source=ModuleSource(model))
             sync.send_weights()                     # after each optimizer step

After each step the example reads the weights vLLM computes with (q, k, v fused into one
projection, gate and up into another) and compares them, exactly, with the trainer's; and it
generates: the trainer teaches the model to repeat one token, and vLLM's greedy answer follows.
Run (after `pip install 'devipc[vllm]'`, or `make setup` in a clone):
`.venv/bin/python examples/vllm_weight_sync.py`. The model is made from a config: no download.
"""

import os
import tempfile

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's function, below
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of RAM for the KV cache of a CPU engine

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

import devipc
from devipc.vllm import DevipcTrainerInitInfo, LLMClient, weights_in_use

STEPS, PROMPT, REPEAT = 3, [1, 17, 42, 99, 5], 7
FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def as_vllm_holds(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's weights by vLLM's names: q, k, v (and gate, up) stacked, in that order."""
    held: dict[str, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        for part, into in FUSED.items():
            name = name.replace(f".{part}.", f".{into}.")
        held.setdefault(name, []).append(param.detach())
    return {name: torch.cat(parts) for name, parts in held.items()}


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )
    trainer = LlamaForCausalLM(config).float()
    with tempfile.TemporaryDirectory() as directory:
        trainer.save_pretrained(directory)  # the engine starts from the same weights
        llm = LLM(
            model=directory,
            dtype="float32",
            enforce_eager=True,
            max_model_len=128,
            skip_tokenizer_init=True,
            weight_transfer_config=WeightTransferConfig(backend="devipc"),
        )
    devipc.pack_module(trainer)  # once: the weights in one allocation, published as they lie
    optimizer = torch.optim.SGD(trainer.parameters(), lr=1.0)
    sync = WeightTransferTrainerFactory.trainer_init(
        DevipcTrainerInitInfo(rank=0), client=LLMClient(llm), source=ModuleSource(trainer)
    )
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    matched = True
    for step in range(STEPS):
        logits = trainer(torch.tensor([PROMPT])).logits[0]
        loss = torch.nn.functional.cross_entropy(logits, torch.full((len(PROMPT),), REPEAT))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        sync.send_weights(weight_version=f"step {step}")  # start, update, finish on the engine
        held = llm.apply_model(weights_in_use)[0]
        same = all(
            torch.equal(held[name], tensor) for name, tensor in as_vllm_holds(trainer).items()
        )
        matched &= same
        tokens = (
            llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], greedy, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        print(
            f"step {step}: engine weights {'equal' if same else 'DIFFER FROM'} the trainer's "
            f"(version {llm.get_weight_version()!r}); greedy answer {list(tokens)}"
        )
    sync.shutdown()
    llm.llm_engine.engine_core.shutdown()
    print(
        "the engine held the trainer's weights at every step"
        if matched
        else "the engine's weights differed from the trainer's"
    )


if __name__ == "__main__":
    main()
