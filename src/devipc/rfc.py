"""devipc for torch's own plumbing: the RFC "Adding IPC Support for Third-Party Devices", as torch
would call it.

The storage methods (`share_device`, `new_shared_device`, `release_ipc_counter_device`) are also
`torch.UntypedStorage._share_device_` etc., and `rebuild_device_tensor` is
`torch.multiprocessing.reductions.rebuild_device_tensor`, once `install()` ran (a device's
registration runs it); `uninstall()` gives torch its own reducers back.
"""

from ._core._reductions import install, installed, rebuild_device_tensor, uninstall
from ._core._sharing import (
    SharedStorage,
    new_shared_device,
    release_ipc_counter_device,
    share_device,
)
from ._public import name_as_public

__all__ = [
    "SharedStorage",
    "install",
    "installed",
    "new_shared_device",
    "rebuild_device_tensor",
    "release_ipc_counter_device",
    "share_device",
    "uninstall",
]

name_as_public(__name__, globals(), __all__)
