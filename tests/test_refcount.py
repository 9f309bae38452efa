import _workers
import pytest
from _support import TIMEOUT

from devipc import InvalidHandleError
from devipc._refcount import SLOTS_PER_FILE, ConsumerCounters, ProducerCounters, check_index


def test_slot_starts_at_one_and_a_peer_release_brings_it_to_zero(children):
    pool = ProducerCounters()
    slot = pool.allocate()
    assert slot.value() == 1
    done = children.ctx.Queue()
    children.start(_workers.release_slot, slot.handle, slot.index, done)
    assert done.get(timeout=TIMEOUT) == "ok"
    children.join_ok()
    assert slot.value() == 0


def test_same_process_release_maps_nothing():
    pool = ProducerCounters()
    counters = ConsumerCounters(pool)
    slot = pool.allocate()
    counters.hold(slot.handle)
    assert counters.mapped_files() == 0
    counters.release(slot.handle, slot.index)
    assert slot.value() == 0
    counters.release(slot.handle, slot.index)  # never below zero
    assert slot.value() == 0


def test_a_full_file_is_closed_once_every_slot_is_freed():
    pool = ProducerCounters()
    slots = [pool.allocate() for _ in range(SLOTS_PER_FILE + 1)]
    assert pool.open_files() == 2
    assert len({s.handle for s in slots[:SLOTS_PER_FILE]}) == 1
    for slot in slots[:SLOTS_PER_FILE]:
        slot.free()
    assert pool.open_files() == 1
    slots[-1].free()
    assert pool.open_files() == 1  # the current file stays for the next sends


@pytest.mark.parametrize("index", [-1, SLOTS_PER_FILE, "3", 1.0])
def test_out_of_range_offsets_are_refused(index):
    with pytest.raises(InvalidHandleError):
        check_index(index)
