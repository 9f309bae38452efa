"""A whole state_dict synced producer -> consumer on openreg, seven ways in one run (the modes
are described in `devipc._tools._bench.weight_sync`, which measures them for
`devipc bench weight-sync` on any device), then the arena's device memory across >= 50 chunks;
prints the comparisons of docs/benchmarks.md.
Usage: python benchmarks/weight_sync.py [--mib N] [--steps N] [--tight-loop]
"""

import argparse

import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)
from devipc._tools._bench import weight_sync
from devipc._tools._bench.common import Progress


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="total size of the state_dict")
    parser.add_argument(
        "--steps",
        type=int,
        default=5,
        help="syncs after the first (a trainer syncs every step), median shown",
    )
    parser.add_argument(
        "--tight-loop",
        action="store_true",
        help="syncs back to back: the consumer's releases of one sync run in "
        "the next (by default they run between syncs, untimed)",
    )
    args = parser.parse_args()
    measured = weight_sync.measure(
        "openreg", args.mib, args.steps, args.tight_loop, Progress("weight-sync", lines=True)
    )
    results, arena = measured["results"], measured["arena"]
    print("\n" + weight_sync.table(measured))
    for column, what in ((1, "later syncs"), (0, "first sync")):
        for bucket in ("packed", "bucket"):
            print(
                f"{what}: "
                + ", ".join(
                    f"{mode} / {bucket} = {results[mode][column] / results[bucket][column]:.1f}x"
                    for mode in ("per-tensor", "torch-cpu", "arena", "via-cpu")
                )
            )
    print(
        f"double-buffering: arena-1 / arena = "
        f"{results['arena-1'][1] / results['arena'][1]:.2f}x (later syncs)"
    )
    seen = arena["seen"]
    print(
        f"arena: {arena['buffers']} x {arena['nbytes'] / 2**20:.1f} MiB, {len(seen)} chunks; "
        f"memory_allocated after each put, relative to before: min {min(seen)}, "
        f"max {max(seen)} bytes; peak +{arena['peak'] / 2**20:.1f} MiB; "
        f"after close: {arena['after_close'] / 2**20:+.1f} MiB "
        f"against before the arenas existed"
    )


if __name__ == "__main__":
    main()
