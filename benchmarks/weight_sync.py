"""A whole state_dict synced producer -> consumer, until the consumer has every tensor on its
device, five ways, one run:

  torch-cpu     torch's reduce_tensor path: CPU tensors already share_memory_()'d, one per message
  per-tensor    devipc: openreg tensors through the queue, one handle each
  bucket        devipc.share_state_dict: the weights copied into one bucket, one handle
  packed        the trainer keeps its weights in devipc.pack()'s one allocation:
                share_state_dict(copy=False), one handle, no copy
  arena         devipc.Arena of 2 buffers, each 1/8 of the total: chunks, each copied out by the
                consumer and acknowledged; the producer fills one buffer while the other is read
  arena-1       the same with one buffer: no overlap, the measure of what double-buffering buys
  via-cpu       copy through the host: .cpu() per tensor, the queue, .to("openreg")

Then the arena's device memory across >= 50 chunks.
Usage: python benchmarks/weight_sync.py [--mib N] [--steps N] [--tight-loop]
"""
import argparse
import statistics
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


def settle():
    """Run the releases of what the consumer dropped before the next sync comes, as the
    collector thread does between a trainer's steps: no sync pays for the one before it."""
    torch.accelerator.synchronize()
    deadline = time.monotonic() + TIMEOUT
    while devipc.ipc_collect() is not None and devipc.stats()["pending_releases"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the consumer's releases did not run")
        time.sleep(0.001)


def consumer(inbox, outbox, settle_between):
    readers = {}
    while (message := inbox.get(timeout=TIMEOUT)) is not None:
        mode, payload = message
        if mode == "attach":
            name, data = payload
            readers[name] = devipc.open_arena(data)
            outbox.send("attached")
            continue
        held = []
        if mode in ("torch-cpu", "per-tensor", "via-cpu"):
            for _ in range(payload):
                tensor = inbox.get(timeout=TIMEOUT)
                held.append(tensor.to("openreg") if mode == "via-cpu" else tensor)
        elif mode in ("bucket", "packed"):
            held = list(devipc.open_state_dict(payload).values())
        elif mode in readers:
            reader = readers[mode]
            while (data := inbox.get(timeout=TIMEOUT)) is not None:
                chunk = reader.read(data)
                held += [t.clone() for t in chunk.tensors.values()]
                reader.ack(chunk)
                del chunk
        torch.accelerator.synchronize()
        outbox.send("done")  # the clock stops here; what follows is not timed
        total = checksum(held)
        del held
        if settle_between:
            settle()
        outbox.send(total)
    for reader in readers.values():
        reader.close()


def receive(outbox):
    """The consumer's next reply. Replies go through a pipe, written by the consumer's own
    thread: a Queue's feeder thread can wait for the GIL while the consumer computes its
    (untimed) checksum, and "done" would arrive milliseconds late."""
    if not outbox.poll(TIMEOUT):
        raise TimeoutError(f"no reply from the consumer within {TIMEOUT} s")
    return outbox.recv()


def progress(text):
    print(f"  {text}", flush=True)


def sync(mode, state, cpu_state, packed, arenas, inbox, outbox) -> tuple[float, int]:
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
    elif mode == "packed":
        inbox.put((mode, bytes(devipc.share_state_dict(packed, copy=False))))
        opened = 1
    else:
        arena = arenas[mode]
        inbox.put((mode, None))
        for chunk in chunks_of(state, arena.nbytes):
            inbox.put(arena.put(chunk, timeout=TIMEOUT))
        inbox.put(None)
        opened = 0  # the arena was opened once, before
    assert receive(outbox) == "done"
    elapsed = time.perf_counter() - start
    got = receive(outbox)
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
        receive(outbox)
    return before, seen, torch.openreg.max_memory_allocated() - before


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="total size of the state_dict")
    parser.add_argument("--steps", type=int, default=5,
                        help="syncs after the first (a trainer syncs every step), median shown")
    parser.add_argument("--tight-loop", action="store_true",
                        help="syncs back to back: the consumer's releases of one sync run in "
                             "the next (by default they run between syncs, untimed)")
    args = parser.parse_args()
    total = args.mib << 20
    shapes = transformer_shapes(total)
    gen = torch.Generator().manual_seed(0)
    cpu_state = {name: torch.randn(shape, generator=gen) for name, shape in shapes}
    state = {name: tensor.to("openreg") for name, tensor in cpu_state.items()}
    packed = devipc.pack(state)  # the same weights, kept in one allocation
    for tensor in cpu_state.values():
        tensor.share_memory_()
    nbytes = sum(t.nbytes for t in state.values())
    print(f"state_dict: {len(state)} tensors, {nbytes / 2**20:.0f} MiB; the consumer's releases "
          f"run {'in the next sync' if args.tight_loop else 'between syncs'}", flush=True)

    ctx = mp.get_context("spawn")
    inbox = ctx.Queue()
    outbox, replies = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=consumer, args=(inbox, replies, not args.tight_loop), daemon=True)
    proc.start()
    try:
        biggest = max(-(-t.nbytes // 256) * 256 for t in state.values())
        arenas = {"arena": devipc.Arena(max(nbytes // 8, biggest), "openreg", buffers=2),
                  "arena-1": devipc.Arena(max(nbytes // 8, biggest), "openreg", buffers=1)}
        for name, one in arenas.items():
            inbox.put(("attach", (name, one.attach())))
            assert receive(outbox) == "attached"
        arena = arenas["arena"]
        results = {}
        for mode in ("torch-cpu", "per-tensor", "bucket", "packed", "arena", "arena-1",
                     "via-cpu"):
            times = []
            for step in range(1 + args.steps):
                devipc.ipc_collect()  # what the last sync released, as the collector would
                seconds, opened = sync(mode, state, cpu_state, packed, arenas, inbox, outbox)
                times.append(seconds)
                progress(f"{mode} sync {step + 1}/{1 + args.steps}: {seconds:.3f} s")
            results[mode] = (times[0], statistics.median(times[1:]), opened)
        chunks = sum(1 for _ in chunks_of(state, arena.nbytes))
        rounds = -(-50 // chunks)
        progress(f"arena memory over {rounds * chunks} chunks ...")
        before, seen, peak = arena_memory(state, arena, inbox, outbox, rounds)
        for one in arenas.values():
            one.close()
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
    arena_bytes = sum(one.buffers * one.nbytes for one in arenas.values())
    print("\n| mode | first sync s | later syncs s (median) | GB/s (later) | handles opened |"
          "\n|---|---:|---:|---:|---:|")
    for mode, (first, later, opened) in results.items():
        print(f"| {mode} | {first:.3f} | {later:.3f} | {nbytes / later / 1e9:.2f} | {opened} |")
    for column, what in ((1, "later syncs"), (0, "first sync")):
        for bucket in ("packed", "bucket"):
            print(f"{what}: " + ", ".join(
                f"{mode} / {bucket} = {results[mode][column] / results[bucket][column]:.1f}x"
                for mode in ("per-tensor", "torch-cpu", "arena", "via-cpu")))
    print(f"double-buffering: arena-1 / arena = "
          f"{results['arena-1'][1] / results['arena'][1]:.2f}x (later syncs)")
    print(f"arena: {arena.buffers} x {arena.nbytes / 2**20:.1f} MiB, {len(seen)} chunks; "
          f"memory_allocated after each put, relative to before: min {min(seen)}, "
          f"max {max(seen)} bytes; peak +{peak / 2**20:.1f} MiB; "
          f"after close: {(after_close + arena_bytes) / 2**20:+.1f} MiB "
          f"against before the arenas existed")


if __name__ == "__main__":
    main()
