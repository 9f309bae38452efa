"""The helpers the other tests lean on hold on a busy machine (a second suite beside this one):
leak checks count only what this run's processes made, bounds grow with the load, and children
that hold something until the test kills them wait as long as the test takes."""

import contextlib
import os
import time
import uuid

import _workers
import pytest
import torch
from _support import TIMEOUT, recv, run_python, shm_entries

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def shm_file():
    """make(prefix) creates /dev/shm/<prefix><random> and returns its name; removed afterwards."""
    made = []

    def make(prefix):
        made.append(f"{prefix}{uuid.uuid4().hex[:8]}")
        open(f"/dev/shm/{made[-1]}", "x").close()
        return made[-1]

    yield make
    for name in made:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


def test_leak_checks_count_only_what_this_runs_processes_made(children, shm_file):
    others = {
        shm_file(f"torch_{os.getppid()}_0_"),  # a live process that is not ours
        shm_file("sem.mp-"),
    }  # multiprocessing's semaphores name nobody
    ours = {shm_file(f"torch_{os.getpid()}_0_")}
    proc, conn = children.start_piped(_workers.make_shm_file_and_exit)
    left_by_child = recv(conn)  # what an exited child of ours left behind: a leak
    proc.join(TIMEOUT)
    try:
        found = shm_entries()
        assert ours | {left_by_child} <= found
        assert not found & others
    finally:
        os.unlink(f"/dev/shm/{left_by_child}")


def _bounds(**env) -> list[int]:
    code = (
        "import os, sys\n"
        "os.getloadavg = lambda: (40.0, 40.0, 40.0)  # a machine far busier than its cores\n"
        f"sys.path.insert(0, {TESTS!r})\n"
        "import _support\n"
        "print(_support.TIMEOUT, _support.FRESH_TIMEOUT)\n"
    )
    return [int(word) for word in run_python(code, **env).stdout.split()]


def test_bounds_grow_with_the_load_or_as_told():
    per_core = 40.0 / os.cpu_count()
    timeout, fresh = _bounds()
    assert timeout >= 60 * per_core and fresh >= 120 * per_core
    assert _bounds(DEVIPC_TESTS_SLOWDOWN="3") == [180, 360]


def test_children_that_hold_until_killed_outlive_a_slow_test(children):
    """Each holder's bound is cut to 0.2 s: it still holds 2 s later, until the test kills it."""
    ctx, holders = children.ctx, []
    ours, theirs = ctx.Pipe()
    holders.append(
        children.start(_workers.with_short_bounds, _workers.send_raw_then_wait, theirs, 1)
    )
    assert isinstance(recv(ours), bytes)
    ours, theirs = ctx.Pipe()
    holders.append(children.start(_workers.with_short_bounds, _workers.hold_then_wait, theirs))
    ours.send(torch.ones(4))
    assert recv(ours) == 4.0
    for worker, reply in (
        (_workers.forward_and_hold, "forwarded"),
        (_workers.hold_from_queue, 4.0),
        (_workers.read_some_then_wait, 1),
    ):
        inbox, onward, outbox = ctx.Queue(), ctx.Queue(), ctx.Queue()
        args = (
            (inbox, outbox, 1)
            if worker is _workers.read_some_then_wait
            else (
                (inbox, onward, outbox) if worker is _workers.forward_and_hold else (inbox, outbox)
            )
        )
        holders.append(children.start(_workers.with_short_bounds, worker, *args))
        inbox.put(torch.ones(4))
        assert outbox.get(timeout=TIMEOUT) == reply
    deadline = time.monotonic() + 2
    for proc in holders:
        proc.join(max(0.0, deadline - time.monotonic()))
    assert [proc.exitcode for proc in holders] == [None] * len(holders)
