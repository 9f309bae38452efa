"""One daemon thread per process that runs devipc's periodic work while there is some: the
producer's collection (dead consumers, deadlines) and the consumer's releases that wait for
device work. It exits when nothing is pending and is started again by `wake`.

At interpreter exit nothing is started any more: a thread started while Python finalizes never
runs, and `threading.Thread.start` would wait for it forever (storages freed at shutdown wake the
collector). Threads are started without waiting for them to run, for the same reason. What the
collector would have freed goes with the process; consumers keep their mappings valid.
"""

import _thread
import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

_log = logging.getLogger("devipc")
INTERVAL = 0.2  # seconds between rounds while work is pending, at least
SHARE = 0.05  # of the time, at most, that rounds take


class Background:
    def __init__(
        self,
        name: str,
        round_: Callable[[], bool],
        interval: float = INTERVAL,
        share: float | None = SHARE,
    ):
        """`round_` does one round of work and says whether more is pending; rounds are
        `interval` seconds apart at least, and spaced out to take at most `share` of the time
        (None: never spaced out, for rounds that wait on others' work rather than do their
        own)."""
        self._name, self._round = name, round_
        self._interval, self._share = interval, share
        self._lock = threading.RLock()  # `wake` may run in a finalizer, inside `wake`
        self._stop = threading.Event()
        self._running = False
        self._kicked = False
        self._exiting = False
        os.register_at_fork(after_in_child=self._forget_thread)
        atexit.register(self._stop_at_exit)

    def wake(self) -> None:
        """Make sure a thread runs rounds until nothing is pending. Called at every send and
        receive: while the thread runs, two stores and a load, no lock. The thread marks
        itself stopped before it looks at `_kicked` for the last time, so a wake that still saw
        it running is seen by that look."""
        self._kicked = True
        if self._running:
            return
        with self._lock:
            self._kicked = True
            if self._running or self._exiting or sys.is_finalizing():
                return
            self._running = True
        try:
            _thread.start_new_thread(self._loop, ())
        except RuntimeError:  # "can't start new thread": the next wake tries again
            with self._lock:
                self._running = False

    def running(self) -> bool:
        """Whether a thread runs rounds now: not once stopped at exit, nor when starting it
        failed. Those waiting on a round's effect do the work themselves when it does not."""
        return self._running and not self._exiting

    def _loop(self) -> None:
        pause = self._interval
        while not self._stop.wait(pause):
            started = time.monotonic()
            try:
                more = self._round()
            except Exception:  # noqa: BLE001 - keep the thread alive; the next round retries
                _log.exception("devipc: a round of %s failed; retrying", self._name)
                more = True
            # A round looks at every send and received storage: with thousands held it costs
            # milliseconds, so rounds space out to keep within SHARE of the time.
            pause = (
                self._interval
                if self._share is None
                else max(self._interval, (time.monotonic() - started) / self._share)
            )
            with self._lock:
                if not more:
                    self._running = False  # before the look at `_kicked`: see `wake`
                    if not self._kicked:
                        return
                    self._running = True
                self._kicked = False

    def _stop_at_exit(self) -> None:
        with self._lock:
            self._exiting = True
        self._stop.set()

    def _forget_thread(self) -> None:
        self._lock = threading.RLock()  # a forked child has no thread, and maybe a held lock
        self._running = False
        self._kicked = False
