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
    before = shm_entries()
    yield
    leaked = {e for e in shm_entries() - before if "openreg" in e or "devipc" in e
              or e.startswith("torch_")}
    assert not leaked, f"left in /dev/shm: {sorted(leaked)}"
