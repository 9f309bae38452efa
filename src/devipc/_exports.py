"""Producer: exported memory, held until every consumer let go of it — the memory, not the
storage object that pointed at it when it was sent.

The first send of a storage swaps its DataPtr with that of an alias over the same bytes
(`_swap_data_ptr_`), as CUDA's sender swaps in its sent-data context: the alias (the export's
`owner`) now owns the allocation, and the producer's storage reaches the same bytes through a
DataPtr whose deleter keeps the owner alive. So whatever the producer does to its storage later
(resize_, set_, dropping it), the allocation lives until the storage stops pointing at it AND each
slot sent for it is released, revoked, or held by a process that died.
"""
import itertools
import threading
import time
import warnings

import torch

from ._memory import storage_from_memory
from ._refcount import HELD, RELEASED, REVOKED, SENT, ProducerCounters, ProducerFile

LIMBO_WARN_BLOCKS = 1_000


class Export:
    """One exported allocation: its owner and the slots sent for it."""

    __slots__ = ("id", "owner", "slots", "aliased", "key")

    def __init__(self, export_id: int, key: tuple):
        self.id, self.key = export_id, key
        self.owner: torch.UntypedStorage | None = None
        self.slots: list[tuple[ProducerFile, int, float]] = []  # (file, index, sent at)
        self.aliased = True  # a producer storage still points at the allocation


class Exports:
    def __init__(self):
        self._lock = threading.RLock()  # a storage's deleter may run while we hold it
        self._counters = ProducerCounters()
        self._ids = itertools.count(1)
        self._by_id: dict[int, Export] = {}
        self._by_key: dict[tuple, Export] = {}  # (device, ptr, nbytes) of aliased storages
        self._collect_at = 64  # amortizes collection over sends; grows with what is held
        self._warned = False
        self.deadline: float | None = None  # seconds an unopened send may wait

    def send(self, storage: torch.UntypedStorage) -> tuple[ProducerFile, int]:
        """A slot for one more send of `storage`'s memory."""
        key = (str(storage.device), storage.data_ptr(), storage.nbytes())
        with self._lock:
            export = self._by_key.get(key)
            if export is None:
                export = self._adopt(storage, key)
            file, index = self._counters.allocate(export.id)
            export.slots.append((file, index, time.monotonic()))
            crowded = self.held_slots() >= self._collect_at
        if crowded:
            self.collect()
        return file, index

    def _adopt(self, storage: torch.UntypedStorage, key: tuple) -> Export:
        export = Export(next(self._ids), key)
        alias = storage_from_memory(storage.data_ptr(), storage.nbytes(), storage.device,
                                    lambda: self._alias_dropped(export))
        storage._swap_data_ptr_(alias)  # the alias now owns the allocation, `storage` aliases it
        export.owner = alias
        self._by_id[export.id] = export
        self._by_key[key] = export
        return export

    def _alias_dropped(self, export: Export) -> None:
        with self._lock:
            export.aliased = False
            if self._by_key.get(export.key) is export:
                del self._by_key[export.key]
            if not export.slots:
                self._by_id.pop(export.id, None)

    def collect(self) -> int:
        """Let go of what consumers released or cannot use any more; returns how many sends."""
        now = time.monotonic()
        finished, ended = [], 0
        with self._lock:
            for file, index, export_id in self._counters.new_slots():  # forwarded sends
                export = self._by_id.get(export_id)
                if export is not None:
                    export.slots.append((file, index, now))
            for export in list(self._by_id.values()):
                live = [s for s in export.slots if self._still_needed(*s, now)]
                ended += len(export.slots) - len(live)
                export.slots = live
                if not live and not export.aliased:
                    del self._by_id[export.id]
                    finished.append(export)
            held = self.held_slots()
            self._collect_at = max(64, 2 * held)
            warn = held > LIMBO_WARN_BLOCKS and not self._warned
            self._warned = held > LIMBO_WARN_BLOCKS
        for export in finished:
            export.owner = None  # frees the allocation, outside the lock
        self._counters.close_finished()
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
        key = (str(storage.device), storage.data_ptr(), storage.nbytes())
        with self._lock:
            export = self._by_key.get(key)
            slots = [] if export is None else list(export.slots)
        revoked = sum(file.counter.state(index) == SENT and file.counter.revoke(index)
                      for file, index, _ in slots)
        if revoked:
            self.collect()
        return revoked

    def held_slots(self) -> int:
        with self._lock:
            return sum(len(export.slots) for export in self._by_id.values())

    def pending(self) -> bool:
        """Whether a later collection may still free something."""
        with self._lock:
            return any(export.slots for export in self._by_id.values())

    def stats(self) -> dict:
        with self._lock:
            return {"exports": len(self._by_id), "sent": self.held_slots(),
                    "counter_files": self._counters.open_files()}
