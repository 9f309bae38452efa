"""Per-tensor round trip through torch.multiprocessing.Queue: the producer puts a tensor, the
consumer reads one element of it and replies. Three ways, measured in one run:

  devipc     an openreg tensor, shared zero-copy by devipc
  cpu-shm    torch's own CPU tensor already in shared memory (fd passing)
  via-cpu    copy through the host: .cpu(), the queue, .to("openreg") in the consumer

Usage: python benchmarks/ipc_latency.py [--quick]
"""
import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)

TIMEOUT = 120
WARM_UP = 10  # untimed round trips per mode and size
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]


def consumer(inbox, outbox):
    while (item := inbox.get(timeout=TIMEOUT)) is not None:
        mode, tensor = item
        if mode == "flush":
            outbox.put(None)
            continue
        if mode == "via-cpu":
            tensor = tensor.to("openreg")
        value = int(tensor[-1].item())
        del tensor, item  # releasing what was received is part of the round trip
        outbox.put(value)


def _iterations(nbytes: int, quick: bool) -> int:
    n = 200 if nbytes <= (1 << 20) else 40
    return max(3, n // 4) if quick else n


def _round_trip(inbox, outbox, mode, make) -> float:
    start = time.perf_counter()
    inbox.put((mode, make()))
    value = outbox.get(timeout=TIMEOUT)
    elapsed = time.perf_counter() - start
    assert value == 7, f"{mode}: consumer read {value}"
    # The queue's feeder thread holds the last item it sent until it sends the next one: flush it
    # with a small untimed message, so that freeing this item is not charged to the next mode.
    inbox.put(("flush", None))
    outbox.get(timeout=TIMEOUT)
    return elapsed


def _measure(inbox, outbox, mode, make, iterations) -> float:
    """Median microseconds of one mode. Modes run one after the other, not interleaved: a
    256 MiB copy of via-cpu leaves the caches cold and would slow whatever comes right after."""
    times = [_round_trip(inbox, outbox, mode, make) for _ in range(iterations + WARM_UP)]
    return statistics.median(times[WARM_UP:]) * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(inbox, outbox), daemon=True)
    proc.start()
    rows = []
    try:
        for nbytes in SIZES:
            n = nbytes // 4
            device = torch.full((n,), 7, dtype=torch.int32, device="openreg")
            host = torch.full((n,), 7, dtype=torch.int32).share_memory_()
            iterations = _iterations(nbytes, args.quick)
            ours = _measure(inbox, outbox, "devipc", lambda t=device: t, iterations)
            shm = _measure(inbox, outbox, "cpu-shm", lambda t=host: t, iterations)
            via = _measure(inbox, outbox, "via-cpu", lambda t=device: t.cpu(), iterations)
            rows.append((nbytes, ours, shm, via))
            print(f"{_size(nbytes):>8}  devipc {ours:10.0f} us  cpu-shm {shm:10.0f} us  "
                  f"via-cpu {via:10.0f} us", flush=True)
            del device, host
        inbox.put(None)
        proc.join(TIMEOUT)
    finally:
        if proc.is_alive():
            proc.kill()

    print("\n| size | devipc openreg (us) | torch CPU shared (us) | copy via CPU (us) "
          "| cpu-shm / devipc | via-cpu / devipc |")
    print("|---:|---:|---:|---:|---:|---:|")
    for nbytes, ours, shm, via in rows:
        print(f"| {_size(nbytes)} | {ours:.0f} | {shm:.0f} | {via:.0f} | {shm / ours:.2f}x "
              f"| {via / ours:.1f}x |")
    by_size = {r[0]: r for r in rows}
    small, large, mid = by_size[4 << 10], by_size[256 << 20], by_size[64 << 20]
    print(f"\n4 KiB: devipc / cpu-shm = {small[1] / small[2]:.2f} (target <= 1, aim 0.5)")
    print(f"devipc 256 MiB / 4 KiB = {large[1] / small[1]:.2f} (target <= 1.5)")
    print(f"64 MiB: via-cpu / devipc = {mid[3] / mid[1]:.1f}x (target >= 20)")


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= (1 << 20) else f"{nbytes >> 10} KiB"


if __name__ == "__main__":
    main()
