"""devipc: zero-copy inter-process sharing of PyTorch tensors on any accelerator.

A device implements `IpcHooks` and calls `register_ipc_hooks`; from then on its tensors cross
`torch.multiprocessing` queues, pipes and DataLoader workers without a copy. CUDA, CPU and devices
without hooks keep torch's own path. This package never imports a device.

The public surface, by audience: `devipc` for users (below, `__all__`); `devipc.hooks` for device
vendors; `devipc.rfc` for the RFC's plumbing that torch calls; `devipc.p2p` for point-to-point
transfers. The vendor and RFC names are also importable from `devipc` itself, as synonyms kept
for code written against the first release.
"""
import sys

__version__ = "0.1.0"

if sys.platform != "linux":  # memfds, /proc/<pid>/fd and OFD locks have no equivalent elsewhere
    raise ImportError(f"devipc needs Linux (memfds, /proc/<pid>/fd, open file description locks); "
                      f"this is {sys.platform}, which it does not support")

# The torch-free layers first: importing torch (below) may autoload a device package that
# registers its hooks through these names while this package is still importing.
from . import hooks
from ._errors import (
    AckTimeoutError,
    ConsumerDiedError,
    DevIpcError,
    InvalidHandleError,
    PeerGoneError,
    ReshareError,
    UnsupportedDeviceError,
    UnsupportedTensorError,
)
from .hooks import (  # synonyms of devipc.hooks
    IpcHooks,
    OpenedMemory,
    device_supports_ipc,
    get_ipc_hooks,
    register_ipc_hooks,
    unregister_ipc_hooks,
)

# isort: split
from . import rfc
from ._arena import Arena, ArenaReader, Chunk, open_arena
from ._handles import Handle, open, open_tensors, pack, share, share_tensors
from ._publisher import WeightPublisher, WeightSubscriber
from ._sharing import ipc_collect, received_via_ipc, revoke, set_unopened_deadline, stats
from ._state_dict import open_state_dict, share_state_dict
from ._weights import pack_module
from .rfc import (  # synonyms of devipc.rfc
    install,
    installed,
    new_shared_device,
    rebuild_device_tensor,
    release_ipc_counter_device,
    share_device,
    uninstall,
)

__all__ = [
    "AckTimeoutError",
    "Arena",
    "ArenaReader",
    "Chunk",
    "ConsumerDiedError",
    "DevIpcError",
    "Handle",
    "InvalidHandleError",
    "PeerGoneError",
    "ReshareError",
    "UnsupportedDeviceError",
    "UnsupportedTensorError",
    "WeightPublisher",
    "WeightSubscriber",
    "hooks",
    "ipc_collect",
    "open",
    "open_arena",
    "open_state_dict",
    "open_tensors",
    "pack",
    "pack_module",
    "received_via_ipc",
    "revoke",
    "rfc",
    "set_unopened_deadline",
    "share",
    "share_state_dict",
    "share_tensors",
    "stats",
]
