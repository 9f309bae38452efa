"""The kit's other processes: spawned peers that run tasks of `_tasks` on request (a task is a
module-level function of it, sent by reference: it pickles as its module and name).

Requests and replies travel through torch.multiprocessing Queues, so every tensor in them crosses
the way users' tensors do (pickled by devipc's reducers in the feeder thread). Every wait is
bounded; a peer that does not answer in time, or died, is killed and the check fails naming the
task. One long-lived peer serves most checks; checks that kill a peer or let it exit take a fresh
one, started ahead with the first so that their imports overlap.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing

from . import _device

START_TIMEOUT = 120.0  # a fresh interpreter imports torch and the device: seconds, not minutes
POLL = 0.05  # how often a waiting side looks whether the other side is still alive


class PeerError(Exception):
    """A peer's task raised, or the peer died or did not answer: the message says which."""


def serve(requests: Any, replies: Any, modules: list[str]) -> None:
    """The peer's loop: (number, task, args) in, (number, "ok", value) or (number,
    "error", text) out, number 0 its start; None ends it. It ends by itself when the kit's
    process is gone."""
    try:
        _device.load(modules)
        replies.put((0, "ok", os.getpid()))
    except Exception:  # noqa: BLE001 - sent to the kit's process, with its traceback
        replies.put((0, "error", traceback.format_exc(limit=4)))
        return
    parent = multiprocessing.parent_process()
    while True:
        try:
            request = requests.get(timeout=1.0)
        except queue.Empty:
            if parent is None or not parent.is_alive():
                return
            continue
        except Exception as error:  # noqa: BLE001
            # the request itself did not unpickle (a refused handle)
            replies.put((None, "error", f"receiving the request: {type(error).__name__}: {error}"))
            continue
        if request is None:
            return
        number, task, args = request
        try:
            replies.put((number, "ok", task(*args)))
        except Exception as error:  # noqa: BLE001 - sent to the kit's process, as the task's answer
            replies.put((number, "error", f"{type(error).__name__}: {error}"))


class Peer:
    """One spawned peer, seen from the kit's process."""

    def __init__(self, modules: list[str]):
        ctx = torch.multiprocessing.get_context("spawn")
        self.requests, self.replies = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=serve,
            args=(self.requests, self.replies, modules),
            name="devipc-conformance-peer",
            daemon=True,
        )
        self.process.start()
        # request numbers: sent, answered (the reply taken), seen (the newest reply read)
        self._sent = self._answered = self._seen = 0  # 0 is the peer's start

    def call(self, task: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
        """Run `task(*args)` in the peer; its value, or PeerError."""
        return self.reply(task, timeout, self.send(task, *args))

    def send(self, task: Callable[..., Any], *args: Any) -> int:
        """Queue `task(*args)` without waiting; its number, for `reply`."""
        self._await_start()
        self._sent += 1
        self.requests.put((self._sent, task, args))
        return self._sent

    def reply(
        self, task: Callable[..., Any], timeout: float = 30.0, number: int | None = None
    ) -> Any:
        """The value of request `number` (default: the oldest not answered yet). Replies to
        earlier requests that a failed check left unread are dropped."""
        return self._reply(task.__name__, timeout, self._answered + 1 if number is None else number)

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL, then reap; the queues never wait for a reader that is gone."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        for channel in (self.requests, self.replies):
            channel.cancel_join_thread()
            channel.close()

    def close(self, timeout: float = 10.0) -> None:
        """Ask it to end, and kill it if it does not within `timeout`."""
        if self.process.is_alive():
            self.requests.put(None)
            self.process.join(timeout)
        self.kill()

    def _await_start(self) -> None:
        if not self._answered and not self._sent:
            self._reply(
                "starting (importing torch, the device and --hooks-module)", START_TIMEOUT, 0
            )

    def _reply(self, what: str, timeout: float, number: int) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                answered, status, value = self.replies.get(timeout=POLL)
            except queue.Empty:
                if not self.process.is_alive():
                    code = self.process.exitcode
                    self.kill()
                    raise PeerError(f"the peer died (exit code {code}) during {what}") from None
                if time.monotonic() > deadline:
                    self.kill()
                    raise PeerError(
                        f"the peer did not finish {what} within {timeout:g} s (killed)"
                    ) from None
                continue
            except Exception as error:  # noqa: BLE001 - a reply the kit's process could not open
                self._answered = self._seen = max(self._seen, number)
                raise PeerError(
                    f"receiving the reply to {what}: {type(error).__name__}: {error}"
                ) from None
            # a request that did not unpickle has no number: it is the one after the last seen
            self._seen = answered = self._seen + 1 if answered is None else answered
            if answered >= number:
                break
        self._answered = number
        if status == "error" or answered != number:
            raise PeerError(f"in the peer, {what} raised {value}")
        return value


class Peers:
    """The long-lived peer and the fresh ones, all started at once, all ended by `close`."""

    def __init__(self, modules: list[str], fresh: int):
        self._modules = modules
        self._main: Peer | None = None
        self._all: list[Peer] = []
        self._spares = [self._start() for _ in range(fresh)]
        self._main = self._start()

    def main(self) -> Peer:
        """The shared peer; a new one if the last died or was killed."""
        if self._main is None or not self._main.alive():
            self._main = self._start()
        return self._main

    def fresh(self) -> Peer:
        """A peer of the caller's own, to kill or let exit."""
        while self._spares:
            spare = self._spares.pop()
            if spare.alive():  # not killed with the others after a check hung
                return spare
        return self._start()

    def kill_all(self) -> None:
        for peer in self._all:
            peer.kill()

    def close(self) -> None:
        for peer in self._all:
            peer.close()

    def _start(self) -> Peer:
        peer = Peer(self._modules)
        self._all.append(peer)
        return peer
