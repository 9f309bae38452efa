"""devipc: zero-copy inter-process sharing of PyTorch tensors on any accelerator.

A device implements `IpcHooks` and calls `register_ipc_hooks`; from then on its tensors cross
`torch.multiprocessing` queues, pipes and DataLoader workers without a copy. CUDA, CPU and devices
without hooks keep torch's own path. This package never imports a device.

The public surface, by audience: `devipc` for users (below, `__all__`); `devipc.hooks` for device
vendors; `devipc.rfc` for the RFC's plumbing that torch calls; `devipc.p2p` for point-to-point
transfers.
"""

import sys

__version__ = "0.1.0"

if sys.platform != "linux":  # memfds, /proc/<pid>/fd and OFD locks have no equivalent elsewhere
    raise ImportError(
        f"devipc needs Linux (memfds, /proc/<pid>/fd, open file description locks); "
        f"this is {sys.platform}, which it does not support"
    )

# The torch-free layers first: importing torch (below) may autoload a device package that
# registers its hooks through these names while this package is still importing.
from . import _public, hooks
from ._core._errors import (
    AckTimeoutError,
    ChecksumError,
    ConsumerDiedError,
    DevIpcError,
    InvalidHandleError,
    PeerGoneError,
    ReshareError,
    SpentHandleError,
    UnsupportedDeviceError,
    UnsupportedTensorError,
)

# isort: split
from . import rfc
from ._core import _reductions
from ._core._handles import Handle, open, open_tensors, pack, share, share_tensors
from ._core._sharing import ipc_collect, received_via_ipc, revoke, set_unopened_deadline, stats
from ._core._state_dict import open_state_dict, share_state_dict
from ._weights._arena import Arena, ArenaReader, Chunk, open_arena
from ._weights._common import pack_module
from ._weights._publisher import WeightPublisher, WeightSubscriber
from ._weights._shard_layout import ParamLayout, layout_of, tp_slices
from ._weights._sharded import ShardedPublisher, ShardedSubscriber

__all__ = [
    "AckTimeoutError",
    "Arena",
    "ArenaReader",
    "ChecksumError",
    "Chunk",
    "ConsumerDiedError",
    "DevIpcError",
    "Handle",
    "InvalidHandleError",
    "ParamLayout",
    "PeerGoneError",
    "ReshareError",
    "ShardedPublisher",
    "ShardedSubscriber",
    "SpentHandleError",
    "UnsupportedDeviceError",
    "UnsupportedTensorError",
    "WeightPublisher",
    "WeightSubscriber",
    "hooks",
    "ipc_collect",
    "layout_of",
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
    "tp_slices",
]

_public.name_as_public(__name__, globals(), __all__)

# Module paths that pickles name by reference, kept from before the layers became folders.
sys.modules.setdefault(f"{__name__}._reductions", _reductions)

_MOVED = {name: module.__name__ for module in (hooks, rfc) for name in module.__all__}


def __getattr__(name: str) -> object:
    """A vendor's or torch's name asked of `devipc` itself: say where it lives."""
    if name in _MOVED:
        raise AttributeError(
            f"devipc.{name} is {_MOVED[name]}.{name}: `from {_MOVED[name]} import {name}`"
        )
    raise AttributeError(f"module 'devipc' has no attribute {name!r}")
