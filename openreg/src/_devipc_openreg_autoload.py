"""The `torch.backends` entry point of devipc-openreg: `import torch` calls `autoload()`.

openreg is the embedded default of a machine without an accelerator, and nothing more: torch has
one PrivateUse1 slot, and `torch.accelerator` prefers a PrivateUse1 backend over CUDA, XPU and MPS.
So where another backend or accelerator is present, this steps aside (no rename, no registration)
and says in one log line how to load openreg on purpose. A module of its own, outside the
`devipc_openreg` package, because importing that package is what loads the device.
"""

import logging
import os
from importlib.metadata import entry_points

import torch

SWITCH = "DEVIPC_OPENREG"  # "1": load even next to CUDA/XPU/MPS; "0": never autoload
_OWN_ENTRY_POINT = "_devipc_openreg_autoload:autoload"
log = logging.getLogger("devipc_openreg")


def _available(check) -> bool:
    try:
        return bool(check())
    except Exception:  # noqa: BLE001 - a broken or absent runtime is no accelerator
        return False


def privateuse1_claim() -> str | None:
    """Why the PrivateUse1 slot is not free for openreg, or None."""
    taken = torch._C._get_privateuse1_backend_name()
    if taken not in ("privateuseone", "openreg"):
        return f"the PrivateUse1 backend {taken!r} is registered"
    others = [
        ep.name for ep in entry_points(group="torch.backends") if ep.value != _OWN_ENTRY_POINT
    ]
    if others:  # an out-of-tree backend that autoloads (before or after us) claims the slot
        return f"another torch.backends entry point is installed ({', '.join(sorted(others))})"
    return None


def other_accelerator() -> str | None:
    """The first of CUDA, XPU, MPS that is available, or None."""
    checks = {
        "cuda": torch.cuda.is_available,
        "xpu": lambda: torch.xpu.is_available(),
        "mps": lambda: torch.backends.mps.is_available(),
    }
    return next((name for name, check in checks.items() if _available(check)), None)


def switch_value() -> str:
    """DEVIPC_OPENREG as documented: unset or empty (decide by the machine), "1" or "0"."""
    switch = os.environ.get(SWITCH, "")
    if switch not in ("", "0", "1"):
        raise ValueError(
            f"{SWITCH}={switch!r} is not understood: set {SWITCH}=1 to load openreg "
            f"even next to another accelerator, {SWITCH}=0 never to autoload it, or "
            f"leave it unset"
        )
    return switch


def autoload() -> None:
    switch = switch_value()
    if switch == "0":
        return
    claim = privateuse1_claim()
    if claim is not None:
        log.warning(
            "devipc-openreg is not loaded: %s, and torch has one PrivateUse1 slot. "
            "Share that device's tensors with devipc instead; %s=0 silences this.",
            claim,
            SWITCH,
        )
        return
    accelerator = other_accelerator() if switch != "1" else None
    if accelerator is not None:
        log.warning(
            "devipc-openreg is not loaded: %s is available and torch.accelerator would "
            "prefer openreg over it. Set %s=1 or `import devipc_openreg` to load it "
            "anyway; %s=0 silences this.",
            accelerator,
            SWITCH,
            SWITCH,
        )
        return
    try:
        import devipc_openreg  # noqa: F401  (importing it registers the device)
    except ImportError as err:
        if err.name != "devipc_openreg._C":
            raise
        # A glue not built, or built against another torch: `import torch` still works, without
        # openreg, and the one line says how to rebuild (an explicit import raises it).
        log.warning("devipc-openreg is not loaded: %s", err)
