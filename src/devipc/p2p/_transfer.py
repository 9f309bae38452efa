"""A transfer in flight: device copies end with events recorded on the streams they were queued
on, host copies with a future of a small thread pool, network ones with the transport's handle.
"""

import concurrent.futures
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from .._core._backoff import Backoff
from .._core._devices import current_stream
from .._core._sharing import keep_until_done

__all__ = ["DONE", "Transfer", "run_on_host"]

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def run_on_host(function: Callable[[], object]) -> concurrent.futures.Future:
    """Run host copies off the caller's thread (a pool of two, made on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="devipc-p2p")
        return _pool.submit(function)


class _Waitable(Protocol):
    """A transport's handle of its requests in flight (`Transfer(handle=...)`)."""

    def done(self) -> bool: ...

    def wait(self, timeout: float | None) -> None: ...


class Transfer:
    """One read or write (or a vector of them) in flight. `done()` says whether it finished;
    `wait(timeout)` returns when it did, raises what it failed with, or TimeoutError."""

    __slots__ = ("_events", "_future", "_handle", "_keep", "_finished")

    def __init__(
        self,
        events: Iterable[torch.Event] = (),
        future: concurrent.futures.Future | None = None,
        handle: _Waitable | None = None,
        keep: tuple[object, ...] = (),
        finished: bool = False,
    ):
        self._events = list(events)  # torch.Event per device stream the copies were queued on
        self._future = future  # host copies
        self._handle = handle  # a transport's object with done() / wait(timeout)
        self._keep = keep  # what must outlive the copies (remote views, pinned mappings)
        self._finished = finished  # True: done when made (copies the calling thread made)

    def __del__(self) -> None:
        # Dropped in flight: what its copies read and write (a peer's mapping, the local
        # tensors) stays until they ran, on whichever streams they were queued.
        if not self._finished and self._events and self._keep and not sys.is_finalizing():
            keep_until_done(self._events, self._keep)  # at exit, all goes with the process

    def done(self) -> bool:
        if self._finished:
            return True
        if self._future is not None and not self._future.done():
            return False
        if self._handle is not None and not self._handle.done():
            return False
        if not all(event.query() for event in self._events):
            return False
        self._finish()
        return True

    def wait(self, timeout: float | None = None) -> None:
        if self._finished and self._future is None and (timeout is None or timeout >= 0):
            return
        if timeout is not None and not timeout >= 0:
            raise ValueError(
                f"timeout is a non-negative number of seconds or None, got {timeout!r}"
            )
        backoff = Backoff(timeout)
        if self._future is not None:
            try:
                self._future.result(timeout)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"the transfer did not finish within {timeout} s") from None
        if self._handle is not None:
            self._handle.wait(backoff.remaining())
        for event in self._events:
            if timeout is None:
                event.synchronize()
                continue
            while not event.query():
                if backoff.expired():
                    raise TimeoutError(f"the transfer did not finish within {timeout} s")
                backoff.pause()
        self._finish()

    def _finish(self) -> None:
        self._finished = True
        self._keep = ()
        if self._future is not None:
            self._future.result()  # raises what the host copy raised (wait, and done once)

    def __repr__(self) -> str:
        return f"<devipc.p2p.Transfer {'done' if self.done() else 'in flight'}>"


DONE = Transfer(finished=True)  # what a synchronous call that finished in its thread returns


def record_events(devices: Iterable[torch.device]) -> list:
    """An event on the current stream of each (non-CPU) device."""
    events = []
    for device in devices:
        event = torch.Event(device=device)
        event.record(current_stream(device))
        events.append(event)
    return events
