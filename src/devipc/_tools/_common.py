"""What the `devipc` command's parts share: the devices that registered IPC hooks, the modules
that registered them (a spawned child imports those to see the same devices), optional
packages loaded by name with the install line they need."""

import importlib
import types

import torch

from .._core._hooks import get_ipc_hooks

__all__ = ["device_types", "hook_modules", "load_modules", "optional"]

# Device types whose hooks `device_types` looks for (devipc keeps no list of them: any device may
# register); torch's PrivateUse1 backend, whatever its name, is added.
_CANDIDATES = ("xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu", "ve", "lazy")


def device_types() -> list[str]:
    """The device types with IPC hooks registered in this process."""
    names = [torch._C._get_privateuse1_backend_name(), *_CANDIDATES]
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None:
        names.insert(0, accelerator.type)
    return [name for name in dict.fromkeys(names) if get_ipc_hooks(name) is not None]


def hook_modules(device_types_: list[str]) -> list[str]:
    """The modules that define these devices' hooks: a spawned child imports them first, so that
    a device registered by an explicit import (not torch's autoload) is there too."""
    found = {type(hooks).__module__ for hooks in map(get_ipc_hooks, device_types_) if hooks}
    return sorted(found - {"__main__"})  # a script's own hooks: the child runs no script


def load_modules(names: list[str]) -> None:
    for name in names:
        importlib.import_module(name)


def optional(module: str, extra: str) -> types.ModuleType:
    """An optional package, or ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"this needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'devipc[{extra}]'"
        ) from None
