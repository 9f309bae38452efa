"""Ref-counter slots: states, locks that die with their holder, files, forged indices."""

import _workers
import pytest
from _support import TIMEOUT

from devipc import InvalidHandleError, SpentHandleError
from devipc._core._refcount import (
    HELD,
    RELEASED,
    RESERVED_SLOTS,
    REVOKED,
    SENT,
    SLOTS_PER_FILE,
    ConsumerCounters,
    CounterFile,
    ProducerCounters,
    check_index,
    check_slot,
)


def test_a_peer_holds_then_releases_a_slot(children):
    pool = ProducerCounters()
    file, index = pool.allocate(export=7)
    assert file.counter.state(index) == SENT and file.counter.export(index) == 7
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.hold_slot_until_told, file.handle, index, inbox, outbox)
    assert outbox.get(timeout=TIMEOUT) == "held"
    assert file.counter.state(index) == HELD
    assert not file.counter.reclaim_if_holder_died(index)  # its lock says it lives
    assert not file.counter.revoke(index)
    inbox.put("release")
    assert outbox.get(timeout=TIMEOUT) == "released"
    children.join_ok()
    assert file.counter.state(index) == RELEASED


def test_the_slot_of_a_killed_holder_is_reclaimed(children):
    pool = ProducerCounters()
    file, index = pool.allocate(export=1)
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    child = children.start(_workers.hold_slot_until_told, file.handle, index, inbox, outbox)
    assert outbox.get(timeout=TIMEOUT) == "held"
    child.kill()
    child.join(TIMEOUT)
    assert file.counter.state(index) == HELD  # nobody said anything...
    assert file.counter.reclaim_if_holder_died(index)  # ...but the kernel dropped its lock
    assert file.counter.state(index) == RELEASED


def test_each_send_opens_once():
    pool, counters = ProducerCounters(), ConsumerCounters()
    file, index = pool.allocate(export=1)
    counters.hold(file.handle, index, lambda: None)  # the producer's own file, its own open
    with pytest.raises(SpentHandleError, match="already opened"):
        counters.hold(file.handle, index, lambda: None)
    counters.release_unopened(file.handle, index)  # the very send held here: nothing to give
    assert file.counter.state(index) == HELD
    counters.release(file.handle, index)
    assert file.counter.state(index) == RELEASED
    with pytest.raises(SpentHandleError, match="already opened and released"):
        counters.hold(file.handle, index, lambda: None)


def test_an_opening_that_fails_leaves_the_send_to_the_next_open():
    """The device refusing damaged bytes under the slot's lock takes nothing: the genuine
    bytes still open the send (issue 27, defect 6)."""
    pool, counters = ProducerCounters(), ConsumerCounters()
    file, index = pool.allocate(export=1)

    def refuse():
        raise InvalidHandleError("the device refuses these bytes")

    with pytest.raises(InvalidHandleError, match="refuses"):
        counters.hold(file.handle, index, refuse)
    assert file.counter.state(index) == SENT
    assert counters.hold(file.handle, index, lambda: "mapped") == "mapped"
    assert file.counter.state(index) == HELD
    counters.release(file.handle, index)


def test_revoked_sends_cannot_be_opened():
    pool, counters = ProducerCounters(), ConsumerCounters()
    file, index = pool.allocate(export=1)
    assert file.counter.revoke(index) and file.counter.state(index) == REVOKED
    with pytest.raises(SpentHandleError, match="revoked"):
        counters.hold(file.handle, index, lambda: None)


def test_a_consumer_can_take_a_slot_for_forwarding():
    pool, counters = ProducerCounters(), ConsumerCounters()
    file, index = pool.allocate(export=42)
    counters.hold(file.handle, index, lambda: None)
    forwarded = counters.forward(file.handle, index)
    # the next slot past those the producer reserved for its own sends
    assert forwarded == index + RESERVED_SLOTS and file.counter.state(forwarded) == SENT
    assert pool.new_slots() == [(file, forwarded, 42)]
    assert pool.new_slots() == []  # seen once
    assert pool.allocate(export=42) == (file, index + 1)  # the producer's next, reserved
    counters.release(file.handle, index)
    counters.release_unopened(file.handle, forwarded)


def test_a_slot_another_process_takes_is_listed_with_its_export_whenever_the_producer_looks(
    monkeypatch,
):
    # The producer's collector may look between a forwarder's (or p2p peer's) move of the
    # cursor and its assignment of the slot: a slot seen then with no export was never listed
    # again, its export let go of the memory while the slot still used it (p2p_stress read
    # another registration's bytes through it).
    pool, counters = ProducerCounters(), ConsumerCounters()
    file, index = pool.allocate(export=42)
    counters.hold(file.handle, index, lambda: None)
    seen, assign = [], CounterFile.assign

    def look_then_assign(self, slot, export):
        seen.extend(pool.new_slots())
        assign(self, slot, export)

    monkeypatch.setattr(CounterFile, "assign", look_then_assign)
    forwarded = counters.forward(file.handle, index)
    monkeypatch.undo()
    seen.extend(pool.new_slots())
    assert seen == [(file, forwarded, 42)]
    counters.release(file.handle, index)
    counters.release_unopened(file.handle, forwarded)


def test_a_full_file_is_closed_once_nothing_tracks_its_slots():
    pool = ProducerCounters()
    slots = [pool.allocate(export=1) for _ in range(SLOTS_PER_FILE + 1)]
    assert pool.open_files() == 2
    full = slots[0][0]
    assert {file for file, _ in slots[:SLOTS_PER_FILE]} == {full}
    assert pool.new_slots() == []  # every slot of it is the producer's own
    full.listed = 1  # an export still tracks a slot of it
    pool.close_finished()
    assert pool.open_files() == 2
    full.listed = 0
    pool.close_finished()
    assert pool.open_files() == 1  # the current file stays for the next sends
    with pytest.raises(ValueError, match="closed|released"):
        full.counter.state(0)  # never a read of unmapped memory


@pytest.mark.parametrize("index", [-1, SLOTS_PER_FILE, "3", 1.0, True, None, [1]])
def test_out_of_range_offsets_are_refused(index):
    with pytest.raises(InvalidHandleError):
        check_index(index)


@pytest.mark.parametrize("handle", [None, [1, 2], "RCNT", 5])
def test_non_bytes_counter_handles_are_refused(handle):
    with pytest.raises(InvalidHandleError, match="bytes"):
        check_slot(handle, 0)


def test_a_forged_counter_handle_of_another_file_kind_is_refused():
    from devipc._core._memfd import SharedFile

    other = SharedFile(b"EVIL", 16 * SLOTS_PER_FILE + 64)  # right size, wrong kind
    try:
        forged = other.handle.replace(b"EVIL", b"RCNT", 1)
        with pytest.raises(InvalidHandleError):
            ConsumerCounters().hold(forged, 0, lambda: None)
    finally:
        other.close()
