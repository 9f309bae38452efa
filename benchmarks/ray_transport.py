"""Actor-to-actor transfers through Ray, in one run, side by side (issue 32's benchmark):

  devipc     an openreg tensor returned with tensor_transport="DEVIPC" (zero-copy on one host)
  store      the same tensor returned plainly: Ray's object store (pickled through host memory)
  ray-nixl   a CPU tensor of the same size through Ray's own NIXL transport
  floor      an actor call carrying a small Python value, the same two hops
  rdt-noop   Ray's RDT with a transport that moves nothing (the receiver makes an empty tensor
             of the shape): what RDT itself costs per object, whatever the transport

Each transfer is one round trip from the driver: the sender's method makes the object, the
receiver's reads its last element, `ray.get` returns. The sender keeps one tensor per size and
returns it each time (weights, not fresh activations). Run:
`.venv/bin/python benchmarks/ray_transport.py` (a local Ray cluster of this machine's CPUs,
started and stopped here; about a minute).
"""

import argparse
import os
import sys

import ray
import ray.experimental
import torch

from devipc._tools._bench.common import median_seconds
from devipc.ray._transport import DevipcMetadata, DevipcTransport

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20, "256 MiB": 256 << 20}


class NoopTransport(DevipcTransport):
    """RDT's own cost: metadata of the shapes, and a receiver that makes empty tensors."""

    def extract_tensor_transport_metadata(self, obj_id, rdt_object):  # type: ignore[no-untyped-def]
        return DevipcMetadata(
            tensor_meta=[(t.shape, t.dtype) for t in rdt_object],
            tensor_device=rdt_object[0].device.type,
        )

    def recv_multiple_tensors(
        self,
        obj_id,
        meta,
        communicator_metadata,  # type: ignore[no-untyped-def]
        target_buffers=None,
    ):
        return [
            torch.empty(shape, dtype=dtype, device=meta.tensor_device)
            for shape, dtype in meta.tensor_meta
        ]

    def garbage_collect(self, obj_id, tensor_transport_meta, tensors):  # type: ignore[no-untyped-def]
        pass


def _setup_worker() -> None:
    """Every Ray worker: the reference device, devipc's transport, and the name Ray's NIXL
    transport imports (`nixl`; the cu12 wheel installs `nixl_cu12`)."""
    try:
        import nixl_cu12
        import nixl_cu12._api

        sys.modules.setdefault("nixl", nixl_cu12)
        sys.modules.setdefault("nixl._api", nixl_cu12._api)
    except ImportError:
        pass
    import devipc.ray
    import devipc_openreg  # noqa: F401

    devipc.ray.register_transport()
    try:
        ray.experimental.register_tensor_transport(
            "NOOP", ["openreg", "cpu"], NoopTransport, torch.Tensor
        )
    except ValueError:
        pass  # registered already


_setup_worker()


@ray.remote(enable_tensor_transport=True)
class Sender:
    def __init__(self):
        torch.set_num_threads(1)
        self.device = {
            n: torch.full((n,), 7, dtype=torch.uint8, device="openreg") for n in SIZES.values()
        }
        self.host = {n: torch.full((n,), 7, dtype=torch.uint8) for n in SIZES.values()}
        torch.accelerator.synchronize()

    @ray.method(tensor_transport="DEVIPC")
    def devipc(self, n: int) -> list[torch.Tensor]:
        return [self.device[n]]

    @ray.method(tensor_transport="NOOP")
    def noop(self, n: int) -> list[torch.Tensor]:
        return [self.device[n]]

    def store(self, n: int) -> list[torch.Tensor]:
        return [self.device[n]]

    @ray.method(tensor_transport="NIXL")
    def nixl(self, n: int) -> list[torch.Tensor]:
        return [self.host[n]]

    def small(self, n: int) -> int:
        return n


@ray.remote(enable_tensor_transport=True)
class Receiver:
    def __init__(self):
        torch.set_num_threads(1)

    def take(self, value: object) -> int:
        if isinstance(value, list):
            return int(value[0][-1].item())  # touches the tensor where it lies
        return int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="round trips per figure (median)")
    parser.add_argument("--plot", metavar="PNG", help="also draw the figures (matplotlib)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"worker_process_setup_hook": _setup_worker},
    )
    try:
        sender, receiver = Sender.remote(), Receiver.remote()
        ray.get([sender.small.remote(0), receiver.take.remote(0)], timeout=120)
        paths = {"devipc": sender.devipc, "store": sender.store, "ray-nixl": sender.nixl}
        floor = median_seconds(
            lambda: ray.get(receiver.take.remote(sender.small.remote(1)), timeout=120), args.repeats
        )
        noop = median_seconds(
            lambda: ray.get(receiver.take.remote(sender.noop.remote(4096)), timeout=120),
            args.repeats,
        )
        rows = {}
        for label, n in SIZES.items():
            repeats = args.repeats if n <= 1 << 20 else max(3, args.repeats // 3)
            rows[label] = {}
            for path, method in paths.items():
                try:
                    rows[label][path] = median_seconds(
                        lambda m=method, n=n: ray.get(
                            receiver.take.remote(m.remote(n)), timeout=300
                        ),
                        repeats,
                    )
                except Exception as error:  # noqa: BLE001
                    # e.g. Ray's NIXL where its agent cannot start
                    rows[label][path] = None
                    print(f"{path} at {label}: {type(error).__name__}: {error}"[:200])
        print(
            f"\nfloor (a small value, sender -> receiver): {floor * 1e3:.2f} ms; "
            f"rdt-noop (RDT moving nothing): {noop * 1e3:.2f} ms, {noop / floor:.2f}x the "
            f"floor\n"
        )
        print(
            f"{'size':>8} | {'devipc ms':>10} | {'store ms':>10} | {'ray-nixl ms':>11} | "
            f"{'store/devipc':>12} | {'nixl/devipc':>11} | {'devipc/floor':>12} | "
            f"{'devipc GB/s':>11}"
        )
        for label, n in SIZES.items():
            row = rows[label]
            ours = row["devipc"]

            def ms(value: float | None) -> str:
                return "n/a" if value is None else f"{value * 1e3:.2f}"

            def ratio(value: float | None, ours: float | None = ours) -> str:
                return "n/a" if value is None or ours is None else f"{value / ours:.1f}x"

            print(
                f"{label:>8} | {ms(ours):>10} | {ms(row['store']):>10} | "
                f"{ms(row['ray-nixl']):>11} | {ratio(row['store']):>12} | "
                f"{ratio(row['ray-nixl']):>11} | "
                f"{'n/a' if ours is None else f'{ours / floor:.2f}x':>12} | "
                f"{'n/a' if ours is None else f'{n / ours / 1e9:.2f}':>11}"
            )
        if args.plot:
            _plot(rows, floor, noop, args.plot)
    finally:
        ray.shutdown()


def _plot(rows: dict, floor: float, noop: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    sizes = list(SIZES.values())
    for name in ("devipc", "store", "ray-nixl"):
        points = [
            (n, rows[label][name] * 1e3)
            for label, n in SIZES.items()
            if rows[label][name] is not None
        ]
        axes.plot(*zip(*points), marker="o", label=name)
    axes.axhline(floor * 1e3, color="grey", linestyle="--", label="floor (small value)")
    axes.axhline(noop * 1e3, color="grey", linestyle=":", label="RDT moving nothing")
    axes.set(
        xscale="log",
        yscale="log",
        xlabel="tensor bytes",
        ylabel="round trip (ms)",
        title="Ray actor to actor: one openreg tensor (ray-nixl: CPU)",
    )
    axes.set_xticks(sizes, list(SIZES))
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
