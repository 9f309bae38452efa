"""Exit soak: scripts that end with devipc objects alive must exit, quickly, every time.

Each run starts a fresh interpreter that ends in one of three ways, taken in turn:
- "live": arenas (one with an unopened attachment), a reader, an endpoint connected to itself
  with device and CPU registrations mapped, a NIXL endpoint with a registration (when NIXL is
  installed), sends nobody opened, a received tensor, a module-level sent storage;
- "idle": a module-level sent storage and nothing left to collect: the collector thread only
  watches for storages to die (`_memory.reap_freed`) when the interpreter ends, and the storage
  freed at shutdown must start nothing;
- "consumer": a reader of this process's arena that reads a chunk and ends without close().
A run passes when the script prints its last line and the process is gone within --limit seconds
of it (its exit code 0). Reports every run's exit time.

Usage: python benchmarks/exit_soak.py [--runs 100] [--limit 5]
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import devipc
import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)

MODES = ("live", "idle", "consumer")

PRELUDE = """
import sys, time
import torch, devipc, devipc_openreg
import devipc.p2p as p2p
"""

LIVE = (
    PRELUDE
    + """
arena = devipc.Arena(4096, "openreg")
reader = devipc.open_arena(arena.attach())
chunk = reader.read(arena.put({"a": torch.ones(4, device="openreg")}))
other = devipc.Arena(4096, "openreg")
attachment = other.attach()
endpoint = p2p.Endpoint()
device_tensor, _ = p2p.create_tensor((256,), torch.float32, "openreg")
cpu_tensor, _ = p2p.create_tensor((256,), torch.float32, "cpu")
connection = endpoint.connect(endpoint.metadata())
connection.read(torch.zeros(256, device="openreg"), endpoint.advertise(device_tensor))
connection.read(torch.zeros(256), endpoint.advertise(cpu_tensor))
try:
    from devipc.p2p._nixl import load_nixl
    load_nixl()
    nixl_endpoint = p2p.Endpoint(transport="nixl")
    nixl_tensor, _ = p2p.create_tensor((256,), torch.float32, "openreg")
    nixl_descriptor = nixl_endpoint.advertise(nixl_tensor)
except ImportError:
    pass
SENT = torch.ones(1024, device="openreg").untyped_storage()
devipc.rfc.share_device(SENT)
handle = devipc.share(torch.ones(8, device="openreg"))
bucket = devipc.share_tensors({"w": torch.ones(8, device="openreg")})
received = devipc.open(devipc.share(torch.ones(8, device="openreg")))
print("END", flush=True)
"""
)

IDLE = (
    PRELUDE
    + """
SENT = torch.ones(1024, device="openreg")
devipc.share(SENT).revoke()
deadline = time.monotonic() + 10
while devipc.stats()["sent"] and time.monotonic() < deadline:
    time.sleep(0.01)  # the collector's rounds end the revoked send by themselves
print("END" if not devipc.stats()["sent"] else "BUSY", flush=True)
"""
)

CONSUMER = (
    PRELUDE
    + """
reader = devipc.open_arena(bytes.fromhex(sys.argv[1]))
chunk = reader.read(bytes.fromhex(sys.stdin.readline().strip()))
assert chunk.tensors["a"].sum().item() == 4
print("END", flush=True)
"""
)


def one_run(mode: str, arena: devipc.Arena, limit: float) -> dict:
    env = {**os.environ, "DEVIPC_OPENREG": "1"}
    args = [sys.executable, "-c", {"live": LIVE, "idle": IDLE, "consumer": CONSUMER}[mode]]
    if mode == "consumer":
        args.append(arena.attach().hex())
    started = time.monotonic()
    proc = subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        if mode == "consumer":
            chunk = {"a": torch.ones(4, device="openreg")}
            try:
                data = arena.put(chunk, timeout=limit)
            except devipc.ConsumerDiedError:  # an earlier run's reader, gone: it stops counting
                data = arena.put(chunk, timeout=limit)
            proc.stdin.write(data.hex() + "\n")
            proc.stdin.flush()
        line = proc.stdout.readline().strip()
        ended = time.monotonic()
        try:
            proc.wait(limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"mode": mode, "ok": False, "why": f"still running {limit} s after {line!r}"}
        exit_s = time.monotonic() - ended
        ok = line == "END" and proc.returncode == 0
        why = "" if ok else f"{line!r}, exit {proc.returncode}: {proc.stderr.read()[-600:]}"
        return {
            "mode": mode,
            "ok": ok,
            "exit_s": round(exit_s, 3),
            "total_s": round(time.monotonic() - started, 2),
            "why": why,
        }
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()


def run(runs: int, limit: float = 5.0) -> dict:
    results = []
    with devipc.Arena(4096, "openreg") as arena:
        for i in range(runs):
            results.append(one_run(MODES[i % len(MODES)], arena, limit))
    exits = sorted(r["exit_s"] for r in results if "exit_s" in r)
    return {
        "runs": runs,
        "passed": sum(r["ok"] for r in results),
        "limit_s": limit,
        "exit_s_median": exits[len(exits) // 2] if exits else None,
        "exit_s_max": exits[-1] if exits else None,
        "failures": [r for r in results if not r["ok"]][:5],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--limit", type=float, default=5.0)
    args = parser.parse_args()
    result = run(args.runs, args.limit)
    print(json.dumps(result, indent=1))
    return 0 if result["passed"] == result["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
