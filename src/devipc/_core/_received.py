"""Consumer: the producers' allocations this process opened, the storages it made of them, and
releases that wait for the device work this process queued on them.
"""

import bisect
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, cast

import torch

from ._devices import current_stream, synchronize
from ._hooks import IpcHooks, OpenedMemory
from ._memory import reap_freed, storage_key

_log = logging.getLogger("devipc")


IDLE_MAPPINGS = 8  # mappings kept open after their last storage died, at most...
IDLE_SECONDS = 1.0  # ...and for this long at most (the collector's rounds close them)


class OpenedAllocations:
    """The consumer's opened base allocations (the hooks' OpenedMemory): each opened once per
    process, closed with its last storage. Their address ranges are kept sorted per device type,
    so `contains` (asked by every first send) costs a bisection, not a scan of what is held.

    Where the hooks allow it (`reusable_mappings`), a mapping whose last storage died stays open
    a short while (`IDLE_MAPPINGS`, `IDLE_SECONDS`): a producer's caching allocator hands the
    same block, or another of the same segment, to its next tensor, and that open then maps
    nothing (a new batch every step would otherwise map and unmap a segment each time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # handle -> [OpenedMemory, live storages, whether it may idle]
        self._by_handle: dict[bytes, list] = {}
        self._idle: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # -> since
        self._ranges: dict[str, tuple[list[int], list[int]]] = {}  # device type -> starts, ends

    def acquire(self, hooks: IpcHooks, handle: bytes) -> OpenedMemory:
        with self._lock:
            entry = self._by_handle.get(handle)
            if entry is not None:
                if not entry[1]:
                    del self._idle[handle]
                entry[1] += 1
                return entry[0]
            reusable = getattr(hooks, "reusable_mappings", None)  # (hooks may be duck-typed)
            reusable = reusable is not None and bool(reusable())
            # Opening under the lock: two threads must not map the same allocation twice.
            memory = hooks.open_ipc_mem_handle(handle)
            self._by_handle[handle] = [memory, 1, reusable]
            starts, ends = self._ranges.setdefault(memory.device.type, ([], []))
            at = bisect.bisect_right(starts, memory.ptr)
            starts.insert(at, memory.ptr)
            ends.insert(at, memory.ptr + max(memory.size, 1))
            return memory

    def release(self, handle: bytes) -> None:
        with self._lock:
            entry = self._by_handle[handle]
            entry[1] -= 1
            if entry[1] > 0:
                return
            if not entry[2]:
                closing = [self._forget(handle)]
            else:
                self._idle[handle] = time.monotonic()
                closing = [
                    self._forget(self._idle.popitem(last=False)[0])
                    for _ in range(len(self._idle) - IDLE_MAPPINGS)
                ]
        _close(closing)

    def close_idle(self, older_than: float = 0.0) -> bool:
        """Close the mappings idle for longer than `older_than` seconds; whether some are still
        kept (the collector comes back for them)."""
        with self._lock:
            now, closing = time.monotonic(), []
            while self._idle:
                handle, since = next(iter(self._idle.items()))
                if now - since < older_than:
                    break
                del self._idle[handle]
                closing.append(self._forget(handle))
            kept = bool(self._idle)
        _close(closing)
        return kept

    def _forget(self, handle: bytes) -> OpenedMemory:
        """(Under the lock) the entry of `handle` gone; its mapping, for the caller to close."""
        memory = self._by_handle.pop(handle)[0]
        starts, ends = self._ranges[memory.device.type]
        at = bisect.bisect_left(starts, memory.ptr)  # live mappings never overlap
        del starts[at], ends[at]
        return memory

    def contains(self, device: torch.device, ptr: int) -> bool:
        with self._lock:
            ranges = self._ranges.get(device.type)
            if ranges is None:
                return False
            starts, ends = ranges
            at = bisect.bisect_right(starts, ptr) - 1
            return at >= 0 and ptr < ends[at]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_handle)

    def idle(self) -> int:
        """Mappings kept open with no storage on them (part of `len`)."""
        return len(self._idle)


def _close(memories: list[OpenedMemory]) -> None:
    """Close each mapping; the first failure is raised once all were tried."""
    failure = None
    for memory in memories:
        try:
            memory.close()
        except Exception as error:  # noqa: BLE001 - the others must still close
            failure = failure or error
    if failure is not None:
        raise failure


class Receipt(NamedTuple):
    """Where a received storage's memory came from: enough to forward it."""

    mem_handle: bytes
    offset: int  # bytes into the producer's allocation
    counter_handle: bytes
    slot: int


