"""Bounded waits: the deadline, the spins, and pauses that double up to their ceiling."""
import time

from devipc._backoff import Backoff


def test_no_deadline_never_expires_and_a_passed_one_does():
    assert not Backoff(None).expired() and Backoff(None).remaining() is None
    backoff = Backoff(0.001)
    assert 0 <= backoff.remaining() <= 0.001
    time.sleep(0.002)
    assert backoff.expired() and backoff.remaining() == 0.0


def test_spins_then_pauses_that_double_up_to_the_ceiling():
    backoff = Backoff(None, first=0.001, longest=0.004, spins=3)
    started = time.monotonic()
    for _ in range(3):
        backoff.pause()  # spins: no sleep
    spun = time.monotonic() - started
    for _ in range(4):
        backoff.pause()  # 1 + 2 + 4 + 4 ms
    slept = time.monotonic() - started - spun
    assert spun < 0.001 and 0.011 <= slept < 0.5
