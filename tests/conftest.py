"""Shared fixtures: spawned children that are always reaped, both openreg IPC modes, leak checks."""
import pytest
from _support import Children, shm_entries


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


@pytest.fixture(scope="session", autouse=True)
def no_dev_shm_leak():
    """What this run's processes left in /dev/shm (others' entries are not counted)."""
    before = shm_entries()
    yield
    leaked = shm_entries() - before
    assert not leaked, f"left in /dev/shm: {sorted(leaked)}"
