"""Shared fixtures: spawned children that are always reaped, both openreg IPC modes, leak checks."""
import multiprocessing
import os

import pytest

TIMEOUT = 60  # seconds; every join and every get is bounded by it


class Children:
    """Spawned processes that are joined with a timeout and killed if still alive, even when
    the test fails."""

    def __init__(self):
        self.ctx = multiprocessing.get_context("spawn")
        self.procs = []

    def start(self, target, *args):
        proc = self.ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def join_ok(self, timeout=TIMEOUT):
        for proc in self.procs:
            proc.join(timeout)
            assert not proc.is_alive(), f"{proc.name} did not finish within {timeout} s"
            assert proc.exitcode == 0, f"{proc.name} exited with {proc.exitcode}"

    def reap(self):
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


@pytest.fixture
def children():
    group = Children()
    try:
        yield group
    finally:
        group.reap()


@pytest.fixture(params=["sync", "events"])
def ipc_mode(request, monkeypatch):
    """openreg's two IPC modes; spawned children inherit the environment."""
    monkeypatch.setenv("OPENREG_IPC_EVENTS", "1" if request.param == "events" else "0")
    return request.param


def _shm_entries():
    return set(os.listdir("/dev/shm"))


@pytest.fixture(scope="session", autouse=True)
def no_dev_shm_leak():
    before = _shm_entries()
    yield
    leaked = {e for e in _shm_entries() - before if "openreg" in e or "devipc" in e
              or e.startswith("torch_")}
    assert not leaked, f"left in /dev/shm: {sorted(leaked)}"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))
