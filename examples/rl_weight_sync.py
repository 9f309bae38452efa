"""RL-style weight sync on one host: a trainer on openreg:0 publishes its fp32 weights after
every optimizer step; two inference engines, each its own process with its own model on
openreg:1, take every generation and serve with it:

- engine 0 has the trainer's layout and dtype: `subscriber.copy_into(model)`;
- engine 1 serves in bfloat16 with q, k and v fused into one projection, as vLLM's and SGLang's
  models are, and loads through its own `model.load_weights(subscriber.weights())`, which fuses
  and converts as it copies.

    pack_module(model)            # the trainer's weights and buffers in one allocation, in place
    publisher.publish()           # after each step: returns once both engines acknowledged
    subscriber.wait(); subscriber.copy_into(model); subscriber.ack()   # in an engine

Each engine reports per-tensor sums of its weights by the trainer's names after each generation
(engine 1 of its fused rows, in bf16); the trainer compares them, exactly, with its own (rounded
to bf16 for engine 1). Several engine processes on one host: give each its share of the cores
(`torch.set_num_threads`, or OMP_NUM_THREADS before it starts), or they fight over them.
Run: `.venv/bin/python examples/rl_weight_sync.py`.
"""

import math
import time

import torch
import torch.multiprocessing as mp

import devipc
import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)

TIMEOUT = 30  # seconds: every wait, receive and join is bounded
STEPS = 5
ENGINES = 2
VOCAB, CONTEXT, WIDTH = 64, 16, 32


PARTS = ("q", "k", "v")  # the trainer's projections that engine 1 keeps stacked in `qkv`


class Block(torch.nn.Module):
    """One transformer-ish block: single-head causal attention and an MLP, both residual. The
    trainer's has q, k and v projections of their own; a fused one (engine 1's) one `qkv`."""

    def __init__(self, device, fused=False, dtype=torch.float32):
        super().__init__()
        kind = dict(device=device, dtype=dtype)
        self.ln_1 = torch.nn.LayerNorm(WIDTH, **kind)
        if fused:
            self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH, **kind)
        else:
            for part in PARTS:
                setattr(self, part, torch.nn.Linear(WIDTH, WIDTH, **kind))
        self.proj = torch.nn.Linear(WIDTH, WIDTH, **kind)
        self.ln_2 = torch.nn.LayerNorm(WIDTH, **kind)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH, **kind)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH, **kind)

    def forward(self, x, mask):
        h = self.ln_1(x)
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(h).split(WIDTH, dim=-1)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(WIDTH)
        scores = scores.masked_fill(mask == 0, float("-inf"))
        x = x + self.proj(scores.softmax(dim=-1) @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln_2(x))))


class TinyGPT(torch.nn.Module):
    """Token and position embeddings, two blocks, a final LayerNorm, a head tied to the token
    embedding, and a persistent causal mask: all of it in the state dict, so all of it is
    published."""

    def __init__(self, device, fused=False, dtype=torch.float32):
        super().__init__()
        kind = dict(device=device, dtype=dtype)
        self.tok = torch.nn.Embedding(VOCAB, WIDTH, **kind)
        self.pos = torch.nn.Embedding(CONTEXT, WIDTH, **kind)
        self.blocks = torch.nn.ModuleList([Block(device, fused, dtype) for _ in range(2)])
        self.ln_f = torch.nn.LayerNorm(WIDTH, **kind)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False, **kind)
        self.head.weight = self.tok.weight  # tied
        torch.nn.init.normal_(self.tok.weight, std=0.02)
        self.register_buffer("mask", torch.tril(torch.ones(CONTEXT, CONTEXT, **kind)))

    def forward(self, tokens):
        length = tokens.shape[-1]
        x = self.tok(tokens) + self.pos(torch.arange(length, device=tokens.device))
        mask = self.mask[:length, :length]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


