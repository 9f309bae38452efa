"""A whole state_dict synced producer -> consumer, until the consumer has every tensor on its
device, five ways, one run:

  torch-cpu     torch's reduce_tensor path: CPU tensors already share_memory_()'d, one per message
  per-tensor    devipc: openreg tensors through the queue, one handle each
  bucket        devipc.share_state_dict: one packed bucket, one handle
  arena         devipc.Arena with a bucket 1/8 of the total: chunks, each copied out, acknowledged
  via-cpu       copy through the host: .cpu() per tensor, the queue, .to("openreg")

Then the arena's device memory across >= 50 chunks.
Usage: python benchmarks/weight_sync.py [--mib N]
"""
import argparse
import time

import torch
import torch.multiprocessing as mp

import devipc
import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)

TIMEOUT = 600
COUNT = 1000


def transformer_shapes(total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """COUNT float32 parameter shapes of a GPT-like model whose size is about `total_bytes`."""
    layers = -(-(COUNT - 4) // 16)  # the last layer is cut at COUNT tensors
    hidden = int((total_bytes / 4 / (12 * layers + 40)) ** 0.5) // 8 * 8
    shapes = [("wte.weight", (8 * hidden, hidden)), ("wpe.weight", (2 * hidden, hidden)),
              ("ln_f.weight", (hidden,)), ("ln_f.bias", (hidden,))]
    for i in range(layers):
        for name, shape in [("ln_1.weight", (hidden,)), ("ln_1.bias", (hidden,)),
                            ("attn.q.weight", (hidden, hidden)), ("attn.q.bias", (hidden,)),
                            ("attn.k.weight", (hidden, hidden)), ("attn.k.bias", (hidden,)),
                            ("attn.v.weight", (hidden, hidden)), ("attn.v.bias", (hidden,)),
                            ("attn.o.weight", (hidden, hidden)), ("attn.o.bias", (hidden,)),
                            ("ln_2.weight", (hidden,)), ("ln_2.bias", (hidden,)),
                            ("mlp.up.weight", (4 * hidden, hidden)), ("mlp.up.bias", (4 * hidden,)),
                            ("mlp.down.weight", (hidden, 4 * hidden)),
                            ("mlp.down.bias", (hidden,))]:
            shapes.append((f"h.{i}.{name}", shape))
    return shapes[:COUNT]


def chunks_of(state, limit):
    chunk, size = {}, 0
    for name, tensor in state.items():
        need = -(-tensor.nbytes // 256) * 256
        if chunk and size + need > limit:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = tensor
        size += need
    if chunk:
        yield chunk


def checksum(tensors) -> float:
    return float(torch.stack([t.reshape(-1)[0].float().cpu() for t in tensors]).sum())


def consumer(inbox, outbox):
    reader = None
    while (message := inbox.get(timeout=TIMEOUT)) is not None:
        mode, payload = message
        if mode == "attach":
            reader = devipc.open_arena(payload)
            outbox.put("attached")
            continue
        held = []
        if mode in ("torch-cpu", "per-tensor", "via-cpu"):
            for _ in range(payload):
                tensor = inbox.get(timeout=TIMEOUT)
                held.append(tensor.to("openreg") if mode == "via-cpu" else tensor)
        elif mode == "bucket":
            held = list(devipc.open_state_dict(payload).values())
        elif mode == "arena":
            while (data := inbox.get(timeout=TIMEOUT)) is not None:
                chunk = reader.read(data)
                held += [t.clone() for t in chunk.tensors.values()]
                reader.ack(chunk)
                del chunk
        torch.accelerator.synchronize()
        outbox.put(checksum(held))
        del held
    if reader is not None:
        reader.close()


def progress(text):
    print(f"  {text}", flush=True)


def sync(mode, state, cpu_state, arena, inbox, outbox) -> tuple[float, int]:
    """Seconds until the consumer holds every tensor; handles opened in the consumer."""
    start = time.perf_counter()
    if mode in ("torch-cpu", "per-tensor", "via-cpu"):
        inbox.put((mode, len(state)))
        source = cpu_state if mode == "torch-cpu" else state
        for tensor in source.values():
            inbox.put(tensor.cpu() if mode == "via-cpu" else tensor)
        opened = 0 if mode == "via-cpu" else len(state)
    elif mode == "bucket":
        inbox.put((mode, bytes(devipc.share_state_dict(state))))
        opened = 1
    else:
        inbox.put((mode, None))
        for chunk in chunks_of(state, arena.nbytes):
            inbox.put(arena.put(chunk, timeout=TIMEOUT))
        inbox.put(None)
        opened = 0  # the arena was opened once, before
    got = outbox.get(timeout=TIMEOUT)
    elapsed = time.perf_counter() - start
    expected = checksum(state.values())
    assert abs(got - expected) <= 1e-3 * max(1.0, abs(expected)), (mode, got, expected)
    return elapsed, opened


def arena_memory(state, arena, inbox, outbox, rounds):
    """memory_allocated after each put of `rounds` syncs, relative to before the first."""
    before = torch.openreg.memory_allocated()
    torch.openreg.reset_peak_memory_stats()
    seen = []
    for _ in range(rounds):
        inbox.put(("arena", None))
        for chunk in chunks_of(state, arena.nbytes):
            inbox.put(arena.put(chunk, timeout=TIMEOUT))
            seen.append(torch.openreg.memory_allocated() - before)
        inbox.put(None)
        outbox.get(timeout=TIMEOUT)
    return before, seen, torch.openreg.max_memory_allocated() - before


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="total size of the state_dict")
    args = parser.parse_args()
    total = args.mib << 20
    shapes = transformer_shapes(total)
    gen = torch.Generator().manual_seed(0)
    cpu_state = {name: torch.randn(shape, generator=gen) for name, shape in shapes}
    state = {name: tensor.to("openreg") for name, tensor in cpu_state.items()}
    for tensor in cpu_state.values():
        tensor.share_memory_()
    nbytes = sum(t.nbytes for t in state.values())
    print(f"state_dict: {len(state)} tensors, {nbytes / 2**20:.0f} MiB", flush=True)

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(inbox, outbox), daemon=True)
    proc.start()
    try:
        biggest = max(-(-t.nbytes // 256) * 256 for t in state.values())
        arena = devipc.Arena(max(nbytes // 8, biggest), "openreg")
        inbox.put(("attach", arena.attach()))
        assert outbox.get(timeout=TIMEOUT) == "attached"
        results = {}
        for mode in ("torch-cpu", "per-tensor", "bucket", "arena", "via-cpu"):
            progress(f"{mode} ...")
            results[mode] = sync(mode, state, cpu_state, arena, inbox, outbox)
            progress(f"{mode}: {results[mode][0]:.3f} s")
            devipc.ipc_collect()
        chunks = sum(1 for _ in chunks_of(state, arena.nbytes))
        rounds = -(-50 // chunks)
        progress(f"arena memory over {rounds * chunks} chunks ...")
        before, seen, peak = arena_memory(state, arena, inbox, outbox, rounds)
        arena.close()
        inbox.put(None)
        proc.join(TIMEOUT)
        torch.accelerator.synchronize()
        deadline = time.monotonic() + 30
        while devipc.ipc_collect() is not None and devipc.stats()["sent"] \
                and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        if proc.is_alive():
            proc.kill()
    after_close = torch.openreg.memory_allocated() - before
    print("\n| mode | seconds | GB/s | handles opened |\n|---|---:|---:|---:|")
    for mode, (seconds, opened) in results.items():
        print(f"| {mode} | {seconds:.3f} | {nbytes / seconds / 1e9:.2f} | {opened} |")
    bucket = results["bucket"][0]
    print(f"\nper-tensor / bucket = {results['per-tensor'][0] / bucket:.1f}x, "
          f"torch-cpu / bucket = {results['torch-cpu'][0] / bucket:.1f}x, "
          f"via-cpu / bucket = {results['via-cpu'][0] / bucket:.1f}x")
    print(f"arena: {arena.buffers} x {arena.nbytes / 2**20:.1f} MiB, {len(seen)} chunks; "
          f"memory_allocated after each put, relative to before: min {min(seen)}, "
          f"max {max(seen)} bytes; peak +{peak / 2**20:.1f} MiB; "
          f"after close: {(after_close + arena.buffers * arena.nbytes) / 2**20:+.1f} MiB "
          f"against before the arena existed")


if __name__ == "__main__":
    main()
