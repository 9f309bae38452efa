"""One-sided read and write bandwidth between two processes on this host, four ways, one run:

  memcpy       single-thread copy in one process (torch CPU copy_, torch.set_num_threads(1))
  devipc       devipc.p2p, same host: Endpoint() (the device's IPC hooks), openreg tensors
  devipc-nixl  devipc.p2p forced over NIXL: Endpoint(transport="nixl"), openreg tensors (DRAM)
  nixl         NIXL's own agent API, no devipc: openreg tensors' memory (host addresses, the
               same kind of memory devipc moves) registered as DRAM with bare agents, prepared
               requests reposted (its best case: no per-call set-up)

Sizes 4 KiB ... 256 MiB (powers of 4), then a vectorized batch of 1,000 x 4 KiB ranges (8 KiB
apart on both sides, so that nothing merges them into one range): one readv/writev call, one
NIXL request of 1,000 descriptors, 1,000 copy_ calls for memcpy. The owner process only
registers and advertises; every transfer is posted by this process. GB/s are 10^9 bytes/s.

Each figure is the median of 9 rounds that interleave the four methods.
Usage: python benchmarks/p2p_bandwidth.py [--max-mib 256] [--seconds 0.8] [--rounds 9] [--no-doc]
UCX picks its own transports (UCX_TLS and friends are read from the environment).
"""
import argparse
import contextlib
import os
import re
import statistics
import sys
import time

import numpy as np
import torch
import torch.multiprocessing as mp

import devipc.p2p as p2p
import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)
from devipc.p2p._nixl import new_agent

TIMEOUT = 300
BATCH, BATCH_BYTES, BATCH_STRIDE = 1000, 4 << 10, 8 << 10
NOTES = "Method notes:"  # from here to the next section, the doc's notes are kept on a rerun
DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks.md")
SECTION = "## P2P bandwidth (`benchmarks/p2p_bandwidth.py`)"
METHODS = ("memcpy", "devipc", "devipc-nixl", "nixl")
ABOUT = """\
One-sided reads and writes between two processes on this project's 2-core machine (no GPU; other
jobs were running on it), one run, GB/s (10^9 bytes/s), each figure the median of {rounds} rounds
that interleave the methods ({seconds} s per method and size in all):

- **memcpy (1 thread)**: `copy_` of CPU tensors in one process, `torch.set_num_threads(1)`;
- **devipc**: `devipc.p2p`, `Endpoint()`, same host through openreg's IPC hooks; openreg tensors
  (a registered 256 MiB storage on each side, ranges of it), the copy on openreg's stream;
- **devipc over NIXL**: `Endpoint(transport="nixl")` on both sides, the same openreg tensors
  (`memory_kind` DRAM), including devipc's liveness read before each transfer;
- **NIXL**: NIXL's own agent API, no devipc: DRAM -> DRAM between two processes, on the same kind
  of memory devipc moves: an openreg tensor's memory on each side (host addresses of a memfd,
  4 KiB pages), registered with bare NIXL agents as DRAM; one request prepared per size and
  reposted (its best case).

NIXL is `nixl-cu12` 1.5.1 with its UCX backend, UCX's own transport choice on one host (RMA by
`cma`, process_vm_readv/writev); every agent's progress thread waits for events (see
`devipc.p2p._nixl.new_agent`). The batch is 1,000 ranges of 4 KiB, 8 KiB apart on both sides (so
nothing merges them): one `readv`/`writev`, one NIXL request of 1,000 descriptors, 1,000 `copy_`
calls for memcpy. Small sizes measure per-call latency more than bandwidth."""


def sizes(max_bytes: int) -> list[int]:
    out, size = [], 4 << 10
    while size <= max_bytes:
        out.append(size)
        size *= 4
    return out


def batch_offsets() -> list[int]:
    return [i * BATCH_STRIDE for i in range(BATCH)]


def owner(conn, max_bytes: int):
    """Registers one openreg tensor with both endpoints and the memory of another (no devipc
    registration) with a bare NIXL agent; advertises every range the benchmark uses; then waits
    to be told to exit."""
    ipc, net = p2p.Endpoint(), p2p.Endpoint(transport="nixl")
    span = max(max_bytes, BATCH * BATCH_STRIDE)
    tensor, tensor_id = p2p.create_tensor((span,), torch.uint8, "openreg")
    tensor.copy_(torch.arange(span, dtype=torch.int64).to(torch.uint8))
    agent = new_agent(f"nixl-bench-owner-{os.getpid()}")
    buffer = torch.empty(span, dtype=torch.uint8, device="openreg")  # openreg memory, as devipc's
    buffer.copy_(tensor)
    torch.accelerator.synchronize()
    registered = agent.register_memory([(buffer.data_ptr(), span, 0, "")], "DRAM")
    descs = {}
    for name, endpoint in (("devipc", ipc), ("devipc-nixl", net)):
        descs[name] = {size: endpoint.advertise(tensor_id, 0, size) for size in sizes(max_bytes)}
        descs[name]["batch"] = [endpoint.advertise(tensor_id, offset, BATCH_BYTES)
                                for offset in batch_offsets()]
    conn.send({"devipc": ipc.metadata(), "devipc-nixl": net.metadata(), "descs": descs,
               "nixl": (agent.get_agent_metadata(), buffer.data_ptr())})
    assert conn.poll(TIMEOUT) and conn.recv() == "exit"
    agent.deregister_memory(registered)
    ipc.close()
    net.close()
    conn.send("bye")


