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
