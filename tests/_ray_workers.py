"""Ray actors for tests/test_ray.py: a sender that makes tensors and returns them through devipc's
transport, a receiver that reads (and writes) what it is given. Importable by Ray's workers (the
test puts this directory on their PYTHONPATH)."""

import os

import ray
import torch

import devipc
import devipc.ray
import devipc_openreg  # noqa: F401 - the reference device's hooks, before the registration

NETWORK = "DEVIPC_NET"  # the same transport, reading over NIXL even on one host

# Before the classes: `ray.method` checks that the transport it names is registered, in the
# driver and in each worker that imports this module.
devipc.ray.register_transport()
devipc.ray.register_transport(NETWORK, network=True)


def sample(device: str, step: float = 0.0) -> list[torch.Tensor]:
    """Tensors of several dtypes and layouts, some views of one storage, one empty."""
    base = torch.arange(24, dtype=torch.float32, device=device) + step
    return [
        base,
        base.view(4, 6)[1:3, ::2],
        torch.full((5,), 7 + step, dtype=torch.bfloat16, device=device),
        torch.arange(6, dtype=torch.int64, device=device).reshape(2, 3).t(),
        torch.tensor([True, False, True], device=device),
        torch.empty(0, 3, device=device),
    ]


def described(tensors: list[torch.Tensor]) -> list[tuple]:
    """What a tensor is, as plain values: dtype, shape, values."""
    return [(str(t.dtype), tuple(t.shape), t.float().cpu().tolist()) for t in tensors]


def _manager(name: str):
    from ray.experimental.rdt.util import get_tensor_transport_manager

    return get_tensor_transport_manager(name)


@ray.remote(enable_tensor_transport=True)
class Sender:
    def __init__(self, device: str):
        self.device = device
        self.kept: dict[str, list[torch.Tensor]] = {}

    def pid(self) -> int:
        return os.getpid()

    @ray.method(tensor_transport="DEVIPC")
    def make(self, key: str, step: float = 0.0) -> list[torch.Tensor]:
        tensors = self.kept[key] = sample(self.device, step)
        return tensors

    @ray.method(tensor_transport=NETWORK)
    def make_over_network(self, key: str, step: float = 0.0) -> list[torch.Tensor]:
        return self.make(key, step)

    @ray.method(tensor_transport="DEVIPC")
    def make_big(self, nbytes: int) -> list[torch.Tensor]:
        return [torch.full((nbytes,), 3, dtype=torch.uint8, device=self.device)]

    def kept_values(self, key: str) -> list[tuple]:
        torch.accelerator.synchronize()
        return described(self.kept[key])

    def forget(self, key: str) -> None:
        self.kept.pop(key, None)

    def held(self) -> dict:
        """The objects the transports keep for Ray, and devipc's own counts."""
        import gc

        gc.collect()
        devipc.ipc_collect()
        stats = devipc.stats()
        return {
            "objects": _manager("DEVIPC").held() + _manager(NETWORK).held(),
            "sent": stats["sent"],
        }


@ray.remote(enable_tensor_transport=True)
class Receiver:
    def __init__(self):
        self.kept: list[torch.Tensor] = []

    def pid(self) -> int:
        return os.getpid()

    def take(self, tensors: list[torch.Tensor], write: bool = False, keep: bool = False) -> dict:
        """What arrived, where, and whether it is the sender's memory (a write is seen there)."""
        seen = {
            "devices": sorted({str(t.device) for t in tensors}),
            "tensors": described(tensors),
            "received_via_ipc": [devipc.received_via_ipc(t) for t in tensors if t.numel()],
        }
        if write:
            tensors[0][0] = -1
            torch.accelerator.synchronize()
        if keep:
            self.kept = list(tensors)
        return seen

    def kept_described(self) -> list[tuple]:
        """What the tensors it kept hold now."""
        torch.accelerator.synchronize()
        return described(self.kept)

    def drop(self) -> dict:
        """Let go of what it kept; what devipc still maps here."""
        import gc

        self.kept.clear()
        gc.collect()
        return devipc.stats()