class ReceivedStorages:
    """Storages made of received memory, by (device, data_ptr, nbytes), while they live."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple, dict[Receipt, None]] = {}  # in the order received

    def add(self, key: tuple, receipt: Receipt) -> None:
        with self._lock:
            self._by_key.setdefault(key, {})[receipt] = None

    def forget(self, key: tuple, receipt: Receipt) -> None:
        with self._lock:
            receipts = self._by_key.get(key, {})
            receipts.pop(receipt, None)
            if not receipts:
                self._by_key.pop(key, None)

    def get(self, storage: torch.UntypedStorage) -> Receipt | None:
        """The receipt of a live storage: the newest of its key. An older one is a storage that
        died, not reaped yet: a receive of memory received here before finds that storage in
        torch's shared cache while it lives, so only its death lets a second one be made."""
        with self._lock:
            receipts = self._by_key.get(storage_key(storage))
            return next(reversed(receipts)) if receipts else None


class DeferredReleases:
    """Releases of received storages, in two steps. Once a storage died, `add` (from
    `reap_freed`, wherever it runs, the garbage collector included, so it takes no lock) notes
    what two streams have queued: the one that was current when the storage was received (the
    producer's event was waited on it; its users queue their work there), and the current
    stream of the thread that found the storage dead (usually the one that dropped it); `poll`
    (a collector round, an open, or `ipc_collect`) runs each release once that work is done. So
    the producer never frees memory this process still reads or writes, and no thread blocks for
    it (torch's CUDA consumer synchronizes its stream in the deleter instead)."""

    _SYNCHRONIZE = object()  # the stream could not be asked: wait for the device

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._added: collections.deque = collections.deque()  # appended by deleters
        self._waiting: list = []  # (events, device, release), work not done yet

    def add(self, stream: torch.Stream, release: Callable[[], None]) -> None:
        events: list = []
        device = stream.device
        try:
            here = current_stream(device)
            for queue in (stream,) if here == stream else (stream, here):
                if not queue.query():
                    event = torch.Event(device=queue.device)
                    event.record(queue)
                    events.append(event)
        except Exception:  # noqa: BLE001 - the stream cannot be asked (at interpreter shutdown)
            events = [self._SYNCHRONIZE]
        self._added.append((events, device, release))

    def keep_until(self, events: list[torch.Event], keep: object) -> None:
        """Keep `keep` alive until `events` completed: what device copies still read or write
        (a transfer dropped in flight). No lock, as `add`: a finalizer may call it."""
        self._added.append((events, events[0].device, lambda: keep))

    def poll(self, newest: int | None = None) -> bool:
        """Run the releases whose work is done; returns whether some are still waiting.
        `newest` bounds the look for storages that died (`reap_freed`)."""
        reap_freed(newest)  # storages that died since: their releases are added first
        with self._lock:
            while self._added:
                self._waiting.append(self._added.popleft())
            ready: list[tuple] = []
            waiting: list[tuple] = []
            for entry in self._waiting:  # no events: the streams were idle, done
                (ready if not entry[0] or self._done(*entry[:2]) else waiting).append(entry)
            self._waiting = waiting
        for _events, _device, release in ready:
            try:
                release()
            except Exception:  # noqa: BLE001 - every other release must still run
                _log.exception("devipc: releasing a received storage failed")
        return bool(waiting) or bool(self._added)

    def _done(self, events: list, device: torch.device) -> bool:
        for event in events:  # usually none: the streams were idle when the storage died
            if event is self._SYNCHRONIZE:
                synchronize(device)
                return True
            if not cast(torch.Event, event).query():
                return False
        return True

    def forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._added, self._waiting = collections.deque(), []

    def __len__(self) -> int:
        return len(self._waiting) + len(self._added)
