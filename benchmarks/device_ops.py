"""Ops on openreg against the same ops on the CPU, one run, same inputs: openreg's ops run their
CPU kernels (in place, on openreg's memory), so the ratio is the cost of the device's path.

Each case runs `--repeats` times per device after a warm-up, the devices alternating; the clock
stops after torch.openreg.synchronize(). Prints a markdown table: case, CPU ms, openreg ms, ratio.
Usage: python benchmarks/device_ops.py [--repeats N] [--cases name,...] [--threads N]
"""

import argparse
import statistics
import sys
import time

import torch

import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)


def _mlp_step(model, optimizer, x, y):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _mlp(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    ).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def cases():
    """name -> (inputs on the CPU, op taking them on one device)."""
    g = torch.Generator().manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=g)

    big = randn(4096, 4096)
    rows = torch.tensor([5, 2000, 4000])
    vector = randn(4 * 1024 * 1024)
    m = randn(1024, 1024)
    return {
        "matmul 1024x1024": ((m, randn(1024, 1024)), lambda a, b: a @ b),
        "add 4M": ((vector, randn(vector.numel())), lambda a, b: a + b),
        "mul 4M": ((vector, randn(vector.numel())), lambda a, b: a * b),
        "gelu 4M": ((vector,), torch.nn.functional.gelu),
        "sum dim 4096x4096": ((big,), lambda a: a.sum(dim=1)),
        "mean dim 4096x4096": ((big,), lambda a: a.mean(dim=0)),
        "max dim 4096x4096": ((big,), lambda a: a.max(dim=1).values),
        "b[idx] 3 rows of 4096x4096": ((big, rows), lambda a, i: a[i]),
        "index_select 3 rows": ((big, rows), lambda a, i: a.index_select(0, i)),
        "gather 4096x3": (
            (big, torch.randint(0, 4096, (4096, 3), generator=g)),
            lambda a, i: a.gather(1, i),
        ),
        "embedding 50k x 1024, 64 ids": (
            (randn(50_000, 1024), torch.randint(0, 50_000, (64,), generator=g)),
            lambda w, i: torch.nn.functional.embedding(i, w),
        ),
        "x[:, ::2].contiguous() 4096x4096": ((big,), lambda a: a[:, ::2].contiguous()),
        "conv2d 8x64x56x56, 3x3": (
            (randn(8, 64, 56, 56), randn(64, 64, 3, 3)),
            lambda x, w: torch.nn.functional.conv2d(x, w, padding=1),
        ),
        "MLP step 784-512-512-10, batch 256": (
            (randn(256, 784), torch.randint(0, 10, (256,), generator=g)),
            None,
        ),
    }


def run_case(inputs, op, repeats):
    """Median ms per device; the devices alternate run by run, so that both see the same load."""
    syncs = {"cpu": lambda: None, "openreg": torch.openreg.synchronize}
    calls = {}
    for device in syncs:
        args = [t.to(device) for t in inputs]
        if op is None:  # the training step: a model per device, the same initial weights
            model, optimizer = _mlp(device)
            calls[device] = lambda m=model, o=optimizer, a=args: _mlp_step(m, o, *a)
        else:
            calls[device] = lambda a=args: op(*a)
        calls[device]()  # warm-up
        syncs[device]()
    times = {device: [] for device in calls}
    for _ in range(repeats):
        for device, call in calls.items():
            start = time.perf_counter()
            call()
            syncs[device]()
            times[device].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times["cpu"]), statistics.median(times["openreg"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per case and device")
    parser.add_argument("--cases", default="", help="comma-separated name prefixes (default: all)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared machine, a kernel's helper "
        "threads may wait for a core; 0: torch's default)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = [p.strip() for p in args.cases.split(",") if p.strip()]
    rows = []
    for name, (inputs, op) in cases().items():
        if wanted and not any(name.startswith(p) for p in wanted):
            continue
        print(f"... {name}", file=sys.stderr, flush=True)
        cpu, dev = run_case(inputs, op, args.repeats)
        print(f"    cpu {cpu:.3f} ms, openreg {dev:.3f} ms", file=sys.stderr, flush=True)
        rows.append((name, cpu, dev))
    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} runs\n"
    )
    print("| case | CPU ms | openreg ms | ratio |")
    print("|---|---:|---:|---:|")
    for name, cpu, dev in rows:
        print(f"| {name} | {cpu:.3f} | {dev:.3f} | {dev / cpu:.2f}x |")


if __name__ == "__main__":
    main()