class ServingGPT(TinyGPT):
    """Engine 1's model: bfloat16, q/k/v fused, loaded the way inference engines load."""

    def __init__(self, device):
        super().__init__(device, fused=True, dtype=torch.bfloat16)

    def load_weights(self, weights):
        """Take (name, tensor) pairs by the trainer's names: a q, k or v projection goes into
        its third of `qkv`, the rest by name; each `copy_` converts to bf16."""
        params = self.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                for shard, part in enumerate(PARTS):
                    if f".{part}." in name:
                        fused = params[name.replace(f".{part}.", ".qkv.")]
                        fused[shard * WIDTH : (shard + 1) * WIDTH].copy_(tensor)
                        break
                else:
                    params[name].copy_(tensor)

    def by_trainer_names(self):
        """Its weights as the trainer names them: each third of `qkv` as its q, k or v."""
        for name, tensor in self.state_dict().items():
            if ".qkv." in name:
                for shard, part in enumerate(PARTS):
                    yield (
                        name.replace(".qkv.", f".{part}."),
                        tensor[shard * WIDTH : (shard + 1) * WIDTH],
                    )
            else:
                yield name, tensor


def sums(named, dtype=None):
    """Each tensor's sum (in `dtype` first, if given), as a Python float: what the trainer and
    engines compare."""
    return {
        name: (t.detach() if dtype is None else t.detach().to(dtype)).double().sum().item()
        for name, t in named
    }


def engine(conn, token, index):
    """An inference engine: its own model on openreg:1, refreshed from every generation."""
    torch.manual_seed(100 + index)  # weights unlike the trainer's until the first copy
    torch.set_num_threads(1)  # engines beside each other: a core each, not all of them each
    model = (ServingGPT("openreg:1") if index == 1 else TinyGPT("openreg:1")).eval()
    prompt = torch.tensor([[1, 2, 3, 4]], device="openreg:1")
    with devipc.WeightSubscriber(token, device="openreg:1") as subscriber:
        conn.send(("ready", str(subscriber.device)))
        while True:
            try:
                generation = subscriber.wait(timeout=TIMEOUT)
            except devipc.PeerGoneError:  # the trainer closed its publisher: training is over
                break
            if isinstance(model, ServingGPT):
                model.load_weights(subscriber.weights())  # the engine's own loader
                named = model.by_trainer_names()
            else:
                subscriber.copy_into(model)
                named = model.state_dict().items()
            subscriber.ack()  # the copy is done: the trainer may write its weights again
            with torch.no_grad():
                next_token = model(prompt)[0, -1].argmax().item()  # serve with the new weights
            conn.send((generation, sums(named), next_token))
    conn.send("done")


def receive(conn):
    if not conn.poll(TIMEOUT):
        raise TimeoutError(f"no word from an engine within {TIMEOUT} s")
    return conn.recv()


def main():
    start = time.monotonic()
    torch.manual_seed(0)
    model = TinyGPT("openreg:0")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)  # made before packing: still works
    devipc.pack_module(model)  # parameters and the mask now live in one allocation
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        with devipc.WeightPublisher(model) as publisher:  # copy=False: engines read our memory
            for index in range(ENGINES):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=engine, args=(theirs, publisher.token(), index), daemon=True
                )
                proc.start()
                theirs.close()
                procs.append(proc)
                conns.append(ours)
            for conn in conns:
                assert receive(conn) == ("ready", "openreg:1")  # mapped there, no copy
            for step in range(STEPS):
                tokens = torch.randint(0, VOCAB, (8, CONTEXT + 1), device="openreg:0")
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
                )
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()  # writes the packed weights in place
                generation = publisher.publish(timeout=TIMEOUT)  # both engines acknowledged
                weights = model.state_dict().items()  # nothing writes them until the next step
                expected = [sums(weights), sums(weights, torch.bfloat16)]  # engine 0's, 1's
                served = []
                for index, conn in enumerate(conns):
                    seen, engine_sums, next_token = receive(conn)
                    want = expected[index]
                    if seen != generation or engine_sums != want:
                        wrong = [n for n in want if engine_sums.get(n) != want[n]]
                        raise SystemExit(
                            f"engine {index} differs from the trainer at step "
                            f"{step} (generation {seen}): {wrong[:5]}"
                        )
                    served.append(next_token)
                print(
                    f"step {step}: loss {loss.item():.4f}, generation {generation}, "
                    f"{ENGINES} engines match the trainer (next tokens {served})"
                )
        for conn in conns:  # the publisher is closed: each engine's wait ended
            assert receive(conn) == "done"
        for proc in procs:
            proc.join(TIMEOUT)
            if proc.exitcode != 0:
                raise SystemExit(f"{proc.name} exited with {proc.exitcode}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(TIMEOUT)
        for conn in conns:
            conn.close()
    print(f"({time.monotonic() - start:.1f} s)")
    print("all engines matched the trainer at every step")


if __name__ == "__main__":
    main()
