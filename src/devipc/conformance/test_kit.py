"""The kit as pytest tests, one per check (`pytest --pyargs devipc.conformance`; see
pytest_plugin.py for the options). A failed check fails its test with the kit's message, a
skipped one skips with the reason. Runs only under pytest, whose module it takes from
sys.modules: the core imports nothing beyond torch."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import torch

from . import CHECKS, Session, select

_sessions: dict[int, Session] = {}


def skip(reason: str) -> NoReturn:
    """pytest.skip of the pytest running this module (the core never imports pytest)."""
    sys.modules["pytest"].skip(reason)
    raise AssertionError("pytest.skip returned")


def pytest_generate_tests(metafunc: Any) -> None:
    if "conformance_check" in metafunc.fixturenames:
        names = [check.name for check in select()]
        metafunc.parametrize("conformance_check", names, ids=names)


def target(config: Any) -> tuple[str | None, int, list[str]]:
    """(device type, index, modules) from the plugin's options, else from the environment."""
    device = getattr(config.option, "devipc_device", None) or os.environ.get(
        "DEVIPC_CONFORMANCE_DEVICE"
    )
    index = getattr(config.option, "devipc_index", None)
    if index is None:
        index = int(os.environ.get("DEVIPC_CONFORMANCE_INDEX", "0"))
    modules = getattr(config.option, "devipc_modules", None) or [
        name for name in os.environ.get("DEVIPC_CONFORMANCE_HOOKS_MODULES", "").split(",") if name
    ]
    return device, index, modules


def session(config: Any) -> Session:
    """One Session per pytest run, closed when pytest ends."""
    if id(config) not in _sessions:
        device, index, modules = target(config)
        if device is None:
            skip(
                "no device named: pytest -p devipc.conformance.pytest_plugin --device TYPE, "
                "or DEVIPC_CONFORMANCE_DEVICE=TYPE"
            )
        _sessions[id(config)] = Session(torch.device(device, index), modules)
        config.add_cleanup(lambda: _sessions.pop(id(config)).close())
    return _sessions[id(config)]


def test_check(conformance_check: str, request: Any) -> None:
    check = next(check for check in CHECKS if check.name == conformance_check)
    result = session(request.config).run(check)
    if result.status == "skipped":
        skip(result.detail)
    if result.status == "failed":
        raise AssertionError(f"{check.name} ({check.proves}): {result.detail}")
