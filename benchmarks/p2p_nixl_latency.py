"""Latency of a synchronous devipc.p2p read over NIXL beside NIXL's own prepared READ, one run
(issue 47, item 8), between two processes of this host: UCX over TCP on the loopback device
(`UCX_TLS=tcp UCX_NET_DEVICES=lo`, as between two hosts) unless `--ucx-default` leaves UCX its
own choice (on one host: `cma`, process_vm_readv).

Rows (µs per operation, medians of interleaved rounds; openreg tensors, registered on both
sides): devipc's sync read over NIXL (`Connection.read`, then the synchronize), the same on a
connection made with `liveness=False` (no liveness read of the owner's registry words before the
transfer), NIXL's own prepared READ, and NIXL's own prepared READ of 8 bytes followed by one of
the size: the two NIXL round trips a checked read makes. Each row's ratio to NIXL's READ.
Usage: python benchmarks/p2p_nixl_latency.py [--seconds 0.5] [--rounds 9] [--ucx-default]
"""

import argparse
import os
import sys

ROWS = (
    "sync read over NIXL",
    "sync read over NIXL, liveness=False",
    "NIXL prepared READ",
    "NIXL prepared READ of 8 B, then READ",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=0.5, help="time per row and size, over all rounds"
    )
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (median)")
    parser.add_argument(
        "--ucx-default",
        action="store_true",
        help="leave UCX its own transport choice (else TCP over loopback)",
    )
    args = parser.parse_args()
    if not args.ucx_default:  # before NIXL loads; the owner process inherits it
        os.environ.update({"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"})
    import devipc_openreg  # noqa: F401  (the reference device)
    from devipc._tools._bench import p2p as bench
    from devipc._tools._bench.common import Progress, human, markdown

    if not bench.have_nixl("openreg"):
        sys.exit("NIXL is not installed: pip install 'devipc[nixl]'")
    results = bench.latency(
        "openreg",
        args.seconds,
        args.rounds,
        nixl=True,
        progress=Progress("p2p nixl latency", lines=True),
    )
    nixl = {size: results[("NIXL prepared READ", size)] for size in bench.LATENCY_SIZES}
    headers = [
        "operation",
        *(f"{human(size)} (µs)" for size in bench.LATENCY_SIZES),
        *(f"{human(size)} / NIXL" for size in bench.LATENCY_SIZES),
    ]
    body = [
        [
            row,
            *(f"{results[(row, size)]:.1f}" for size in bench.LATENCY_SIZES),
            *(f"{results[(row, size)] / nixl[size]:.2f}" for size in bench.LATENCY_SIZES),
        ]
        for row in ROWS
    ]
    print(f"UCX: {'its own choice' if args.ucx_default else 'TCP over loopback'}")
    print(markdown(headers, body))
    four = bench.LATENCY_SIZES[0]
    for row in ROWS[:2]:
        ratio = results[(row, four)] / nixl[four]
        print(
            f"- {human(four)} {row} / NIXL prepared READ <= 1.5: "
            f"{'met' if ratio <= 1.5 else 'NOT met'} ({ratio:.2f})"
        )
    checked = results[(ROWS[0], four)] / results[(ROWS[3], four)]
    print(
        f"- {human(four)} {ROWS[0]} / {ROWS[3]}: {checked:.2f} (the liveness read is a NIXL "
        f"round trip of its own)"
    )


if __name__ == "__main__":
    main()
