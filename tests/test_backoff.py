"""Bounded waits: the deadline, the spins, and pauses that double up to their ceiling."""

import threading
import time
from types import SimpleNamespace

from devipc._core import _backoff
from devipc._core._backoff import Backoff


def test_no_deadline_never_expires_and_a_passed_one_does():
    assert not Backoff(None).expired() and Backoff(None).remaining() is None
    backoff = Backoff(0.001)
    assert 0 <= backoff.remaining() <= 0.001
    time.sleep(0.002)
    assert backoff.expired() and backoff.remaining() == 0.0


def test_spins_then_pauses_that_double_up_to_the_ceiling(monkeypatch):
    slept = []  # the pauses this thread asked for, not the clock: the machine may be busy
    mine = threading.get_ident()

    def sleep(seconds):
        (slept.append if threading.get_ident() == mine else time.sleep)(seconds)

    monkeypatch.setattr(_backoff, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    backoff = Backoff(None, first=0.001, longest=0.004, spins=3)
    for _ in range(3):
        backoff.pause()  # spins: no sleep
    assert slept == []
    for _ in range(4):
        backoff.pause()
    assert slept == [0.001, 0.002, 0.004, 0.004]


def test_a_paced_wait_pauses_a_fraction_of_the_wait_so_far_up_to_its_ceiling(monkeypatch):
    """A paced wait's pauses grow with the time waited (a hundredth of it for `polling`), so
    that a long wait polls rarely, never past PACED_LONGEST; an unpaced one keeps its ceiling."""
    now = [100.0]
    monkeypatch.setattr(_backoff, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=None))
    paced, plain = _backoff.polling(paced=True), _backoff.polling()
    assert paced.next_pause() == plain.next_pause() == 0.0001  # at first, as any wait
    now[0] += 0.5
    assert paced.next_pause() == 0.005 and plain.next_pause() == 0.0002
    now[0] += 60.0
    assert paced.next_pause() == _backoff.PACED_LONGEST and plain.next_pause() == 0.0004
