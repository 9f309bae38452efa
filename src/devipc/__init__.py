"""devipc: zero-copy inter-process sharing of PyTorch tensors on any accelerator.

A device implements `IpcHooks` and calls `register_ipc_hooks`; from then on its tensors cross
`torch.multiprocessing` queues, pipes and DataLoader workers without a copy. CUDA, CPU and devices
without hooks keep torch's own path. This package never imports a device.
"""
__version__ = "0.1.0"

# The torch-free layers first: importing torch (below) may autoload a device package that
# registers its hooks through these names while this package is still importing.
from ._errors import (
    AckTimeoutError,
    ConsumerDiedError,
    DevIpcError,
    InvalidHandleError,
    PeerGoneError,
    ReshareError,
    UnsupportedDeviceError,
)
from ._hooks import (
    IpcHooks,
    OpenedMemory,
    device_supports_ipc,
    get_ipc_hooks,
    register_ipc_hooks,
    unregister_ipc_hooks,
)

# isort: split
from ._arena import Arena, ArenaReader, Chunk, open_arena
from ._handles import Handle, open, open_tensors, pack, share, share_tensors
from ._reductions import install, installed, rebuild_device_tensor, uninstall
from ._sharing import (
    ipc_collect,
    new_shared_device,
    received_via_ipc,
    release_ipc_counter_device,
    revoke,
    set_unopened_deadline,
    share_device,
    stats,
)
from ._state_dict import open_state_dict, share_state_dict

__all__ = [
    "AckTimeoutError",
    "Arena",
    "ArenaReader",
    "Chunk",
    "ConsumerDiedError",
    "DevIpcError",
    "Handle",
    "InvalidHandleError",
    "IpcHooks",
    "OpenedMemory",
    "PeerGoneError",
    "ReshareError",
    "UnsupportedDeviceError",
    "device_supports_ipc",
    "get_ipc_hooks",
    "install",
    "installed",
    "ipc_collect",
    "new_shared_device",
    "open",
    "open_arena",
    "open_state_dict",
    "open_tensors",
    "pack",
    "rebuild_device_tensor",
    "received_via_ipc",
    "register_ipc_hooks",
    "release_ipc_counter_device",
    "revoke",
    "set_unopened_deadline",
    "share",
    "share_device",
    "share_state_dict",
    "share_tensors",
    "stats",
    "uninstall",
    "unregister_ipc_hooks",
]
