"""Threaded p2p stress: many threads transfer through ONE Connection while the owner ends and makes
registrations under them.

The owner (a spawned process) keeps SLOTS registrations alive, half in fd-backed CPU shared
memory and half on openreg, and replaces one of them (deregister, or drop, then create) every
millisecond, publishing each new descriptor to the peer. The peer's threads read, write and readv
random ones. A transfer either moves its bytes or raises RemoteTensorFreedError (its registration
ended first); anything else, or a crash, is a failure. At the end the peer's mappings and fds must
be back to where they were.

Usage: python benchmarks/p2p_stress.py [--threads 8] [--transfers 10000] [--slots 16]
"""

import argparse
import json
import os
import random
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

import devipc
import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)
from devipc import p2p

TIMEOUT = 120
NBYTES = 4096


def _devices(slots: int) -> list[str]:
    return ["cpu" if i % 2 else "openreg" for i in range(slots)]


def owner(conn, slots: int) -> None:
    """Keeps `slots` registrations, replacing one every millisecond until told to stop; sends
    (slot, descriptor) for each new one."""
    endpoint = p2p.Endpoint()
    tensors = {}
    for slot, device in enumerate(_devices(slots)):
        tensors[slot], _ = p2p.create_tensor((NBYTES,), torch.uint8, device)
        tensors[slot].fill_(slot)
    conn.send((endpoint.metadata(), [endpoint.advertise(tensors[s]) for s in range(slots)]))
    replaced, rng = 0, random.Random(1)
    while not conn.poll(0.001):  # pacing, not synchronization: the peer never waits for it
        slot = rng.randrange(slots)
        if rng.random() < 0.5:
            p2p.free_tensor(tensors[slot])  # deregistered, the tensor kept a moment longer
        del tensors[slot]  # the finalizer deregisters it (if not already)
        tensors[slot], _ = p2p.create_tensor((NBYTES,), torch.uint8, _devices(slots)[slot])
        tensors[slot].fill_(slot)
        conn.send((slot, endpoint.advertise(tensors[slot])))
        replaced += 1
    conn.recv()
    endpoint.close()
    conn.send(replaced)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run(threads: int, transfers: int, slots: int = 16) -> dict:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=owner, args=(theirs, slots), daemon=True)
    proc.start()
    theirs.close()
    try:
        return _peer(ours, threads, transfers, slots)
    finally:
        if proc.is_alive():
            proc.join(TIMEOUT)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        ours.close()


def _peer(conn, threads: int, transfers: int, slots: int) -> dict:
    fds = _fds()
    assert conn.poll(TIMEOUT), "the owner did not start"
    metadata, table = conn.recv()
    endpoint = p2p.Endpoint()
    connection = endpoint.connect(metadata)
    lock = threading.Lock()
    counts = {"ok": 0, "freed": 0, "wrong_bytes": 0}
    errors: list[str] = []
    stop_feeding = threading.Event()

    def feed():  # new descriptors from the owner, as they come
        while not stop_feeding.is_set():
            if conn.poll(0.01):
                slot, descriptor = conn.recv()
                table[slot] = descriptor

    def work(seed: int):
        rng = random.Random(seed)
        places = {
            device: torch.empty(NBYTES, dtype=torch.uint8, device=device)
            for device in ("cpu", "openreg")
        }
        pairs = {
            device: (
                torch.empty(NBYTES, dtype=torch.uint8, device=device),
                torch.empty(NBYTES, dtype=torch.uint8, device=device),
            )
            for device in ("cpu", "openreg")
        }
        ok = freed = wrong = 0
        for _ in range(transfers):
            slot = rng.randrange(slots)
            descriptor = table[slot]
            device = _devices(slots)[slot] if rng.random() < 0.7 else rng.choice(list(places))
            op = rng.randrange(3)
            try:
                if op == 0:
                    connection.read(places[device], descriptor)
                    wrong += bool((places[device][:1].cpu() != slot).any())
                elif op == 1:
                    connection.write(places[device].fill_(slot), descriptor)
                else:
                    connection.readv(pairs[device], [descriptor, descriptor])
                ok += 1
            except p2p.RemoteTensorFreedError:
                freed += 1
            except Exception as error:  # noqa: BLE001 - every other failure is counted
                with lock:
                    errors.append(f"{type(error).__name__}: {error}")
        with lock:
            counts["ok"] += ok
            counts["freed"] += freed
            counts["wrong_bytes"] += wrong

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    start = time.perf_counter()
    workers = [threading.Thread(target=work, args=(seed,)) for seed in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(TIMEOUT)
    elapsed = time.perf_counter() - start
    hung = sum(worker.is_alive() for worker in workers)
    stop_feeding.set()
    feeder.join(TIMEOUT)
    conn.send("stop")
    while True:  # descriptors still in the pipe, then the owner's count
        assert conn.poll(TIMEOUT), "the owner did not stop"
        message = conn.recv()
        if isinstance(message, int):
            replaced = message
            break
    connection.close()
    endpoint.close()
    torch.accelerator.synchronize()
    mapped_after = connection.mapped()
    deadline = time.monotonic() + 5  # releases land within a collector round of the close
    while _fds() > fds + 2 and time.monotonic() < deadline:
        devipc.ipc_collect()
        time.sleep(0.01)
    return {
        "threads": threads,
        "transfers": threads * transfers,
        **counts,
        "other_errors": len(errors),
        "first_errors": errors[:5],
        "hung_threads": hung,
        "registrations_replaced": replaced,
        "seconds": round(elapsed, 2),
        "transfers_per_s": round(threads * transfers / elapsed),
        "mapped_after": mapped_after,
        "fds_back": _fds() <= fds + 2,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--transfers", type=int, default=10_000, help="per thread")
    parser.add_argument("--slots", type=int, default=16)
    args = parser.parse_args()
    result = run(args.threads, args.transfers, args.slots)
    print(json.dumps(result, indent=1))
    failed = (
        result["wrong_bytes"]
        or result["other_errors"]
        or result["hung_threads"]
        or result["mapped_after"]
        or not result["fds_back"]
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
