"""vLLM for tests/test_vllm.py and benchmarks/vllm_weight_update.py: a tiny Llama made from a
config (no hub), a vLLM engine in a process of its own driven through a Pipe, and the client that
drives it as vLLM's trainer API expects (`VLLMWeightSyncClient`)."""

import os

import torch

VOCAB, LAYERS = 256, 2


def make_model(
    directory: str, seed: int = 0, hidden: int = 128, layers: int = LAYERS, vocab: int = VOCAB
):
    """A random float32 Llama (head_dim 64, as vLLM's CPU attention needs) saved where vLLM
    loads it; returns the Hugging Face model, the trainer's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(directory)
    return model


def fused(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama's weights as vLLM's model holds them: q, k, v in `qkv_proj` and gate,
    up in `gate_up_proj`."""
    out, parts = (
        {},
        {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        },
    )
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights.items():
        for part, (into, index) in parts.items():
            if f".{part}." in name:
                pending.setdefault(name.replace(part, into), {})[index] = tensor
                break
        else:
            out[name] = tensor
    for name, pieces in pending.items():
        out[name] = torch.cat([pieces[i] for i in sorted(pieces)])
    return out


def engine(conn, model_dir: str, multiprocessing: bool = False) -> None:
    """A vLLM LLM with backend "devipc", answering (method, args) from the Pipe with ("ok",
    result) or ("error", text) until None comes. Multiprocessing on: the engine core and the
    worker are processes of their own, which only the plug-in's entry point reaches."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model's function, by name
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the KV cache, on CPU in RAM
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    extra = {"distributed_executor_backend": "mp"} if multiprocessing else {}
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_seqs=4,
        seed=0,
        weight_transfer_config=WeightTransferConfig(backend="devipc"),
        **extra,
    )
    conn.send(("ok", "ready"))
    while (request := conn.recv()) is not None:
        method, args = request
        try:
            conn.send(("ok", COMMANDS[method](llm, *args)))
        except Exception as error:  # noqa: BLE001 - the test reads it, as vLLM's caller would
            conn.send(("error", f"{type(error).__name__}: {error}"))
    llm.llm_engine.engine_core.shutdown()


def _generate(llm, prompt: list[int], tokens: int) -> list[int]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return list(
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def _weights_in_use(llm) -> dict[str, torch.Tensor]:
    from devipc.vllm import weights_in_use

    return llm.apply_model(weights_in_use)[0]


def process_id(model: torch.nn.Module) -> int:
    """The pid of the process that holds the model: vLLM's worker."""
    return os.getpid()


COMMANDS = {
    "pids": lambda llm: (os.getpid(), llm.apply_model(process_id)[0]),
    "generate": _generate,
    "weights": _weights_in_use,
    "version": lambda llm: llm.get_weight_version(),
    "init_weight_transfer_engine": lambda llm, info: llm.init_weight_transfer_engine(
        {"init_info": info}
    ),
    "start_weight_update": lambda llm: llm.start_weight_update(),
    "update_weights": lambda llm, info: llm.update_weights({"update_info": info}),
    "finish_weight_update": lambda llm, version=None: llm.finish_weight_update(version),
}


class EngineClient:
    """vLLM's `VLLMWeightSyncClient` over the Pipe to an `engine` process: each call returns once
    the engine answered; an error there raises RuntimeError here, with its text."""

    def __init__(self, conn, timeout: float):
        self.conn, self.timeout = conn, timeout

    def call(self, method: str, *args):
        self.send(method, *args)
        return self.answer()

    def send(self, method: str, *args) -> None:
        self.conn.send((method, args))

    def answer(self):
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"the engine did not answer within {self.timeout} s")
        status, result = self.conn.recv()
        if status == "error":
            raise RuntimeError(result)
        return result

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update", weight_version)


def sharded_trainer(conn, rank: int, world: int, port: int, model_dir: str, steps: int, timeout):
    """Rank `rank` of an FSDP2 trainer (`fully_shard` over gloo, CPU) feeding the test's engine
    through backend "devipc": every rank publishes its own shards (`ShardedSource`), rank 0
    hands the engine client's calls to the test over `conn`. After each of `steps` updates rank
    0 sends ("holds", the full weights); then ("published", n) once it published generation n
    alone (the test kills rank 1), and ("done", the elements each rank published) when told."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from devipc.vllm import DevipcTrainerInitInfo, ShardedSource

    class Relay:  # the test process holds the engine's client: hand each call to it
        def __getattr__(self, method):
            return lambda *args: (conn.send((method, args)), conn.recv())[1]

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sync = WeightTransferTrainerFactory.trainer_init(
        DevipcTrainerInitInfo(rank=rank, copy=True, timeout=timeout),
        client=Relay(),
        source=ShardedSource(model),
    )
    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        with torch.no_grad():
            for param in model.parameters():  # a step: each rank moves its own shards
                local = param.to_local()
                local.add_(torch.randn(local.shape, generator=generator) * 0.02)
        sync.send_weights(weight_version=f"step {step}")
        full = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
        if rank == 0:
            conn.send(("holds", full))
    if rank == 0:  # generation `steps`, from rank 0 only
        conn.send(("published", sync.publisher.publish(wait=False)))
    conn.recv()
    sync.shutdown()
    conn.send(("done", sum(shard.numel() for shard in sync.publisher.shards.values())))
