"""Producer: exported memory, held until every consumer let go of it — the memory, not the
storage object that pointed at it when it was sent.

The first send of a storage swaps its DataPtr with that of an alias over the same bytes
(`_swap_data_ptr_`), as CUDA's sender swaps in its sent-data context: the alias (the export's
`owner`) now owns the allocation, and the producer's storage reaches the same bytes through a
DataPtr whose deleter keeps the owner alive. So whatever the producer does to its storage later
(resize_, set_, dropping it), the allocation lives until the storage stops pointing at it AND each
slot sent for it is released, revoked, or held by a process that died.
"""
import collections
import itertools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable

import torch

from ._memory import storage_from_memory, storage_key
from ._refcount import HELD, RELEASED, REVOKED, SENT, ProducerCounters, ProducerFile

LIMBO_WARN_BLOCKS = 1_000
_log = logging.getLogger("devipc")


class Export:
    """One exported allocation: its owner and the slots sent for it."""

    __slots__ = ("id", "owner", "slots", "aliased", "key")

    def __init__(self, export_id: int, key: tuple):
        self.id, self.key = export_id, key
        self.owner: torch.UntypedStorage | None = None
        self.slots: list[tuple[ProducerFile, int, float]] = []  # (file, index, sent at)
        self.aliased = True  # a producer storage still points at the allocation


class Exports:
    def __init__(self, wake: Callable[[], None]):
        """`wake` asks for a collection soon (the collector thread)."""
        self._wake = wake
        self._lock = threading.RLock()
        self._counters = ProducerCounters()
        self._ids = itertools.count(1)
        self._by_id: dict[int, Export] = {}  # every export whose owner we keep
        self._by_key: dict[tuple, Export] = {}  # (device, ptr, nbytes) of aliased storages
        self._active: dict[int, Export] = {}  # exports with slots
        self._held = 0  # slots listed in `_active`
        self._dropped: collections.deque[Export] = collections.deque()  # from deleters
        self._collect_at = 64  # amortizes collection over sends; grows with what is held
        self._warned = False
        self.deadline: float | None = None  # seconds an unopened send may wait
        os.register_at_fork(after_in_child=self._forget_after_fork)

    def send(self, storage: torch.UntypedStorage) -> tuple[ProducerFile, int]:
        """A slot for one more send of `storage`'s memory."""
        key = storage_key(storage)
        with self._lock:
            self._apply_dropped()
            export = self._by_key.get(key)
            if export is None:
                export = self._adopt(storage, key)
            file, index = self._counters.allocate(export.id)
            self._list(export, file, index, time.monotonic())
            crowded = self._held >= self._collect_at
        if crowded:
            self.collect()
        return file, index

    def _adopt(self, storage: torch.UntypedStorage, key: tuple) -> Export:
        export = Export(next(self._ids), key)
        # The deleter runs wherever the storage dies, the garbage collector included: it only
        # queues the export, and a collection takes it from there.
        alias = storage_from_memory(storage.data_ptr(), storage.nbytes(), storage.device,
                                    lambda: (self._dropped.append(export), self._wake()))
        storage._swap_data_ptr_(alias)  # the alias now owns the allocation, `storage` aliases it
        export.owner = alias
        self._by_id[export.id] = export
        self._by_key[key] = export
        return export

    def _list(self, export: Export, file: ProducerFile, index: int, sent_at: float) -> None:
        export.slots.append((file, index, sent_at))
        file.listed += 1
        self._held += 1
        self._active[export.id] = export

    def _apply_dropped(self) -> None:
        """Producer storages that stopped pointing at their exports (call with the lock)."""
        while self._dropped:
            export = self._dropped.popleft()
            export.aliased = False
            if self._by_key.get(export.key) is export:
                del self._by_key[export.key]

    def collect(self) -> int:
        """Let go of what consumers released or cannot use any more; returns how many sends."""
        now = time.monotonic()
        ended, finished = 0, []
        with self._lock:
            self._apply_dropped()
            for export in list(self._active.values()):
                live = [slot for slot in export.slots if self._still_needed(*slot, now)]
                for file, _, _ in export.slots:
                    file.listed -= 1
                for file, _, _ in live:
                    file.listed += 1
                ended += len(export.slots) - len(live)
                self._held -= len(export.slots) - len(live)
                export.slots = live
                if not live:
                    del self._active[export.id]
            # Forwarded sends, read after the states above: a forwarder takes its new slot
            # before it releases its own, so an export seen released here is seen again.
            for file, index, export_id in self._counters.new_slots():
                export = self._by_id.get(export_id)
                if export is not None:
                    self._list(export, file, index, now)
                else:
                    _log.warning("devipc: a forwarded send names export %d, which is gone; its "
                                 "slot %d is ignored", export_id, index)
            for export in list(self._by_id.values()):
                if not export.slots and not export.aliased:
                    del self._by_id[export.id]
                    finished.append(export)
            self._counters.close_finished()
            held = self._held
            self._collect_at = max(64, 2 * held)
            warn = held > LIMBO_WARN_BLOCKS and not self._warned
            self._warned = held > LIMBO_WARN_BLOCKS
        for export in finished:
            export.owner = None  # frees the allocation, outside the lock
        if warn:
            warnings.warn(f"devipc: {held} sends are still held by consumers; their memory stays "
                          f"allocated until the consumers drop the tensors they received",
                          ResourceWarning, stacklevel=3)
        return ended

    def _still_needed(self, file: ProducerFile, index: int, sent_at: float, now: float) -> bool:
        counter = file.counter
        state = counter.state(index)
        if state == HELD:
            return not counter.reclaim_if_holder_died(index)
        if state == SENT:
            expired = self.deadline is not None and now - sent_at > self.deadline
            return not (expired and counter.revoke(index))
        return state not in (RELEASED, REVOKED)

    def revoke(self, storage: torch.UntypedStorage) -> int:
        """Take back every unopened send of `storage`'s memory; returns how many."""
        key = storage_key(storage)
        with self._lock:
            export = self._by_key.get(key)
            slots = [] if export is None else list(export.slots)
            revoked = sum(file.counter.state(index) == SENT and file.counter.revoke(index)
                          for file, index, _ in slots)
        if revoked:
            self.collect()
        return revoked

    def revoke_slot(self, counter_handle: bytes, index: int) -> bool:
        """Take back one unopened send, named by its counter file and slot; whether it was.
        Only the producer that owns the file can: elsewhere (or for an opened send) False."""
        file = self._counters.file(counter_handle)
        revoked = file is not None and file.counter.state(index) == SENT \
            and file.counter.revoke(index)
        if revoked:
            self.collect()
        return revoked

    def unopened(self, counter_handle: bytes, index: int) -> bool:
        """Whether the send named by (counter handle, slot) is ours and may still be opened."""
        file = self._counters.file(counter_handle)
        return file is not None and file.counter.state(index) == SENT

    def pending(self) -> bool:
        """Whether a later collection may still free something."""
        return bool(self._active) or bool(self._dropped)

    def stats(self) -> dict:
        with self._lock:
            return {"exports": len(self._by_id), "sent": self._held,
                    "counter_files": self._counters.open_files()}

    def _forget_after_fork(self) -> None:
        """A forked child sent nothing: its parent's exports and files are not its own."""
        self._lock = threading.RLock()
        self._counters.forget_after_fork()
        self._by_id, self._by_key, self._active = {}, {}, {}
        self._held = 0
        self._dropped = collections.deque()
