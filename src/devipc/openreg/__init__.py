"""openreg: devipc's reference accelerator, a PyTorch PrivateUse1 backend named "openreg".

Layers, each using only the one below: the runtime (`libopenreg.so`, a CUDA-like C API without
torch) <- the glue (`_C`: allocator, device guard, hooks, kernels, registered statically when it
is loaded) <- this package (loads `_C`, names the backend, registers `torch.openreg`) <- the IPC
hooks (`_ipc_hooks`). `import torch` loads it through the `torch.backends` entry point
(`_autoload`); with TORCH_DEVICE_BACKEND_AUTOLOAD=0, `import devipc.openreg` does the same.
"""
import importlib.util

import torch

from . import _device


def _load_glue() -> None:
    spec = importlib.util.find_spec(__name__ + "._C")
    if spec is None or spec.origin is None:
        raise ImportError("devipc.openreg._C is not built; run "
                          "`pip install --no-build-isolation -e .` (or `python setup.py "
                          "build_ext --inplace`) in the devipc checkout")
    torch.ops.load_library(spec.origin)  # static registrations in _C do the rest


def _register() -> None:
    """Idempotent: torch refuses a second rename or module registration."""
    if getattr(torch, "openreg", None) is _device:
        return
    _load_glue()
    torch.utils.rename_privateuse1_backend("openreg")
    torch._register_device_module("openreg", _device)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)


def _autoload() -> None:
    """Entry point of `torch.backends`: importing this package already registered the device."""


_register()

from . import _ipc_hooks  # noqa: E402  (needs the device registered)

_ipc_hooks.register()
