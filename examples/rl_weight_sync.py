"""RL-style weight sync on one host: a trainer on openreg:0 publishes its weights after every
optimizer step; two inference engines, each its own process with its own model on openreg:1,
copy every generation into their model and serve with it.

    pack_module(model)            # the trainer's weights and buffers in one allocation, in place
    publisher.publish()           # after each step: returns once both engines acknowledged
    subscriber.wait(); subscriber.copy_into(model); subscriber.ack()   # in each engine

Each engine reports per-tensor sums of its own model after each generation; the trainer
compares them, exactly, with its own. Run: `.venv/bin/python examples/rl_weight_sync.py`.
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


class Block(torch.nn.Module):
    """One transformer-ish block: single-head causal attention and an MLP, both residual."""

    def __init__(self, device):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(WIDTH, device=device)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH, device=device)
        self.proj = torch.nn.Linear(WIDTH, WIDTH, device=device)
        self.ln_2 = torch.nn.LayerNorm(WIDTH, device=device)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH, device=device)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH, device=device)

    def forward(self, x, mask):
        q, k, v = self.qkv(self.ln_1(x)).split(WIDTH, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(WIDTH)
        scores = scores.masked_fill(mask == 0, float("-inf"))
        x = x + self.proj(scores.softmax(dim=-1) @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln_2(x))))


class TinyGPT(torch.nn.Module):
    """Token and position embeddings, two blocks, a final LayerNorm, a head tied to the token
    embedding, and a persistent causal mask: all of it in the state dict, so all of it is
    published."""

    def __init__(self, device):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, WIDTH, device=device)
        self.pos = torch.nn.Embedding(CONTEXT, WIDTH, device=device)
        self.blocks = torch.nn.ModuleList([Block(device), Block(device)])
        self.ln_f = torch.nn.LayerNorm(WIDTH, device=device)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False, device=device)
        self.head.weight = self.tok.weight  # tied
        torch.nn.init.normal_(self.tok.weight, std=0.02)
        self.register_buffer("mask", torch.tril(torch.ones(CONTEXT, CONTEXT, device=device)))

    def forward(self, tokens):
        length = tokens.shape[-1]
        x = self.tok(tokens) + self.pos(torch.arange(length, device=tokens.device))
        mask = self.mask[:length, :length]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def sums(model):
    """Each state-dict tensor's sum, as a Python float: what the trainer and engines compare."""
    return {name: t.detach().double().sum().item() for name, t in model.state_dict().items()}


def engine(conn, token, index):
    """An inference engine: its own model on openreg:1, refreshed from every generation."""
    torch.manual_seed(100 + index)  # weights unlike the trainer's until the first copy
    model = TinyGPT("openreg:1").eval()
    prompt = torch.tensor([[1, 2, 3, 4]], device="openreg:1")
    with devipc.WeightSubscriber(token, device="openreg:1") as subscriber:
        conn.send(("ready", str(subscriber.device)))
        while True:
            try:
                generation = subscriber.wait(timeout=TIMEOUT)
            except devipc.PeerGoneError:  # the trainer closed its publisher: training is over
                break
            subscriber.copy_into(model)
            subscriber.ack()  # the copy is done: the trainer may write its weights again
            with torch.no_grad():
                next_token = model(prompt)[0, -1].argmax().item()  # serve with the new weights
            conn.send((generation, sums(model), next_token))
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
                proc = ctx.Process(target=engine, args=(theirs, publisher.token(), index),
                                   daemon=True)
                proc.start()
                theirs.close()
                procs.append(proc)
                conns.append(ours)
            for conn in conns:
                assert receive(conn) == ("ready", "openreg:1")  # mapped there, no copy
            for step in range(STEPS):
                tokens = torch.randint(0, VOCAB, (8, CONTEXT + 1), device="openreg:0")
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                         tokens[:, 1:].reshape(-1))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()  # writes the packed weights in place
                generation = publisher.publish(timeout=TIMEOUT)  # both engines acknowledged
                expected = sums(model)  # nothing writes the weights until the next step
                served = []
                for index, conn in enumerate(conns):
                    seen, engine_sums, next_token = receive(conn)
                    if seen != generation or engine_sums != expected:
                        wrong = [n for n in expected if engine_sums.get(n) != expected[n]]
                        raise SystemExit(f"engine {index} differs from the trainer at step "
                                         f"{step} (generation {seen}): {wrong[:5]}")
                    served.append(next_token)
                print(f"step {step}: loss {loss.item():.4f}, generation {generation}, "
                      f"{ENGINES} engines match the trainer (next tokens {served})")
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