def rates(steps: dict, nbytes: int, seconds: float, rounds: int) -> dict:
    """Median GB/s of each step (one transfer of `nbytes`) over `rounds` rounds that interleave
    the methods, so that load from elsewhere on the machine falls on all of them alike; each
    round runs a step for >= seconds / rounds (3 calls at least), after one untimed call."""
    samples = {name: [] for name in steps}
    for name, step in steps.items():
        with single_thread(name):
            step()
    for _ in range(rounds):
        for name, step in steps.items():
            with single_thread(name):
                count, start = 0, time.perf_counter()
                while True:
                    step()
                    count += 1
                    elapsed = time.perf_counter() - start
                    if (count >= 3 and elapsed >= seconds / rounds) or count >= 100_000:
                        break
            samples[name].append(nbytes * count / elapsed / 1e9)
    return {name: statistics.median(values) for name, values in samples.items()}


@contextlib.contextmanager
def single_thread(name: str):
    """memcpy runs on one thread; the others as they are."""
    threads = torch.get_num_threads()
    if name == "memcpy":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class NixlOwn:
    """NIXL's own DRAM -> DRAM path on openreg memory (host addresses, registered with the agent
    directly): prepared requests, reposted and polled to completion."""

    def __init__(self, metadata: bytes, remote_addr: int, span: int):
        self.agent = new_agent(f"nixl-bench-{os.getpid()}")
        self.buffer = torch.zeros(span, dtype=torch.uint8, device="openreg")
        torch.accelerator.synchronize()
        self.address = self.buffer.data_ptr()
        self.registered = self.agent.register_memory([(self.address, span, 0, "")], "DRAM")
        self.peer = self.agent.add_remote_agent(metadata)
        self.remote, self.handles = remote_addr, []

    def step(self, op: str, offsets: list[int], nbytes: int):
        local = np.array([(self.address + o, nbytes, 0) for o in offsets], np.uint64)
        remote = np.array([(self.remote + o, nbytes, 0) for o in offsets], np.uint64)
        handle = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(local, "DRAM"),
                                            self.agent.get_xfer_descs(remote, "DRAM"), self.peer)
        self.handles.append(handle)

        def run():
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            assert state == "DONE", state

        return run

    def close(self):
        for handle in self.handles:
            self.agent.release_xfer_handle(handle)
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.registered)


def measure(args) -> tuple[list, dict]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=owner, args=(theirs, args.max_bytes), daemon=True)
    child.start()
    progress("owner: registering and advertising")
    assert ours.poll(TIMEOUT), "the owner did not answer"
    info = ours.recv()
    span = max(args.max_bytes, BATCH * BATCH_STRIDE)
    endpoints = {"devipc": p2p.Endpoint(), "devipc-nixl": p2p.Endpoint(transport="nixl")}
    connections = {name: endpoints[name].connect(info[name]) for name in endpoints}
    local, _ = p2p.create_tensor((span,), torch.uint8, "openreg")
    nixl_own = NixlOwn(*info["nixl"], span)
    source, target = torch.ones(span, dtype=torch.uint8), torch.zeros(span, dtype=torch.uint8)
    batch_views = [local[o:o + BATCH_BYTES] for o in batch_offsets()]
    rows, results = [], {}
    try:
        for op in ("read", "write"):
            for size in sizes(args.max_bytes) + ["batch"]:
                nbytes = BATCH * BATCH_BYTES if size == "batch" else size
                steps = {}
                if size == "batch":
                    def copies():
                        for o in batch_offsets():
                            target[o:o + BATCH_BYTES].copy_(source[o:o + BATCH_BYTES])
                    steps["memcpy"] = copies
                else:
                    dst, src = target[:size], source[:size]
                    steps["memcpy"] = lambda dst=dst, src=src: dst.copy_(src)
                for name, connection in connections.items():
                    desc = info["descs"][name][size]
                    if size == "batch":
                        call = connection.readv if op == "read" else connection.writev
                        steps[name] = lambda call=call, desc=desc: call(batch_views, desc)
                    else:
                        call = connection.read if op == "read" else connection.write
                        view = local[:size]
                        steps[name] = lambda call=call, desc=desc, view=view: call(view, desc)
                offsets = batch_offsets() if size == "batch" else [0]
                steps["nixl"] = nixl_own.step(op.upper(), offsets, BATCH_BYTES
                                              if size == "batch" else size)
                label = f"{BATCH} x 4 KiB" if size == "batch" else human(size)
                got = rates(steps, nbytes, args.seconds, args.rounds)
                for name in METHODS:
                    results[(op, label, name)] = got[name]
                progress(f"{op:5} {label:>12}  " + "  ".join(
                    f"{name} {got[name]:.2f}" for name in METHODS) + "  GB/s")
                rows.append((op, label))
    finally:
        nixl_own.close()
        for endpoint in endpoints.values():
            endpoint.close()
        ours.send("exit")
        ours.poll(TIMEOUT) and ours.recv()
        child.join(TIMEOUT)
        if child.is_alive():
            child.kill()
    return rows, results


