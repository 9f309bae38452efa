"""Runs checks one after the other, each in a thread of its own with a deadline: a check that
hangs fails by timeout (its peers are killed) and the kit goes on."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import _device, _tasks
from ._check import Check, CheckFailed, Skip
from ._kit import Kit, overrides
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
    except BaseException as error:  # noqa: BLE001
        # whatever a check raises is its verdict, never the kit's end
        where = traceback.extract_tb(error.__traceback__)[-1]
        return "failed", (
            f"{type(error).__name__}: {error} ({where.filename.rsplit('/', 1)[-1]}:{where.lineno})"
        )


def run_one(check: Check, kit: Kit, timeout: float) -> Result:
    outcome: list[tuple[str, str]] = []
    start = time.monotonic()
    thread = threading.Thread(
        target=lambda: outcome.append(attempt(check, kit)),
        name=f"conformance {check.name}",
        daemon=True,
    )
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        kit.hung = True
        kill_started(kit.spared)  # peers and what they or the check started (DataLoader workers)
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
        kit.peer().call(_tasks.reset, kit.target, timeout=20)
    except PeerError:
        pass  # it was killed; the next check gets a new one


def descendants(spared: set[int]) -> list[int]:
    """This process's children, theirs and so on, less `spared` and theirs."""
    parents: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                line = stat.read()
        except OSError:
            continue  # gone
        parent = int(line[line.rfind(b")") + 2 :].split()[1])
        parents.setdefault(parent, []).append(int(entry))
    found, unvisited = [], list(parents.get(os.getpid(), []))
    while unvisited:
        pid = unvisited.pop()
        if pid not in spared:
            found.append(pid)
            unvisited += parents.get(pid, [])
    return found


def kill_started(spared: set[int]) -> None:
    """SIGKILL every process the kit started, found before any dies (an orphan is no longer
    found): an orphan would hold the device's memory and the kit's stdout, and a caller that
    captures the output would wait for ever. multiprocessing's resource tracker is spared: it
    unlinks the kit's semaphores when the kit exits."""
    for pid in descendants(spared):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"multiprocessing.resource_tracker" in cmdline.read():
                    continue
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # gone meanwhile


class CannotStart(Exception):
    """The device cannot be tested at all: the message says why; no check would tell more."""


SHARING = ("get_ipc_mem_handle", "open_ipc_mem_handle")  # every device's, beyond supports_ipc
EVENTS = ("get_ipc_event_handle", "wait_ipc_event")  # those of a device whose consumers wait


def preflight(device: torch.device) -> None:
    """Fail at once where every check would wait out its timeouts: no hooks, hooks whose
    supports_ipc() raises or says no (devipc then refuses every send), or hooks that leave one
    sharing needs to the base class (each send raises in the producer's queue feeder thread,
    and the peer waits for what never comes)."""
    import devipc

    hooks = devipc.hooks.get_ipc_hooks(device.type)
    if hooks is None:
        raise CannotStart(
            f"no IPC hooks are registered for {device.type!r} (is its hooks "
            f"package installed? --hooks-module imports it)"
        )
    try:
        answer = hooks.supports_ipc()
    except Exception as error:  # noqa: BLE001 - said as why the kit cannot start
        raise CannotStart(
            f"its hooks' supports_ipc() raised {type(error).__name__}: {error}; "
            f"it must answer True or False, and never raise"
        ) from None
    if answer is not True:
        raise CannotStart(
            f"its hooks' supports_ipc() answers {answer!r}: devipc shares "
            f"nothing of the device unless it answers True"
        )
    try:
        events = hooks.requires_event_sync()
    except Exception as error:  # noqa: BLE001 - said as why the kit cannot start
        raise CannotStart(
            f"its hooks' requires_event_sync() raised {type(error).__name__}: "
            f"{error}; it must answer True or False"
        ) from None
    needed = SHARING + (EVENTS if events else ())
    missing = [name for name in needed if not overrides(hooks, name)]
    if missing:
        why = (
            " (requires_event_sync() is True: consumers wait on events)"
            if set(missing) & set(EVENTS)
            else ""
        )
        raise CannotStart(
            f"its hooks {type(hooks).__module__}.{type(hooks).__qualname__} do "
            f"not implement {', '.join(missing)}{why}: devipc cannot share "
            f'without them (docs/vendor-guide.md, "The six hooks")'
        )


class Session:
    """The peers and the device of one run; checks run one at a time; `close` ends the peers.
    CannotStart before any peer starts when the device cannot be tested at all."""

    def __init__(self, device: torch.device, modules: list[str], fresh: int = 0):
        _device.load(modules)
        preflight(device)
        if device.index is None:  # as the peers will name it: with its index
            device = torch.device(device.type, _device.module_of(device).current_device())
        spared = set(descendants(set()))  # the caller's own children (pytest's, say)
        self.kit = Kit(device, modules, Peers(modules, fresh), spared=spared)

    def run(self, check: Check, timeout: float = CHECK_TIMEOUT) -> Result:
        return run_one(check, self.kit, timeout)

    def close(self) -> None:
        self.kit.peers.close()


def run(
    checks: Sequence[Check],
    device: torch.device,
    modules: list[str],
    report: Callable[[Result], None] = lambda result: None,
    timeout: float = CHECK_TIMEOUT,
) -> tuple[list[Result], bool]:
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

    hooks = devipc.hooks.get_ipc_hooks(device.type)
    if hooks is None:
        return f"{device}: no IPC hooks registered"
    try:
        mode = (
            "interprocess events"
            if hooks.requires_event_sync()
            else "no events (the producer synchronizes)"
        )
    except Exception as error:  # noqa: BLE001 - said in the report's first line
        mode = f"requires_event_sync() raised {type(error).__name__}"
    count = _device.device_count(device)
    return (
        f"{device} of {count}, hooks {type(hooks).__module__}.{type(hooks).__qualname__}, "
        f"{mode}; torch {torch.__version__}, devipc {devipc.__version__}"
    )
