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

Each figure is the median of 9 rounds that interleave the four methods. The measuring is
devipc's own (`devipc bench p2p`, any device); this script runs it on openreg and checks issue 8's
goals and updates docs/benchmarks.md. Then latency per operation (issue 17): devipc's synchronous
read and write and a prepared post, beside NIXL's own prepared READ of the same bytes, 4 KiB,
64 KiB and 1 MiB.
Usage: python benchmarks/p2p_bandwidth.py [--max-mib 256] [--seconds 0.8] [--rounds 9]
       [--latency-seconds 0.5] [--no-doc]
UCX picks its own transports (UCX_TLS and friends are read from the environment).
"""

import argparse
import os
import sys
import time

import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)
from devipc._tools._bench import p2p as bench
from devipc._tools._bench.common import Progress, replace_section

BATCH = bench.BATCH
NOTES = "Method notes:"  # from here to the next section, the doc's notes are kept on a rerun
DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks.md")
SECTION = "## P2P bandwidth (`benchmarks/p2p_bandwidth.py`)"
ABOUT = """\
One-sided reads and writes between two processes on this project's 2-core machine (no GPU;
figures drift with its load from run to run), one run, GB/s (10^9 bytes/s), each figure the
median of {rounds} rounds that interleave the methods ({seconds} s per method and size in all):

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


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def acceptance(rows, results) -> str:
    """Issue 8's goals, checked against this run's figures."""
    big = [
        (op, label) for op, label in rows if label.endswith("MiB") and int(label.split()[0]) >= 16
    ]
    lines = []
    for op in ("read", "write"):
        cells = [
            (
                label,
                results[(op, label, "devipc")],
                results[(op, label, "memcpy")],
                results[(op, label, "nixl")],
            )
            for o, label in big
            if o == op
        ]
        worst_memcpy = min((ipc / memcpy, label) for label, ipc, memcpy, _ in cells)
        worst_nixl = min((ipc / own, label) for label, ipc, _, own in cells)
        lines.append(
            f"- same host, {op}, >= 16 MiB: devipc / memcpy >= 0.70 "
            f"{'met' if worst_memcpy[0] >= 0.7 else 'NOT met'} (lowest "
            f"{worst_memcpy[0]:.3f}, {worst_memcpy[1]}); devipc / NIXL >= 1 "
            f"{'met' if worst_nixl[0] >= 1 else 'NOT met'} (lowest {worst_nixl[0]:.3f}, "
            f"{worst_nixl[1]})"
        )
    for op in ("read", "write"):
        label = f"{BATCH} x 4 KiB"
        ratio = results[(op, label, "devipc")] / results[(op, label, "nixl")]
        lines.append(
            f"- batch of {label}, {op}: devipc / NIXL >= 1 "
            f"{'met' if ratio >= 1 else 'NOT met'} ({ratio:.3f})"
        )
    return "\n".join(lines)


LATENCY = """\
### Latency per operation

The same two processes, microseconds per operation (median of {rounds} interleaved rounds,
{seconds} s per row and size in all), each row's ratio to NIXL's:

- **sync read** / **sync write**: `Connection.read(local, descriptor)` (`write`) of an openreg
  tensor, then `torch.accelerator.synchronize()`;
- **prepared post (read)**: `xfer = connection.prepare("read", [local], [descriptor])` once, then
  `xfer.post().wait()` and `torch.accelerator.synchronize()` per operation;
- **NIXL prepared READ**: NIXL's own API on the same kind of memory (openreg tensors' host
  addresses registered as DRAM with bare agents): `prep_xfer_dlist` on both sides and
  `make_prepped_xfer` once, then `transfer` and `check_xfer_state` polled to DONE."""


def latency_acceptance(results) -> str:
    """Issue 17's goal: a synchronous read no slower than NIXL's prepared READ, a post less."""
    lines = []
    for size in (4 << 10, 64 << 10):
        nixl = results[(bench.LATENCY_ROWS[3], size)]
        read = results[(bench.LATENCY_ROWS[0], size)]
        post = results[(bench.LATENCY_ROWS[2], size)]
        label = f"{size >> 10} KiB"
        lines.append(
            f"- {label}: sync read / NIXL <= 1 {'met' if read <= nixl else 'NOT met'} "
            f"({read / nixl:.2f}); prepared post < sync read "
            f"{'met' if post < read else 'NOT met'} ({post:.1f} vs {read:.1f} us)"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-mib", type=int, default=256, help="largest size (MiB)")
    parser.add_argument(
        "--seconds", type=float, default=0.8, help="time per method and size, over all rounds"
    )
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (median)")
    parser.add_argument(
        "--latency-seconds",
        type=float,
        default=0.5,
        help="time per latency row and size, over all rounds",
    )
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    args.max_bytes = args.max_mib << 20
    start = time.perf_counter()
    rows, results = bench.measure(
        "openreg",
        args.max_bytes,
        args.seconds,
        args.rounds,
        nixl=True,
        progress=Progress("p2p", lines=True),
    )
    latency = bench.latency(
        "openreg",
        args.latency_seconds,
        args.rounds,
        nixl=True,
        progress=Progress("p2p latency", lines=True),
    )
    about_latency = LATENCY.format(rounds=args.rounds, seconds=args.latency_seconds)
    result = (
        bench.table(rows, results)
        + "\n\n"
        + acceptance(rows, results)
        + "\n\n"
        + about_latency
        + "\n\n"
        + bench.latency_table(latency)
        + "\n\n"
        + latency_acceptance(latency)
    )
    print(result)
    progress(f"done in {time.perf_counter() - start:.0f} s")
    if not args.no_doc:
        command = "python benchmarks/p2p_bandwidth.py" + "".join(
            f" {a}" for a in sys.argv[1:] if a != "--no-doc"
        )
        about = ABOUT.format(rounds=args.rounds, seconds=args.seconds)
        replace_section(DOC, SECTION, f"{about}\n\n`{command}`, one run:\n\n{result}\n", NOTES)


if __name__ == "__main__":
    main()
