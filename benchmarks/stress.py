"""Stress: many small tensors to many consumers through torch.multiprocessing queues.

The producer sends TENSORS small tensors to each of CONSUMERS processes; each consumer holds a
window of the latest ones and drops the oldest as new ones come (the producer may free a tensor
only once its consumer let go). Reports tensors/s, the producer's peak device memory and RSS, and
checks that memory and fds are back to their baseline afterwards.

Usage: python benchmarks/stress.py [--consumers 8] [--tensors 10000] [--bytes 4096] [--window 64]
"""

import argparse
import json
import os
import resource
import sys
import time
from collections import deque

import torch
import torch.multiprocessing as mp

import devipc
import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)

TIMEOUT = 120


def consumer(inbox, outbox, window):
    """Holds the latest `window` tensors, checks each one's value, reports a checksum at the end."""
    held, total = deque(), 0.0
    while (tensor := inbox.get(timeout=TIMEOUT)) is not None:
        held.append(tensor)
        total += float(tensor[0])
        if len(held) > window:
            held.popleft()
    held.clear()
    torch.accelerator.synchronize()
    devipc.ipc_collect()
    outbox.put(total)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settle(memory: int, sent: int, timeout: float = TIMEOUT) -> bool:
    """Waits until the producer's memory and held sends are back to `memory` and `sent` (the
    collector frees them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        devipc.ipc_collect()
        # <=: what others sent before may end meanwhile
        if torch.accelerator.memory_allocated() <= memory and devipc.stats()["sent"] <= sent:
            return True
        time.sleep(0.05)
    return False


def run(consumers: int, tensors: int, nbytes: int, window: int) -> dict:
    ctx = mp.get_context("spawn")
    torch.accelerator.synchronize()
    inboxes = [ctx.Queue() for _ in range(consumers)]
    outbox = ctx.Queue()
    procs = [
        ctx.Process(target=consumer, args=(inbox, outbox, window), daemon=True) for inbox in inboxes
    ]
    for proc in procs:
        proc.start()
    try:
        memory, sent = torch.accelerator.memory_allocated(), devipc.stats()["sent"]
        warm = torch.zeros(nbytes // 4, device="openreg")  # warm-up: counter file, segments
        for inbox in inboxes:
            inbox.put(warm)
        del warm  # held in the consumers' windows until the end
        fds = _fds()
        torch.openreg.reset_peak_memory_stats()
        expected = 0.0
        start = time.perf_counter()
        for i in range(tensors):
            value = float(i % 7)
            expected += value
            for inbox in inboxes:
                inbox.put(torch.full((nbytes // 4,), value, device="openreg"))
        for inbox in inboxes:
            inbox.put(None)
        totals = [outbox.get(timeout=TIMEOUT) for _ in procs]
        elapsed = time.perf_counter() - start
        for proc in procs:
            proc.join(TIMEOUT)
        back = _settle(memory, sent)
        result = {
            "consumers": consumers,
            "tensors_per_consumer": tensors,
            "bytes": nbytes,
            "window": window,
            "seconds": round(elapsed, 2),
            "tensors_per_s": round(consumers * tensors / elapsed),
            "peak_allocated_mib": round((torch.openreg.max_memory_allocated() - memory) / 2**20, 2),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "checksums_ok": all(t == expected for t in totals),
            "memory_back": back,
            "exit_codes": [proc.exitcode for proc in procs],
        }
        for q in (*inboxes, outbox):
            q.close()
            q.join_thread()
        torch.openreg.empty_cache()  # cached segments are memfds too
        result["fds_back"] = _fds() <= fds
        return result
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--consumers", type=int, default=8)
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--window", type=int, default=64)
    options = parser.parse_args(argv)
    result = run(options.consumers, options.tensors, options.bytes, options.window)
    print(json.dumps(result))
    ok = (
        result["checksums_ok"]
        and result["memory_back"]
        and result["fds_back"]
        and result["exit_codes"] == [0] * options.consumers
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
