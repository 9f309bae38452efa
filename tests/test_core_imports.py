"""The core is safe to install next to any accelerator: it imports no device and registers none."""

import ast
import pathlib
import textwrap

from _support import json_of

import devipc

CORE = pathlib.Path(devipc.__file__).parent


def imported_modules(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


def test_core_sources_import_only_torch_and_the_standard_library():
    for path in sorted(CORE.rglob("*.py")):
        # devipc.ray and devipc.vllm are their extras' own packages: what each plugs into
        allowed_roots = {"torch", "devipc"} | {
            extra for extra in ("ray", "vllm") if CORE / extra in path.parents
        }
        for name in imported_modules(path):
            root = name.split(".")[0]
            assert root in allowed_roots or root in __import__("sys").stdlib_module_names, (
                f"{path.name} imports {name}: the core imports no device or third-party package"
            )


def test_importing_devipc_registers_no_device():
    # DEVIPC_OPENREG=0 keeps this checkout's installed reference device out, as if only the core
    # were installed (the packaging check in .ci/run tests a venv holding devipc alone).
    state = json_of(
        textwrap.dedent("""
        import json, sys, torch
        before = (str(torch.accelerator.current_accelerator()),
                  torch._C._get_privateuse1_backend_name())
        import devipc, devipc._core._reductions, devipc._core._sharing, devipc._core._memory
        after = (str(torch.accelerator.current_accelerator()),
                 torch._C._get_privateuse1_backend_name())
        print(json.dumps({"before": before, "after": after,
                          "device_modules": sorted(m for m in sys.modules if "openreg" in m),
                          "installed": devipc.rfc.installed()}))
    """),
        DEVIPC_OPENREG="0",
    )
    # torch's CUDA builds say "cuda" even without a GPU, its CPU builds None: unchanged is the point
    assert state["before"] == state["after"] and state["before"][1] == "privateuseone"
    # the entry point of the installed reference device ran, and stepped aside
    assert state["device_modules"] == ["_devipc_openreg_autoload"]
    assert state["installed"] is False  # no device registered hooks: torch's reducers untouched
