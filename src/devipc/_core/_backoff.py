"""Bounded waits: one way to poll for something that another thread or process will do, sleeping
between polls (a little at first, up to a ceiling) and giving up at a deadline."""

import time

SLICE = 0.01  # seconds: a wait that another thread's close() must end is made in slices of this
PACED_LONGEST = 0.02  # seconds: the longest pause of a paced wait


class Backoff:
    """The pauses of one wait. `expired()`: the deadline passed (`timeout` None: never); `pause()`
    sleeps: not at all for the first `spins` polls, then `first` seconds, doubling up to
    `longest`; with `pace`, at least that fraction of the wait so far (up to PACED_LONGEST), so
    that a long wait's polls cost little and its answer comes late by that fraction at most."""

    __slots__ = ("_deadline", "_spins", "_next", "_longest", "_pace", "_began")

    def __init__(
        self,
        timeout: float | None,
        first: float = 0.00002,
        longest: float = 0.001,
        spins: int = 0,
        pace: float = 0.0,
    ):
        self._began = time.monotonic()
        self._deadline = None if timeout is None else self._began + timeout
        self._spins, self._next, self._longest, self._pace = spins, first, longest, pace

    def expired(self) -> bool:
        return self._deadline is not None and time.monotonic() > self._deadline

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None without a deadline."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def pause(self) -> None:
        seconds = self.next_pause()
        if seconds:
            time.sleep(seconds)

    def next_pause(self) -> float:
        """How long the next pause is (0 while spinning), for a caller that sleeps its own way
        (an asyncio loop's `await asyncio.sleep`)."""
        if self._spins > 0:
            self._spins -= 1
            return 0.0
        seconds, self._next = self._next, min(self._next * 2, self._longest)
        if self._pace:
            waited = time.monotonic() - self._began
            seconds = max(seconds, min(PACED_LONGEST, waited * self._pace))
        return seconds


def polling(timeout: float | None = None, paced: bool = False) -> Backoff:
    """The pauses of a wait for what another host writes into memory read by one-sided reads
    (nothing wakes a process across hosts): 0.1 ms, doubling up to 2 ms; `paced` (a wait that
    may last, whose every poll costs both hosts a round trip), at least a hundredth of the
    wait so far."""
    return Backoff(timeout, first=0.0001, longest=0.002, pace=0.01 if paced else 0.0)
