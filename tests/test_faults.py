"""Real SIGKILLs of the producer, the consumer, or both, at several points of a transfer, in both
openreg IPC modes. Whatever is killed, the survivor must be left with nothing of it: no fd, no
mapping of the dead process's memfds, nothing in /dev/shm, and (a surviving producer) its memory
back to where it was, reclaimed by the collector thread on its own."""

import contextlib
import os
import pickle

import _workers
import pytest
import torch
from _support import TIMEOUT, foreign_memfd_maps, open_fds, recv, shm_entries, wait_until

import devipc

pytestmark = pytest.mark.usefixtures("ipc_mode")

NBYTES = 1 << 16  # what the test process sends: a block of a segment it keeps cached


class Snapshot:
    """What the test process holds before a case; `nothing_left` waits until it holds no more."""

    def __init__(self):
        torch.accelerator.synchronize()
        wait_until(lambda: devipc.stats()["sent"] == 0, "earlier sends ended", collect=True)
        self.memory = torch.accelerator.memory_allocated()
        self.fds, self.shm, self.maps = open_fds(), shm_entries(), foreign_memfd_maps()

    def nothing_left(self):
        wait_until(
            lambda: torch.accelerator.memory_allocated() <= self.memory,
            "the producer's memory is back to its baseline",
        )
        wait_until(lambda: open_fds() <= self.fds, f"fds back to {self.fds}: {_fds()}")
        wait_until(
            lambda: foreign_memfd_maps() <= self.maps, "no mapping of another process's memfd left"
        )
        wait_until(
            lambda: shm_entries() <= self.shm,
            f"nothing new in /dev/shm: {shm_entries() - self.shm}",
        )


def _fds():
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(names)


def _warm_up():
    """Creates the counter file, event page and cached segment that later sends reuse."""
    scratch = torch.zeros(NBYTES // 4, device="openreg")
    shared = devipc.rfc.share_device(scratch.untyped_storage())
    devipc.rfc.release_ipc_counter_device(shared[4], shared[5])
    del scratch, shared


def _kill(*procs):
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.join(TIMEOUT)
        assert proc.exitcode == -9


@pytest.fixture
def deadline():
    """Call it once the consumers are dead: sends that they never opened end after a moment (the
    producer cannot know that nobody will read them)."""
    yield lambda: devipc.set_unopened_deadline(0.5)
    devipc.set_unopened_deadline(None)


# -- the test process is the producer ----------------------------------------------------------
@pytest.mark.parametrize("point", ["before_open", "holding"])
def test_killed_consumer(children, deadline, point):
    _warm_up()
    worker = _workers.idle_until_killed if point == "before_open" else _workers.hold_then_wait
    consumer, conn = children.start_piped(worker)
    before = Snapshot()
    tensor = torch.ones(NBYTES // 4, device="openreg")
    conn.send(tensor)  # pickled here and now: the slot is taken before the kill
    if point == "holding":
        assert recv(conn) == NBYTES // 4
    _kill(consumer)
    deadline()
    del tensor
    before.nothing_left()


@pytest.mark.parametrize("point", ["in_flight", "holding"])
def test_killed_forwarder_and_last_consumer(children, deadline, point):
    """A (this process) -> B -> C, B and C killed: before C opened, or while C holds."""
    _warm_up()
    to_b, onward, from_b = children.ctx.Queue(), children.ctx.Queue(), children.ctx.Queue()
    from_c = children.ctx.Queue()
    b = children.start(_workers.forward_and_hold, to_b, onward, from_b)
    worker = _workers.idle_until_killed if point == "in_flight" else _workers.hold_from_queue
    c = children.start(worker, onward, from_c)
    before = Snapshot()
    tensor = torch.ones(NBYTES // 4, device="openreg")
    to_b.put(tensor)
    assert from_b.get(timeout=TIMEOUT) == "forwarded"
    if point == "holding":
        assert from_c.get(timeout=TIMEOUT) == NBYTES // 4
    _kill(b, c)
    deadline()
    del tensor
    before.nothing_left()


def test_killed_forwarder_leaves_the_last_consumer_its_memory(children):
    """A -> B -> C with B killed before C opened: C still opens A's memory, and A frees it once
    C is killed too."""
    _warm_up()
    to_b, onward, from_b = children.ctx.Queue(), children.ctx.Queue(), children.ctx.Queue()
    to_c, from_c = children.ctx.Queue(), children.ctx.Queue()
    b = children.start(_workers.forward_and_hold, to_b, onward, from_b)
    c = children.start(_workers.hold_from_queue, onward, from_c, to_c)
    before = Snapshot()
    tensor = torch.full((NBYTES // 4,), 2.0, device="openreg")
    to_b.put(tensor)
    assert from_b.get(timeout=TIMEOUT) == "forwarded"
    _kill(b)
    to_c.put("open")  # B's send waits in the pipe; C opens it only now
    assert from_c.get(timeout=TIMEOUT) == 2.0 * NBYTES / 4
    del tensor
    devipc.ipc_collect()
    assert torch.accelerator.memory_allocated() > before.memory, "freed while C holds it"
    _kill(c)
    before.nothing_left()


# -- the test process is a consumer ------------------------------------------------------------
def test_killed_producer_before_open(children):
    producer, conn = children.start_piped(_workers.send_raw_then_wait, 1)
    before = Snapshot()
    payload = recv(conn)
    _kill(producer)
    with pytest.raises(devipc.PeerGoneError):
        pickle.loads(payload)
    before.nothing_left()


def test_killed_producer_while_held(children):
    producer, conn = children.start_piped(_workers.send_raw_then_wait, 1)
    before = Snapshot()
    tensor = pickle.loads(recv(conn))
    _kill(producer)
    assert tensor.sum().item() == sum(range(1 << 14))  # still mapped, still ours
    tensor.add_(1)
    del tensor
    before.nothing_left()


@pytest.mark.parametrize("point", ["before_open", "holding"])
def test_killed_producer_and_other_consumer(children, point):
    """Producer P sends to this process and to consumer C; P and C are killed."""
    worker = _workers.idle_until_killed if point == "before_open" else _workers.hold_then_wait
    producer, p_conn = children.start_piped(_workers.send_raw_then_wait, 2)
    consumer, c_conn = children.start_piped(worker)
    before = Snapshot()
    ours, theirs = recv(p_conn), recv(p_conn)
    c_conn.send(theirs)
    if point == "holding":
        tensor = pickle.loads(ours)
        assert recv(c_conn) == sum(range(1 << 14))
    _kill(producer, consumer)
    if point == "holding":
        assert tensor.sum().item() == sum(range(1 << 14))
        del tensor
    else:
        with pytest.raises(devipc.PeerGoneError):
            pickle.loads(ours)
    before.nothing_left()


def test_killed_producer_and_forwarder(children):
    """A -> B -> C (this process), A and B killed while C holds."""
    to_b, onward, from_b = children.ctx.Queue(), children.ctx.Queue(), children.ctx.Queue()
    a = children.start(_workers.produce_and_wait, to_b)
    b = children.start(_workers.forward_and_hold, to_b, onward, from_b)
    before = Snapshot()
    tensor = onward.get(timeout=TIMEOUT)
    assert from_b.get(timeout=TIMEOUT) == "forwarded"
    _kill(a, b)
    assert tensor.cpu().tolist() == [0.0, 10.0, 20.0, 30.0]
    del tensor
    before.nothing_left()
