"""devipc for Ray: a Ray Direct Transport that moves tensors of any device with devipc hooks (and
CPU tensors) between actors, zero-copy on one host and by one-sided NIXL reads across hosts.

    import devipc.ray
    devipc.ray.register_transport()             # in the driver, before making the actors

    @ray.remote
    class Trainer:
        @ray.method(tensor_transport="DEVIPC")
        def weights(self):
            return [self.model.weight]          # an openreg tensor: no copy to an actor here

An optional extra (`pip install 'devipc[ray]'`); the core never imports it. docs/ray.md says
what each path does, and what the lifetimes are.
Inside devipc it builds on `_core`, `_weights` and `p2p`.
"""

try:
    import ray  # noqa: F401
    from ray.experimental import register_tensor_transport
except ImportError as error:  # pragma: no cover - the extra is installed where this is tested
    raise ImportError(f"devipc.ray needs Ray: pip install 'devipc[ray]' ({error})") from None

import torch

from .._core._hooks import sharing_device_types
from .._public import name_as_public
from ._transport import READERS, DevipcNetworkTransport, DevipcTransport

__all__ = ["READERS", "TRANSPORT", "register_transport"]

TRANSPORT = "DEVIPC"


def register_transport(name: str = TRANSPORT, *, network: bool = False) -> str:
    """Register devipc with Ray under `name` for every device type whose hooks are registered in
    this process now (import the device package first) and the CPU; returns the name Ray knows
    it by (upper case). Call it in the driver before making the actors that use it: Ray brings
    it to them. `network=True` reads over NIXL even between actors of one host (to try the path
    between hosts on one machine). A second call with the same name does nothing."""
    devices = sharing_device_types() + ["cpu"]
    manager = DevipcNetworkTransport if network else DevipcTransport
    try:
        register_tensor_transport(name, devices, manager, torch.Tensor)
    except ValueError as error:
        if "already registered" not in str(error):
            raise
    return name.upper()


name_as_public(__name__, globals(), __all__)
