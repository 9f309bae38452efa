"""Shared fixtures: spawned children that are always reaped, both openreg IPC modes, leak checks,
a test's garbage collected before the next test; xdist groups that hold on pytest 9.2."""

import gc
import sys

import pytest
from _support import Children, shm_entries


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """`--dist loadgroup` sends a test to its `xdist_group`'s worker by a suffix of its node id,
    "@group", that pytest-xdist 3.8 writes into a field pytest 9.2 no longer reads (structured
    node ids; pytest-dev/pytest-xdist#1386): no test stayed in its group, so a module's shared
    set-up (vLLM's engine, the relay's engines, a Ray cluster) started in each worker, and two
    Ray clusters ran at once. The suffix goes where pytest 9.2 reads it, as xdist's fix does."""
    if not config.getoption("loadgroup", False):
        return
    for item in items:
        groups = sorted(
            {
                str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                for mark in item.iter_markers("xdist_group")
            }
        )
        nodeid = item.nodeid
        if groups and nodeid.rfind("@") <= nodeid.rfind("]"):  # no suffix (xdist's test)
            from _pytest.nodeid import NodeId  # pytest >= 9.2: older ones took xdist's suffix

            item._id = NodeId.parse(f"{nodeid}@{'_'.join(groups)}")


@pytest.fixture(autouse=True)
def exported_garbage_is_collected():
    """A test's exported tensors that only a reference cycle still holds (a `pytest.raises(...)
    as info` keeps the test's frame, and the model in it, alive) are collected before the next
    test of this worker: one that waits for every export to end, or for a segment to go, must not
    wait on them. Only then: a full collection costs 0.2-0.4 s with vLLM imported."""
    yield
    devipc = sys.modules.get("devipc")
    if devipc is None:
        return
    devipc.ipc_collect()
    if devipc.stats()["exports"]:
        gc.collect()
        devipc.ipc_collect()  # what the garbage held, let go of now


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
