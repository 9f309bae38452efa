"""Per-tensor round trip through torch.multiprocessing.Queue: the producer puts a tensor, the
consumer reads one element of it and replies. Four ways, measured in one run:

  devipc      an openreg tensor, shared zero-copy by devipc, the same one re-sent
  devipc-new  a new openreg tensor before every send (torch.empty), as users mostly send
  cpu-shm     torch's own CPU tensor already in shared memory (fd passing)
  via-cpu     copy through the host: .cpu(), the queue, .to("openreg") in the consumer

Then the floor of any message in the reduction's shape (devipc's pickled reduction, rebuilt by
nothing), and a DataLoader (2 spawned workers) of batches made on openreg in the workers against the
same loader over small Python objects.

The measuring is devipc's own (`devipc bench ipc`, any device); this script runs it on openreg,
with the sizes and checks of docs/benchmarks.md, then splits devipc's part of a send into its
phases (producer reduce, consumer open, read, release), also while the consumer holds 1,000 and
10,000 tensors it received before.
Usage: python benchmarks/ipc_latency.py [--quick]
"""

import argparse

import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)
from devipc._tools._bench import ipc
from devipc._tools._bench.common import Progress


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    args = parser.parse_args()
    rows = ipc.measure("openreg", quick=args.quick, progress=Progress("ipc", lines=True))
    print("\n" + ipc.table(rows, "openreg"))
    by_size = {r["size"]: r for r in rows}
    small, large, mid = by_size[4 << 10], by_size[256 << 20], by_size[64 << 20]
    print(
        f"\n4 KiB: devipc / small message = {small['devipc'] / small['message']:.2f} (target <= 2)"
    )
    print(f"4 KiB: devipc / cpu-shm = {small['devipc'] / small['cpu-shm']:.2f} (target <= 1)")
    print(
        f"devipc 256 MiB / 4 KiB = {large['devipc'] / small['devipc']:.2f} (target <= 1.2); "
        f"each over its own small message: "
        f"{large['devipc'] / large['message'] / (small['devipc'] / small['message']):.2f}"
    )
    print(f"64 MiB: via-cpu / devipc = {mid['via-cpu'] / mid['devipc']:.1f}x (target >= 20)")
    new_small = small["devipc-new"] / small["message-new"]
    new_large = large["devipc-new"] / large["message-new"]
    print(
        f"a new tensor each send, 4 KiB: / its small message = {new_small:.2f} "
        f"(issue 30: <= 1.5); 256 MiB new / 4 KiB new = {new_large / new_small:.2f}, each "
        f"over its own small message (<= 1.1; in raw us "
        f"{large['devipc-new'] / small['devipc-new']:.2f}); re-sent 4 KiB / message = "
        f"{small['devipc'] / small['message']:.2f} (<= 1.2)"
    )
    shaped, message = ipc.reduction_floor("openreg", count=50 if args.quick else 400)
    print(
        f"the reduction's own message (4 KiB), unpickled without opening anything: "
        f"{shaped / message:.2f} of its small message ({shaped:.0f} / {message:.0f} us): the "
        f"floor of any tensor sent in torch's 15-argument shape"
    )
    rates = ipc.dataloader("openreg", 100 if args.quick else 400)
    print(
        f"DataLoader, 2 spawned workers: batches of {ipc.BATCH_SHAPE} float32 made on openreg "
        f"{rates['device']:.0f}/s, small Python objects {rates['objects']:.0f}/s: "
        f"{rates['device'] / rates['objects']:.0%} (issue 30: >= 90%)"
    )
    count = 40 if args.quick else 200
    split = ipc.phases("openreg", [4 << 10, 256 << 20], count=count)
    for held in (1000, 10_000):  # an engine holding its weights: an open must not scan them
        split += ipc.phases("openreg", [4 << 10], count=count, held=held)
    print("\nWhere devipc's time goes (a Pipe, no queue thread; medians):\n")
    print(ipc.phase_table(split))
    print(
        f"\n4 KiB open with 10,000 received tensors held / with 1,000 held = "
        f"{split[-1]['open'] / split[-2]['open']:.2f}, / with none = "
        f"{split[-1]['open'] / split[0]['open']:.2f} (an open that scanned what is held: "
        f"10,000 / 1,000 = 18)"
    )


if __name__ == "__main__":
    main()
