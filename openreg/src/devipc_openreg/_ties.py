"""Tied parameters stay tied through `module.to("openreg")` and back, as they do for CUDA.

torch's `Module._apply` keeps a parameter's identity only when it can give the Parameter the
converted tensor's data (`param.data = new`), which it allows for CPU, CUDA, XPU and a few more but
for no PrivateUse1 backend (`torch._has_compatible_shallow_copy_type`, fixed in C++). Otherwise it
makes a new Parameter in each module, so an embedding and an LM head that shared one Parameter
come out as two copies that train apart from the second step on, with no word said. Every
PrivateUse1 backend meets this; openreg, the reference device, closes it: after the outermost
`_apply` of a move to or from this backend, every place that held one Parameter before holds one
Parameter again (the first place's converted one). Ties made later (`model.tie_weights()`) and
models built under `with torch.device("openreg")` need nothing of this.
"""

import threading
from collections.abc import Callable

import torch

_torchs_own = torch.nn.Module._apply
_inside = threading.local()  # _apply recurses through children: only the outermost call ties


def _places_of_shared_parameters(module: torch.nn.Module) -> list[list[tuple]]:
    """[[(module, name), ...] for each Parameter held in more than one place]."""
    places: dict[int, list[tuple]] = {}
    for owner in module.modules():
        for name, parameter in owner._parameters.items():
            if parameter is not None:
                places.setdefault(id(parameter), []).append((owner, name))
    return [group for group in places.values() if len(group) > 1]


def _apply_keeping_ties(
    self: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
) -> torch.nn.Module:
    if getattr(_inside, "depth", 0) or not recurse:
        return _torchs_own(self, fn, recurse)
    shared = _places_of_shared_parameters(self)
    if not shared:
        return _torchs_own(self, fn, recurse)
    backend = torch._C._get_privateuse1_backend_name()
    before = [group[0][0]._parameters[group[0][1]].device for group in shared]
    _inside.depth = 1
    try:
        result = _torchs_own(self, fn, recurse)
    finally:
        _inside.depth = 0
    for group, was_on in zip(shared, before):
        kept = group[0][0]._parameters[group[0][1]]
        if backend not in (was_on.type, kept.device.type):
            continue  # not a move to or from this backend: torch's own result stands
        for owner, name in group[1:]:
            owner._parameters[name] = kept
    return result


def register() -> None:
    """Idempotent."""
    if torch.nn.Module._apply is _torchs_own:
        torch.nn.Module._apply = _apply_keeping_ties  # type: ignore[method-assign]
