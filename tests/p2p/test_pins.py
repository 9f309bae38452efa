"""Pins on a peer's opened registrations are counted exactly: a transfer that fails unpins only
what it pinned, so a copy another thread has in flight keeps its mapping (and its bytes) until
it ends; threads on one connection while the owner replaces registrations read only the bytes
of the registration they name, and leave nothing pinned."""

import multiprocessing.connection

import _p2p_workers
import pytest
import torch
from _support import TIMEOUT

import devipc.p2p as p2p

pytestmark = pytest.mark.xdist_group("p2p_pins")  # one worker starts the module's `owner`


def _entries(connection):
    return list(connection._link._peer._entries.values())


def _result(proc, conn, timeout=TIMEOUT):
    """The child's report, or a failed test saying how it ended (a crash fails at once)."""
    multiprocessing.connection.wait([conn, proc.sentinel], timeout)
    if conn.poll():
        return conn.recv()
    proc.join(TIMEOUT)
    pytest.fail(
        f"no report from the peer: exit code {proc.exitcode} (None: still running "
        f"after {timeout} s)"
    )


def test_a_failed_prepare_leaves_the_pins_as_they_were(owner, peer):
    """A prepare naming a registration the owner freed (its entry still cached) raises, and
    every entry's pins are what they were: none (before, the freed one's went to -1)."""
    call, _ = owner
    freed_id, freed = call("create", torch.arange(64, dtype=torch.float32), "cpu")
    live_id, live = call("create", torch.ones(64), "cpu")
    one, other = torch.zeros(64), torch.zeros(64)
    peer.readv([one, other], [live, freed])  # both opened, cached
    entries = _entries(peer)
    call("free", freed_id)
    for pairs in ([freed], [live, freed], [freed]):
        with pytest.raises(p2p.RemoteTensorFreedError):
            peer.prepare("read", [one, other][: len(pairs)], pairs)
        assert [entry._pins for entry in entries] == [0, 0]
    peer.read(one, live)
    assert one.tolist() == [1.0] * 64
    call("drop", live_id)


def test_a_copy_in_flight_keeps_its_pin_when_another_threads_prepare_fails(owner, children):
    """The owner frees a CPU registration while one thread's read of it is queued on a held
    stream; the main thread's prepare of it fails: the read keeps its pin and its mapping
    (before, the failed prepare unpinned it and the held copy read unmapped memory: SIGSEGV)."""
    call, metadata = owner
    tensor_id, whole = call("create", torch.full((1 << 20,), 7, dtype=torch.uint8), "cpu")
    proc, conn = children.start_piped(_p2p_workers.prepare_while_a_copy_is_pinned, metadata, whole)
    assert _result(proc, conn) == "pinned"
    assert call("free", tensor_id) == "ok"
    conn.send("freed")
    outcome = _result(proc, conn)
    assert outcome == {
        "prepare": "RemoteTensorFreedError",
        "pins_after_prepare": 1,
        "read": "ok",
        "held_bytes": [7],
        "pins_at_end": 0,
        "mapped_after_close": 0,
    }


@pytest.mark.slow
def test_six_threads_while_the_owner_replaces_registrations(children):
    ours, theirs = children.ctx.Pipe()
    children.start(_p2p_workers.replacing_owner, ours, 4, 0.002, 1 << 18)
    proc, conn = children.start_piped(_p2p_workers.threads_under_replacement, theirs, 6, 150)
    ours.close()
    theirs.close()
    counts = _result(proc, conn, 4 * TIMEOUT)
    assert counts["errors"] == [] and counts["wrong"] == [] and counts["hung"] == 0
    assert counts["ok"] + counts["freed"] == 6 * 150 and counts["ok"] > 0
    assert counts["replaced"] > 0 and counts["pins_left"] == 0
    assert counts["mapped_after_close"] == 0
