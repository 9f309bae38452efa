"""devipc.p2p: a tensor registry tied to the tensors' life, and one-sided point-to-point reads
and writes between processes through it.

    tensor, tensor_id = create_tensor((1024,), torch.float32, "openreg")  # registered
    endpoint = Endpoint()                       # "auto"/"ipc": same host, the device's IPC hooks
    peer = endpoint.connect(peer_metadata)      # the peer's endpoint.metadata(), out of band
    peer.read(local, remote_descriptor)         # the peer's endpoint.advertise(its tensor)
    peer.read(part, remote_descriptor, offset=4096)  # part.nbytes from byte 4096 of the range
    with peer.prepare("read", locals_, remotes) as xfer:  # validated once
        xfer.post().wait()                      # ... posted many times

The core never imports this package; `import devipc.p2p` to use it. Its errors are devipc's
(`devipc._core._errors`), named here too.
Inside devipc it builds on the sharing core (`_core`) alone.
"""

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from .._core._errors import (
    DevIpcError,
    InvalidHandleError,
    NotRegisteredError,
    PeerGoneError,
    RemoteTensorFreedError,
    TransferSizeError,
    UnsupportedDeviceError,
)
from .._public import name_as_public
from ._endpoint import Connection, Endpoint, PreparedTransfer
from ._registry import Registration, registry
from ._transfer import Transfer
from ._transport import Link, Transport

if TYPE_CHECKING:
    import torch

    from .._core._memory import TensorOrStorage

__all__ = [
    "Connection",
    "DevIpcError",
    "Endpoint",
    "InvalidHandleError",
    "Link",
    "NotRegisteredError",
    "PeerGoneError",
    "PreparedTransfer",
    "Registration",
    "RemoteTensorFreedError",
    "Transfer",
    "TransferSizeError",
    "Transport",
    "UnsupportedDeviceError",
    "add_listener",
    "create_tensor",
    "deregister",
    "free_tensor",
    "get_tensor_id_by_tensor",
    "register",
    "registration",
    "remove_listener",
]


def create_tensor(
    shape: int | Iterable[int], dtype: "torch.dtype", device: "torch.device | str | int"
) -> "tuple[torch.Tensor, int]":
    """(tensor, tensor_id): a new uninitialized tensor, registered. CPU tensors are made in
    fd-backed shared memory, so peers map them without a copy."""
    import torch

    from .._core._memory import untyped

    device = torch.device(device)
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    if device.type == "cpu":
        layout = torch.empty(shape, dtype=dtype, device="meta")  # sizes and strides, no memory
        storage = torch.UntypedStorage._new_using_fd_cpu(layout.nbytes)
        tensor = torch.empty(0, dtype=dtype).set_(storage, 0, layout.shape, layout.stride())
    else:
        tensor = torch.empty(shape, dtype=dtype, device=device)
    return tensor, registry.register(untyped(tensor)).id


def register(tensor: "TensorOrStorage") -> int:
    """Register `tensor`'s storage (any device with IPC hooks, or a CPU tensor in fd-backed
    shared memory: `share_memory_()` it first); its id. The same storage twice: the same id."""
    return registry.register(tensor).id


def get_tensor_id_by_tensor(tensor: "TensorOrStorage") -> int:
    """The id of the registration of `tensor`'s storage (views and slices included);
    NotRegisteredError if it has none."""
    return registry.lookup(tensor).id


def registration(tensor_or_id: "TensorOrStorage | int") -> Registration:
    """The Registration of a tensor's storage or of an id (its nbytes, device, base, liveness)."""
    if isinstance(tensor_or_id, int) and not isinstance(tensor_or_id, bool):
        return registry.get(tensor_or_id)
    return registry.lookup(cast("TensorOrStorage", tensor_or_id))  # a bool: TypeError there


def deregister(tensor_id: int) -> bool:
    """End a registration early; whether it was live. Peers' transfers against it raise
    RemoteTensorFreedError from then on, and they close their mappings of it."""
    return registry.deregister(tensor_id)


def free_tensor(tensor: "TensorOrStorage") -> None:
    """Deregister `tensor`'s storage now (the tensor itself stays usable here; its memory goes
    when the last reference to it does, never while a peer still maps it)."""
    registry.deregister(registry.lookup(tensor).id)


def add_listener(listener: Any) -> None:
    """`listener.on_register(reg)` / `on_deregister(reg)` for every registration (transports)."""
    registry.add_listener(listener)


def remove_listener(listener: object) -> None:
    registry.remove_listener(listener)


name_as_public(__name__, globals(), __all__)