def human(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def table(rows, results) -> str:
    lines = ["| op | size | memcpy (1 thread) | devipc | devipc over NIXL | NIXL | "
             "devipc / memcpy | devipc / NIXL | devipc over NIXL / NIXL |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for op, label in rows:
        memcpy, ipc, net, own = (results[(op, label, name)] for name in METHODS)
        lines.append(f"| {op} | {label} | {memcpy:.2f} | {ipc:.2f} | {net:.2f} | {own:.2f} | "
                     f"{ipc / memcpy:.2f} | {ipc / own:.2f} | {net / own:.2f} |")
    return "\n".join(lines)


def acceptance(rows, results) -> str:
    """Issue 8's goals, checked against this run's figures."""
    big = [(op, label) for op, label in rows
           if label.endswith("MiB") and int(label.split()[0]) >= 16]
    lines = []
    for op in ("read", "write"):
        cells = [(label, results[(op, label, "devipc")], results[(op, label, "memcpy")],
                  results[(op, label, "nixl")]) for o, label in big if o == op]
        worst_memcpy = min((ipc / memcpy, label) for label, ipc, memcpy, _ in cells)
        worst_nixl = min((ipc / own, label) for label, ipc, _, own in cells)
        lines.append(f"- same host, {op}, >= 16 MiB: devipc / memcpy >= 0.70 "
                     f"{'met' if worst_memcpy[0] >= 0.7 else 'NOT met'} (lowest "
                     f"{worst_memcpy[0]:.3f}, {worst_memcpy[1]}); devipc / NIXL >= 1 "
                     f"{'met' if worst_nixl[0] >= 1 else 'NOT met'} (lowest {worst_nixl[0]:.3f}, "
                     f"{worst_nixl[1]})")
    for op in ("read", "write"):
        label = f"{BATCH} x 4 KiB"
        ratio = results[(op, label, "devipc")] / results[(op, label, "nixl")]
        lines.append(f"- batch of {label}, {op}: devipc / NIXL >= 1 "
                     f"{'met' if ratio >= 1 else 'NOT met'} ({ratio:.3f})")
    return "\n".join(lines)


def write_doc(text: str) -> None:
    """Replace this benchmark's section with `text`, keeping its hand-written method notes."""
    with open(DOC) as doc:
        content = doc.read()
    at = content.find(SECTION)
    if at >= 0:
        following = re.search(r"^## ", content[at + len(SECTION):], re.M)
        end = len(content) if following is None else at + len(SECTION) + following.start()
        notes = content.find(NOTES, at, end)
        if notes >= 0:
            text = text.rstrip("\n") + "\n\n" + content[notes:end].rstrip("\n") + "\n\n"
        content = content[:at] + text + content[end:]
    else:
        content = content.rstrip("\n") + "\n\n" + text
    with open(DOC, "w") as doc:
        doc.write(content.rstrip("\n") + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-mib", type=int, default=256, help="largest size (MiB)")
    parser.add_argument("--seconds", type=float, default=0.8,
                        help="time per method and size, over all rounds")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (median)")
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    args.max_bytes = args.max_mib << 20
    start = time.perf_counter()
    rows, results = measure(args)
    result = table(rows, results) + "\n\n" + acceptance(rows, results)
    print(result)
    progress(f"done in {time.perf_counter() - start:.0f} s")
    if not args.no_doc:
        command = "python benchmarks/p2p_bandwidth.py" + "".join(
            f" {a}" for a in sys.argv[1:] if a != "--no-doc")
        about = ABOUT.format(rounds=args.rounds, seconds=args.seconds)
        write_doc(f"{SECTION}\n\n{about}\n\n`{command}`, one run:\n\n{result}\n")


if __name__ == "__main__":
    main()
