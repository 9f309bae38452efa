import ctypes
import threading

import _workers
import pytest
from _support import TIMEOUT, recv

from devipc._core import _lifeline
from devipc._core._memfd import SharedFile

OWNER_DIED = 0x40000000  # FUTEX_OWNER_DIED, which the kernel sets as the holder dies


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_the_word_holds_the_owner_id_while_it_lives_and_its_end_marks_it(children, how):
    shared = SharedFile(b"TEST", 4096)
    try:
        proc, conn = children.start_piped(_workers.hold_lifeline, shared.handle, how)
        tid = recv(conn)
        assert tid > 0 and tid != proc.pid  # a thread of its own, parked
        assert shared.buffer.words[0] & _lifeline.TID_MASK == tid
        conn.send("end")
        proc.join(TIMEOUT)
        assert proc.exitcode == (0 if how == "exit" else -9)
        word = shared.buffer.words[0]
        assert word & _lifeline.TID_MASK != tid
        assert word & OWNER_DIED
    finally:
        shared.close()


def test_where_it_cannot_be_held_hold_says_0_and_touches_nothing(monkeypatch):
    monkeypatch.setattr(_lifeline, "_SUPPORTED", False)
    buffer = ctypes.create_string_buffer(64)
    assert _lifeline.hold(ctypes.addressof(buffer)) == 0
    assert buffer.raw == bytes(64)


def test_a_mutex_larger_than_the_room_it_has_is_not_held(monkeypatch):
    """The C library's mutex must fit in RESERVED bytes, before what follows them in the page."""
    monkeypatch.setattr(_lifeline, "RESERVED", 8)  # less than any glibc mutex
    buffer = ctypes.create_string_buffer(64)
    threads = threading.active_count()
    assert _lifeline.hold(ctypes.addressof(buffer)) == 0
    assert threading.active_count() == threads  # no thread parked on it
    assert buffer.raw[8:16] == bytes(8)  # the check's mark is gone again
