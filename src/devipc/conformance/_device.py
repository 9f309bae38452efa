"""The device under test through torch's device module (`torch.get_device_module`), not
`torch.accelerator`: the kit talks to the named device even where another one is torch's current
accelerator. Used in the kit's process and in its peers alike."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

import devipc


def load(modules: Iterable[str]) -> None:
    """Import the user's modules (`--hooks-module`) that load a device or register its hooks:
    in the kit's process and in every process it starts, before anything is shared."""
    for name in modules:
        importlib.import_module(name)


def module_of(device: torch.device) -> Any:
    return torch.get_device_module(device.type)


def synchronize(device: torch.device) -> None:
    module_of(device).synchronize(device)


def current_stream(device: torch.device) -> torch.Stream:
    return module_of(device).current_stream(device)


def device_count(device: torch.device) -> int:
    return int(module_of(device).device_count())


def memory_allocated(device: torch.device) -> int | None:
    """Bytes the device's allocator hands out now, or None where its module cannot tell."""
    allocated = getattr(module_of(device), "memory_allocated", None)
    return None if allocated is None else int(allocated(device))


def settle(device: torch.device, timeout: float) -> None:
    """Let this process's finished device work release what it received (the releases wait for
    queued work, then run from devipc's collector)."""
    synchronize(device)
    wait_for(lambda: devipc.stats()["pending_releases"] == 0, "received memory released", timeout)


def wait_for(condition: Callable[[], object], what: str, timeout: float) -> None:
    """Poll `condition` (running devipc's collector each time) until it holds; TimeoutError
    naming `what` after `timeout` seconds. For effects of background threads and other
    processes, which nobody can wait on directly."""
    deadline = time.monotonic() + timeout
    while True:
        devipc.ipc_collect()
        if condition():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:g} s: {what}")
        time.sleep(0.01)
