"""openreg: devipc's reference accelerator, a PyTorch PrivateUse1 backend named "openreg".

Layers, each using only the one below: the runtime (`libopenreg.so`, a CUDA-like C API without
torch) <- the glue (`_C`: allocator, device guard, hooks, kernels, registered statically when it
is loaded) <- this package (loads `_C`, names the backend, registers `torch.openreg`) <- the IPC
hooks (`_ipc_hooks`); the package reaches the first two only through `_runtime`. Importing this
package loads the device on purpose; `import torch` loads it by itself only on a machine without
another accelerator (`_devipc_openreg_autoload`).
"""

import torch

from . import _device, _runtime

__version__ = "0.1.0"
BACKEND = "openreg"


def _register() -> None:
    """Idempotent: torch refuses a second rename or module registration."""
    if getattr(torch, BACKEND, None) is _device:
        return
    taken = torch._C._get_privateuse1_backend_name()
    if taken != "privateuseone":
        raise RuntimeError(
            f"cannot load openreg: torch's one PrivateUse1 slot is already taken by the "
            f"{taken!r} backend. openreg is devipc's reference device for machines without an "
            f"accelerator; use the {taken!r} device with devipc instead (its IPC hooks come with "
            f"its own package)"
        )
    _runtime.load_glue()
    torch.utils.rename_privateuse1_backend(BACKEND)
    torch._register_device_module(BACKEND, _device)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
    )


_register()

from . import _ipc_hooks  # noqa: E402  (needs the device registered)

_ipc_hooks.register()

from . import _exit  # noqa: E402

_exit.register()

from . import _dlpack, _ties  # noqa: E402

_dlpack.register()
_ties.register()

from . import _compile  # noqa: E402

_compile.register()

if torch.distributed.is_available():  # imported by torch already: registering costs ~2 ms
    from . import _distributed

    _distributed.register()
