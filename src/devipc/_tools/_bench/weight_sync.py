"""A whole state_dict synced producer -> consumer, until the consumer has every tensor on its
device, seven ways, one run:

  torch-cpu     torch's reduce_tensor path: CPU tensors already share_memory_()'d, one per message
  per-tensor    devipc: device tensors through the queue, one handle each
  bucket        devipc.share_state_dict: the weights copied into one bucket, one handle
  packed        the trainer keeps its weights in devipc.pack()'s one allocation:
                share_state_dict(copy=False), one handle, no copy
  arena         devipc.Arena of 2 buffers, each 1/8 of the total: chunks, each copied out by the
                consumer and acknowledged; the producer fills one buffer while the other is read
  arena-1       the same with one buffer: no overlap, the measure of what double-buffering buys
  via-cpu       copy through the host: .cpu() per tensor, the queue, .to(device)

Then the arena's device memory across >= 50 chunks (when the device module counts its memory).
"""

import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp

from ..._core import _handles, _sharing
from ..._core._state_dict import open_state_dict, share_state_dict
from ..._weights._arena import Arena, ArenaReader, open_arena
from .._common import hook_modules, load_modules
from .common import Panel, Progress, markdown

__all__ = ["LABELS", "MODES", "measure", "panel", "table", "transformer_shapes"]

TIMEOUT = 600
COUNT = 1000
MODES = ("torch-cpu", "per-tensor", "bucket", "packed", "arena", "arena-1", "via-cpu")
# What a plot calls each mode: what a user would write to sync that way
LABELS = {
    "torch-cpu": "torch CPU shared, per tensor",
    "per-tensor": "devipc, per tensor",
    "bucket": "share_state_dict (copy)",
    "packed": "pack + share_state_dict",
    "arena": "Arena, 2 buffers",
    "arena-1": "Arena, 1 buffer",
    "via-cpu": "copy through CPU",
}


