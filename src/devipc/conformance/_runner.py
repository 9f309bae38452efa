"""Runs checks one after the other, each in a thread of its own with a deadline: a check that
hangs fails by timeout (its peers are killed) and the kit goes on."""
from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import _device
from ._check import Check, CheckFailed, Skip
from ._kit import Kit
from ._peers import PeerError, Peers

CHECK_TIMEOUT = 120.0  # seconds for one check, its peers' start included


@dataclass(frozen=True)
class Result:
    name: str
    proves: str
    status: str  # "passed", "failed" or "skipped"
    detail: str  # passed: what was covered; failed: how; skipped: why
    seconds: float


def attempt(check: Check, kit: Kit) -> tuple[str, str]:
    try:
        return "passed", check.run(kit) or ""
    except Skip as skip:
        return "skipped", str(skip)
    except (CheckFailed, PeerError, TimeoutError) as failure:
        return "failed", str(failure)
    except BaseException as error:  # whatever a check raises is its verdict, never the kit's end
        where = traceback.extract_tb(error.__traceback__)[-1]
        return "failed", (f"{type(error).__name__}: {error} "
                          f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})")


def run_one(check: Check, kit: Kit, timeout: float) -> Result:
    outcome: list[tuple[str, str]] = []
    start = time.monotonic()
    thread = threading.Thread(target=lambda: outcome.append(attempt(check, kit)),
                              name=f"conformance {check.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        kit.hung = True
        kit.peers.kill_all()  # whatever it waits on in a peer ends now
        status, detail = "failed", f"did not finish within {timeout:g} s (hung)"
    else:
        status, detail = outcome[0]
    if status == "failed" and not kit.hung:
        forget(kit)
    return Result(check.name, check.proves, status, detail, time.monotonic() - start)


def forget(kit: Kit) -> None:
    """After a failure, the shared peer lets go of what the check left it holding."""
    try:
        kit.peer().call("reset", kit.target, timeout=20)
    except PeerError:
        pass  # it was killed; the next check gets a new one


class Session:
    """The peers and the device of one run; checks run one at a time; `close` ends the peers."""

    def __init__(self, device: torch.device, modules: list[str], fresh: int = 0):
        _device.load(modules)
        self.kit = Kit(device, modules, Peers(modules, fresh))

    def run(self, check: Check, timeout: float = CHECK_TIMEOUT) -> Result:
        return run_one(check, self.kit, timeout)

    def close(self) -> None:
        self.kit.peers.close()


def run(checks: Sequence[Check], device: torch.device, modules: list[str],
        report: Callable[[Result], None] = lambda result: None,
        timeout: float = CHECK_TIMEOUT) -> tuple[list[Result], bool]:
    """Run `checks` against `device` (its hooks registered, `modules` imported); each result
    also goes to `report` as it comes. Returns the results, and whether a check hung."""
    session = Session(device, modules, fresh=sum(check.fresh_peers for check in checks))
    results = []
    try:
        for check in checks:
            results.append(session.run(check, timeout))
            report(results[-1])
    finally:
        session.close()
    return results, session.kit.hung


def describe(device: torch.device) -> str:
    """One line on what is tested: the device, its hooks and their event mode."""
    import devipc

    hooks = devipc.get_ipc_hooks(device.type)
    if hooks is None:
        return f"{device}: no IPC hooks registered"
    try:
        size = hooks.ipc_event_handle_size()
        mode = f"{size}-byte event handles" if size else "no events (the producer synchronizes)"
    except Exception as error:
        mode = f"ipc_event_handle_size() raised {type(error).__name__}"
    count = _device.device_count(device)
    return (f"{device} of {count}, hooks {type(hooks).__module__}.{type(hooks).__qualname__}, "
            f"{mode}; torch {torch.__version__}, devipc {devipc.__version__}")
