"""Producer: exported memory, held until every consumer let go of it — the memory, not the
storage object that pointed at it when it was sent.

The first send of a storage swaps its DataPtr with that of an alias over the same bytes
(`_swap_data_ptr_`), as CUDA's sender swaps in its sent-data context: the alias (the export's
`owner`) now owns the allocation, and the producer's storage reaches the same bytes through a
DataPtr whose deleter keeps the owner alive (the device's optional `make_resizable` hook gives the
storage its allocator back, so it stays resizable as a CUDA storage does). So whatever the
producer does to its storage later (resize_, set_, dropping it), the allocation lives until the
storage stops pointing at it AND each slot sent for it is released, revoked, or held by a process
that died AND every `hold` on it (a p2p registration) ended.

This is the one rule of every path that lets a peer reach memory (queue, typed handle, bucket,
arena, p2p on either transport): memory a peer may reach never returns to the allocator, or to
another tensor, while the peer may reach it. A hold also learns when its storage stops pointing
at the allocation (`on_moved`), so that what advertised it can stop advertising it.
"""

import collections
import ctypes
import itertools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable

import torch

from ._hooks import hooks_for
from ._memory import aliasing_storage, lives, reap_freed, storage_key
from ._refcount import HELD, RELEASED, REVOKED, SENT, SLOTS_PER_FILE, ProducerCounters, ProducerFile

LIMBO_WARN_BLOCKS = 1_000
NEWEST = 8  # exports whose slots a new send looks at (`_end_newest`): a pipeline's depth
_log = logging.getLogger("devipc")


class Export:
    """One exported allocation: its owner, the slots sent for it, the holds on it."""

    __slots__ = ("id", "owner", "slots", "aliased", "key", "holds", "wire", "mark")

    def __init__(self, export_id: int, key: tuple):
        self.id, self.key = export_id, key
        self.owner: torch.UntypedStorage | None = None
        self.slots: list[tuple[ProducerFile, int, float]] = []  # (file, index, sent at)
        self.aliased = True  # a producer storage still points at the allocation
        self.holds: list[Hold] = []
        self.wire: tuple[bytes, int] | None = None  # (the hooks' handle, offset) once sent
        self.mark: ctypes.Array | None = None  # `lives(mark)` while a producer storage aliases

    def finished(self) -> bool:
        return not self.slots and not self.aliased and not self.holds