def transformer_shapes(total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """COUNT float32 parameter shapes of a GPT-like model whose size is about `total_bytes`."""
    layers = -(-(COUNT - 4) // 16)  # the last layer is cut at COUNT tensors
    hidden = max(8, int((total_bytes / 4 / (12 * layers + 40)) ** 0.5) // 8 * 8)
    shapes = [
        ("wte.weight", (8 * hidden, hidden)),
        ("wpe.weight", (2 * hidden, hidden)),
        ("ln_f.weight", (hidden,)),
        ("ln_f.bias", (hidden,)),
    ]
    for i in range(layers):
        for name, shape in [
            ("ln_1.weight", (hidden,)),
            ("ln_1.bias", (hidden,)),
            ("attn.q.weight", (hidden, hidden)),
            ("attn.q.bias", (hidden,)),
            ("attn.k.weight", (hidden, hidden)),
            ("attn.k.bias", (hidden,)),
            ("attn.v.weight", (hidden, hidden)),
            ("attn.v.bias", (hidden,)),
            ("attn.o.weight", (hidden, hidden)),
            ("attn.o.bias", (hidden,)),
            ("ln_2.weight", (hidden,)),
            ("ln_2.bias", (hidden,)),
            ("mlp.up.weight", (4 * hidden, hidden)),
            ("mlp.up.bias", (4 * hidden,)),
            ("mlp.down.weight", (hidden, 4 * hidden)),
            ("mlp.down.bias", (hidden,)),
        ]:
            shapes.append((f"h.{i}.{name}", shape))
    return shapes[:COUNT]


def chunks_of(state: dict[str, torch.Tensor], limit: int) -> Iterator[dict[str, torch.Tensor]]:
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in state.items():
        need = -(-tensor.nbytes // 256) * 256
        if chunk and size + need > limit:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = tensor
        size += need
    if chunk:
        yield chunk


def checksum(tensors: Iterable[torch.Tensor]) -> float:
    return float(torch.stack([t.reshape(-1)[0].float().cpu() for t in tensors]).sum())


def settle() -> None:
    """Run the releases of what the consumer dropped before the next sync comes, as the
    collector thread does between a trainer's steps: no sync pays for the one before it."""
    torch.accelerator.synchronize()
    deadline = time.monotonic() + TIMEOUT
    while _sharing.ipc_collect() is not None and _sharing.stats()["pending_releases"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the consumer's releases did not run")
        time.sleep(0.001)


def consumer(
    inbox: Any, outbox: Any, settle_between: bool, device: str, modules: list[str]
) -> None:
    load_modules(modules)
    readers: dict[str, ArenaReader] = {}
    while (message := inbox.get(timeout=TIMEOUT)) is not None:
        mode, payload = message
        if mode == "attach":
            name, data = payload
            readers[name] = open_arena(data)
            outbox.send("attached")
            continue
        held: list[torch.Tensor] = []
        if mode in ("torch-cpu", "per-tensor", "via-cpu"):
            for _ in range(payload):
                tensor = inbox.get(timeout=TIMEOUT)
                held.append(tensor.to(device) if mode == "via-cpu" else tensor)
        elif mode in ("bucket", "packed"):
            held = list(open_state_dict(payload).values())
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


def receive(outbox: Any) -> Any:
    """The consumer's next reply. Replies go through a pipe, written by the consumer's own
    thread: a Queue's feeder thread can wait for the GIL while the consumer computes its
    (untimed) checksum, and "done" would arrive milliseconds late."""
    if not outbox.poll(TIMEOUT):
        raise TimeoutError(f"no reply from the consumer within {TIMEOUT} s")
    return outbox.recv()


def sync(
    mode: str,
    state: dict,
    cpu_state: dict,
    packed: dict,
    arenas: dict[str, Arena],
    inbox: Any,
    outbox: Any,
) -> tuple[float, int]:
    """Seconds until the consumer holds every tensor; handles opened in the consumer."""
    start = time.perf_counter()
    if mode in ("torch-cpu", "per-tensor", "via-cpu"):
        inbox.put((mode, len(state)))
        source = cpu_state if mode == "torch-cpu" else state
        for tensor in source.values():
            inbox.put(tensor.cpu() if mode == "via-cpu" else tensor)
        opened = 0 if mode == "via-cpu" else len(state)
    elif mode == "bucket":
        inbox.put((mode, bytes(share_state_dict(state))))
        opened = 1
    elif mode == "packed":
        inbox.put((mode, bytes(share_state_dict(packed, copy=False))))
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


def arena_memory(
    state: dict, arena: Arena, inbox: Any, outbox: Any, rounds: int, memory: Any
) -> tuple[int, list[int], int]:
    """memory_allocated after each put of `rounds` syncs, relative to before the first."""
    before = memory.memory_allocated()
    memory.reset_peak_memory_stats()
    seen = []
    for _ in range(rounds):
        inbox.put(("arena", None))
        for chunk in chunks_of(state, arena.nbytes):
            inbox.put(arena.put(chunk, timeout=TIMEOUT))
            seen.append(memory.memory_allocated() - before)
        inbox.put(None)
        receive(outbox)
    return before, seen, memory.max_memory_allocated() - before


def measure(
    device: str,
    mib: int = 256,
    steps: int = 5,
    tight_loop: bool = False,
    progress: Progress | None = None,
) -> dict:
    """{"results": {mode: (first sync s, later syncs s median, handles opened)}, "nbytes",
    "tensors", "arena": what arena_memory saw, or None where the device counts no memory}."""
    progress = progress or Progress("weight-sync", lines=True)
    shapes = transformer_shapes(mib << 20)
    gen = torch.Generator().manual_seed(0)
    cpu_state = {name: torch.randn(shape, generator=gen) for name, shape in shapes}
    state = {name: tensor.to(device) for name, tensor in cpu_state.items()}
    packed = _handles.pack(state)  # the same weights, kept in one allocation
    for tensor in cpu_state.values():
        tensor.share_memory_()
    nbytes = sum(t.nbytes for t in state.values())
    module = torch.get_device_module(torch.device(device).type)
    counts_memory = all(
        hasattr(module, name)
        for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")
    )
    progress.note(
        f"state_dict: {len(state)} tensors, {nbytes / 2**20:.0f} MiB; the consumer's "
        f"releases run {'in the next sync' if tight_loop else 'between syncs'}"
    )
    progress.start(len(MODES) * (1 + steps) + counts_memory)
    ctx = mp.get_context("spawn")
    inbox = ctx.Queue()
    outbox, replies = ctx.Pipe(duplex=False)
    modules = hook_modules([torch.device(device).type])
    proc = ctx.Process(
        target=consumer, args=(inbox, replies, not tight_loop, device, modules), daemon=True
    )
    proc.start()
    arena_seen: dict | None = None
    try:
        biggest = max(-(-t.nbytes // 256) * 256 for t in state.values())
        arenas = {
            "arena": Arena(max(nbytes // 8, biggest), device, buffers=2),
            "arena-1": Arena(max(nbytes // 8, biggest), device, buffers=1),
        }
        for name, one in arenas.items():
            inbox.put(("attach", (name, one.attach())))
            assert receive(outbox) == "attached"
        arena = arenas["arena"]
        results = {}
        for mode in MODES:
            times = []
            for step in range(1 + steps):
                _sharing.ipc_collect()  # what the last sync released, as the collector would
                seconds, opened = sync(mode, state, cpu_state, packed, arenas, inbox, outbox)
                times.append(seconds)
                progress.step(f"{mode} sync {step + 1}/{1 + steps}: {seconds:.3f} s")
            results[mode] = (times[0], statistics.median(times[1:] or times), opened)
        if counts_memory:
            chunks = sum(1 for _ in chunks_of(state, arena.nbytes))
            rounds = -(-50 // chunks)
            before, seen, peak = arena_memory(state, arena, inbox, outbox, rounds, module)
            progress.step(f"arena memory over {rounds * chunks} chunks")
        for one in arenas.values():
            one.close()
        inbox.put(None)
        proc.join(TIMEOUT)
        torch.accelerator.synchronize()
        deadline = time.monotonic() + 30
        while (
            _sharing.ipc_collect() is not None
            and _sharing.stats()["sent"]
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        if counts_memory:
            arena_bytes = sum(one.buffers * one.nbytes for one in arenas.values())
            arena_seen = {
                "buffers": arena.buffers,
                "nbytes": arena.nbytes,
                "seen": seen,
                "peak": peak,
                "after_close": module.memory_allocated() - before + arena_bytes,
            }
    finally:
        progress.close()
        if proc.is_alive():
            proc.kill()
            proc.join(TIMEOUT)
    return {"results": results, "nbytes": nbytes, "tensors": len(state), "arena": arena_seen}


def table(measured: dict) -> str:
    nbytes = measured["nbytes"]
    return markdown(
        ["mode", "first sync s", "later syncs s (median)", "GB/s (later)", "handles opened"],
        [
            [mode, f"{first:.3f}", f"{later:.3f}", f"{nbytes / later / 1e9:.2f}", opened]
            for mode, (first, later, opened) in measured["results"].items()
        ],
    )


def panel(measured: dict) -> Panel:
    results = measured["results"]
    return Panel(
        f"weight sync, {measured['nbytes'] / 2**20:.0f} MiB state_dict",
        "seconds",
        [LABELS[mode] for mode in results],
        {
            "first sync": [r[0] for r in results.values()],
            "later syncs (median)": [r[1] for r in results.values()],
        },
        bars=True,
    )
