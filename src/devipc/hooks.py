"""devipc for device vendors: the hook contract a device implements, and its registry.

    from devipc.hooks import IpcHooks, OpenedMemory, register_ipc_hooks

Torch-free, like the module it names (`_hooks`): a device that torch autoloads can register
through it while devipc itself is still importing. docs/vendor-guide.md says what each method
must guarantee, and how to prove it with the conformance kit.
"""

from ._core._hooks import (
    IpcHooks,
    IpcMemHandle,
    OpenedMemory,
    device_supports_ipc,
    get_ipc_hooks,
    register_ipc_hooks,
    unregister_ipc_hooks,
)
from ._public import name_as_public

__all__ = [
    "IpcHooks",
    "IpcMemHandle",
    "OpenedMemory",
    "device_supports_ipc",
    "get_ipc_hooks",
    "register_ipc_hooks",
    "unregister_ipc_hooks",
]

name_as_public(__name__, globals(), __all__)