class Hold:
    """Keeps an export's allocation alive until `release`; `on_moved()` runs once (from a devipc
    call or the collector thread, never inside a deleter) when the storage held stops pointing
    at the allocation."""

    __slots__ = ("export", "on_moved")

    def __init__(self, export: Export, on_moved: Callable[[], object]):
        self.export, self.on_moved = export, on_moved


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
        self._moved: list[Hold] = []  # holds whose storage moved, to tell outside the lock
        self._collect_at = 64  # amortizes collection over sends; grows with what is held
        self._unopened = (0, 0.0)  # at the last collection: sends never opened, the oldest's time
        self._warned = {"unopened": False, "held": False}  # warned once until back under
        self.deadline: float | None = None  # seconds an unopened send may wait
        os.register_at_fork(after_in_child=self._forget_after_fork)

    def send(
        self,
        storage: torch.UntypedStorage,
        wire: tuple[bytes, int],
    ) -> tuple[ProducerFile, int]:
        """A slot for one more send of `storage`'s memory, which the hooks named `wire`."""
        key = storage_key(storage)
        self._reap_if_died(key)
        with self._lock:
            finished = self._apply_dropped() + self._end_newest()
            export = self._export_of(storage, key)
            export.wire = wire
            file, index = self._take(export)
            crowded = self._held >= self._collect_at
        self._let_go(finished)
        if crowded:
            self.collect()
        return file, index

    def send_again(
        self,
        storage: torch.UntypedStorage,
    ) -> tuple[ProducerFile, int, tuple[bytes, int]] | None:
        """The common case at its cost floor: a slot for memory sent before, and its `wire`; None
        when it was not, or when the storage that was sent died (`reap_freed` has not run: the
        memory at this address may be another allocation), for `send` to see to."""
        key = storage_key(storage)
        with self._lock:
            export = self._by_key.get(key)
            if (
                export is None
                or export.wire is None
                or export.mark is None
                or not lives(export.mark)
            ):
                return None
            file, index = self._take(export)
            crowded = self._held >= self._collect_at
        if crowded:
            self.collect()
        return file, index, export.wire

    def _take(self, export: Export) -> tuple[ProducerFile, int]:
        file, index = self._counters.allocate(export.id)
        self._list(export, file, index, time.monotonic())
        return file, index

    def hold(self, storage: torch.UntypedStorage, on_moved: Callable[[], object]) -> Hold:
        """Keep `storage`'s allocation alive until `release(hold)`, whatever becomes of the
        storage; `on_moved` as in `Hold`."""
        key = storage_key(storage)
        self._reap_if_died(key)
        with self._lock:
            finished = self._apply_dropped()
            export = self._export_of(storage, key)
            hold = Hold(export, on_moved)
            export.holds.append(hold)
        self._let_go(finished)
        return hold

    def release(self, hold: Hold) -> None:
        """End a hold; the allocation goes now if nothing else keeps it."""
        with self._lock:
            export = hold.export
            if hold in export.holds:
                export.holds.remove(hold)
            if hold in self._moved:
                self._moved.remove(hold)
            finished = self._apply_dropped(export)
        self._let_go(finished)

    def _reap_if_died(self, key: tuple) -> None:
        """An export of this key whose storage died (its deleter ran, `reap_freed` has not) must
        not be taken for a new storage at the same address: reap first. Only then: a scan of
        every storage would cost a send in proportion to what the process exported."""
        export = self._by_key.get(key)
        if export is not None and (export.mark is None or not lives(export.mark)):
            reap_freed()

    def _export_of(self, storage: torch.UntypedStorage, key: tuple) -> Export:
        export = self._by_key.get(key)
        return export if export is not None else self._adopt(storage, key)

    def _adopt(self, storage: torch.UntypedStorage, key: tuple) -> Export:
        export = Export(next(self._ids), key)

        def dropped() -> None:
            """The deleter: it runs wherever the storage dies, the garbage collector included,
            so it only queues the export; a collection takes it from there."""
            self._dropped.append(export)
            self._wake()

        alias, export.mark = aliasing_storage(
            storage.data_ptr(), storage.nbytes(), storage.device, dropped
        )
        self._wake()  # the collector's rounds see the alias die (`_memory.reap_freed`)
        # The alias now owns the allocation, `storage` aliases it.
        storage._swap_data_ptr_(alias)  # type: ignore[attr-defined]
        export.owner = alias
        hooks_for(storage.device).make_resizable(storage)
        self._by_id[export.id] = export
        self._by_key[key] = export
        return export

    def _list(self, export: Export, file: ProducerFile, index: int, sent_at: float) -> None:
        export.slots.append((file, index, sent_at))
        file.listed += 1
        self._held += 1
        self._active[export.id] = export

    def _list_new_slots(self, now: float) -> None:
        """List the slots others took in our files since the last look (call with the lock):
        forwarders, and p2p peers that take a slot of an export they were told of."""
        for file, index, export_id in self._counters.new_slots():
            export = self._by_id.get(export_id)
            if export is not None:
                self._list(export, file, index, now)
            else:  # a p2p peer that took its slot as the registration ended: it lets go
                _log.debug(
                    "devipc: a slot taken for export %d, which is gone, is ignored (slot %d)",
                    export_id,
                    index,
                )

    def _apply_dropped(self, *also: Export) -> list[Export]:
        """Producer storages that stopped pointing at their exports (call with the lock); the
        exports (of those and `also`) that nothing keeps any more, for `_let_go`."""
        candidates = list(also)
        while self._dropped:
            export = self._dropped.popleft()
            export.aliased = False
            if self._by_key.get(export.key) is export:
                del self._by_key[export.key]
            self._moved.extend(export.holds)
            candidates.append(export)
        if not any(export.finished() for export in candidates):
            return []
        self._list_new_slots(time.monotonic())  # a slot a peer just took keeps its export
        return [
            export
            for export in candidates
            if export.finished() and self._by_id.pop(export.id, None) is export
        ]

    def _let_go(self, finished: list[Export]) -> None:
        """Outside the lock: tell the holds whose storage moved, free what nothing keeps."""
        for export in finished:
            export.owner = None  # frees the allocation
        while True:
            with self._lock:
                if not self._moved:
                    return
                hold = self._moved.pop(0)
            try:
                hold.on_moved()
            except Exception:  # noqa: BLE001 - every hold must hear it
                _log.exception("devipc: a hold's on_moved failed")

    def collect(self) -> int:
        """Let go of what consumers released or cannot use any more; returns how many sends."""
        reap_freed()  # storages that died since: their exports are queued first
        now = time.monotonic()
        ended, finished = 0, []
        unopened, oldest = 0, now
        with self._lock:
            finished = self._apply_dropped()
            for export in list(self._active.values()):
                gone, waiting, since = self._prune(export, now)
                ended, unopened, oldest = ended + gone, unopened + waiting, min(oldest, since)
            # Forwarded sends, read after the states above: a forwarder takes its new slot
            # before it releases its own, so an export seen released here is seen again.
            self._list_new_slots(now)
            for export in list(self._by_id.values()):
                if export.finished():
                    del self._by_id[export.id]
                    finished.append(export)
            self._counters.close_finished()
            self._collect_at = max(64, 2 * self._held)
            self._unopened = (unopened, oldest)
            opened = self._held - unopened
            warn_unopened = self._crossed("unopened", unopened)
            warn_held = self._crossed("held", opened)
        self._let_go(finished)
        if warn_unopened:
            # visible by default: the usual cause is a producer whose consumer never came
            warnings.warn(
                f"devipc: {unopened} sends were never opened by a consumer (the oldest "
                f"{now - oldest:.0f} s ago); their memory stays allocated until a "
                f"consumer opens and drops them. Take them back with "
                f"devipc.revoke(storage), or have devipc do it after a while with "
                f"devipc.set_unopened_deadline(seconds)",
                UserWarning,
                stacklevel=3,
            )
        if warn_held:
            warnings.warn(
                f"devipc: {opened} sends are held by consumers that opened them; their "
                f"memory stays allocated until the consumers drop the tensors they "
                f"received",
                ResourceWarning,
                stacklevel=3,
            )
        return ended

    def _prune(
        self,
        export: Export,
        now: float,
        thorough: bool = True,
    ) -> tuple[int, int, float]:
        """(Under the lock) drop the slots of `export` that ended: how many, and of those left
        how many were never opened and when the oldest of them was sent (`now` if none). Not
        `thorough`: only slots released or revoked, a load each (a dead holder, a deadline
        passed, cost a lock probe: the collection looks for those)."""
        live, unopened, oldest = [], 0, now
        for slot in export.slots:
            if thorough:
                state = self._live_state(*slot, now)
            else:
                state = slot[0].counter.state(slot[1])
                state = None if state in (RELEASED, REVOKED) else state
            if state is None:
                slot[0].listed -= 1
                continue
            live.append(slot)
            if state == SENT:
                unopened, oldest = unopened + 1, min(oldest, slot[2])
        ended = len(export.slots) - len(live)
        self._held -= ended
        export.slots = live
        if not live:
            del self._active[export.id]
        return ended, unopened, oldest

    def _end_newest(self) -> list[Export]:
        """(Under the lock) the sends of the `NEWEST` exports sent last that ended, dropped, and
        those exports if nothing keeps them any more: a new tensor sent every step (a batch, an
        activation) gives its memory back within a few sends, not at the next collection, after
        `_collect_at` sends that could each be a large allocation."""
        now = time.monotonic()
        newest = list(itertools.islice(reversed(self._active.values()), NEWEST))
        for export in newest:
            self._prune(export, now, thorough=False)
        if not any(export.finished() for export in newest):
            return []
        self._list_new_slots(now)  # a slot a peer just took keeps its export
        return [
            export
            for export in newest
            if export.finished() and self._by_id.pop(export.id, None) is export
        ]

    def _crossed(self, what: str, count: int) -> bool:
        """Whether `count` just went past the warning threshold (once until it falls back)."""
        over = count > LIMBO_WARN_BLOCKS
        crossed = over and not self._warned[what]
        self._warned[what] = over
        return crossed

    def _live_state(self, file: ProducerFile, index: int, sent_at: float, now: float) -> int | None:
        """The slot's state while a consumer may still use it; None once it ended (released,
        revoked, its holder died, or unopened past the deadline)."""
        counter = file.counter
        state = counter.state(index)
        if state == HELD:
            return None if counter.reclaim_if_holder_died(index) else state
        if state == SENT:
            expired = self.deadline is not None and now - sent_at > self.deadline
            return None if expired and counter.revoke(index) else state
        return None if state in (RELEASED, REVOKED) else state

    def revoke(self, storage: torch.UntypedStorage) -> int:
        """Take back every unopened send of `storage`'s memory; returns how many."""
        key = storage_key(storage)
        with self._lock:
            export = self._by_key.get(key)
            slots = [] if export is None else list(export.slots)
            revoked = sum(
                file.counter.state(index) == SENT and file.counter.revoke(index)
                for file, index, _ in slots
            )
        if revoked:
            self.collect()
        return revoked

    def revoke_slot(self, counter_handle: bytes, index: int) -> bool:
        """Take back one unopened send, named by its counter file and slot; whether it was.
        Only the producer that owns the file can: elsewhere (or for an opened send) False."""
        file = self._counters.file(counter_handle)
        revoked = (
            file is not None and file.counter.state(index) == SENT and file.counter.revoke(index)
        )
        if revoked:
            self.collect()
        return revoked

    def takes_slots(self, counter_handle: bytes, room: int = 1) -> bool:
        """Whether peers can still take `room` slots in our counter file `counter_handle` (it is
        ours, open, and has that many left)."""
        file = self._counters.file(counter_handle)
        return file is not None and file.counter.cursor() + room <= SLOTS_PER_FILE

    def unopened(self, counter_handle: bytes, index: int) -> bool:
        """Whether the send named by (counter handle, slot) is ours and may still be opened."""
        file = self._counters.file(counter_handle)
        return file is not None and file.counter.state(index) == SENT

    def pending(self) -> bool:
        """Whether a later collection may still free something."""
        return bool(self._active) or bool(self._dropped) or bool(self._moved)

    def stats(self) -> dict:
        """`sent`: slots not ended; `unopened`, `oldest_unopened_s`: of those, the ones no
        consumer opened, as of the last collection round."""
        with self._lock:
            unopened, oldest = self._unopened
            return {
                "exports": len(self._by_id),
                "sent": self._held,
                "unopened": unopened,
                "oldest_unopened_s": round(time.monotonic() - oldest, 3) if unopened else 0.0,
                "counter_files": self._counters.open_files(),
            }

    def _forget_after_fork(self) -> None:
        """A forked child sent nothing: its parent's exports and files are not its own."""
        self._lock = threading.RLock()
        self._counters.forget_after_fork()
        self._by_id, self._by_key, self._active = {}, {}, {}
        self._held, self._unopened = 0, (0, 0.0)
        self._dropped, self._moved = collections.deque(), []
