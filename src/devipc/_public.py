"""Public objects name the module a user imports them from (`devipc.Handle`, not
`devipc._core._handles.Handle`): in reprs, tracebacks, documentation and pickles by reference."""

from collections.abc import Iterable
from types import ModuleType


def name_as_public(module: str, namespace: dict[str, object], names: Iterable[str]) -> None:
    """Give each of `names` in `namespace` the public `module` as its `__module__`, when it was
    defined in a private devipc module (one a name of which starts with `_`)."""
    for name in names:
        obj = namespace[name]
        defined_in = getattr(obj, "__module__", None)
        if isinstance(obj, ModuleType) or not isinstance(defined_in, str):
            continue
        package, *modules = defined_in.split(".")
        if package == "devipc" and any(part.startswith("_") for part in modules):
            obj.__module__ = module
