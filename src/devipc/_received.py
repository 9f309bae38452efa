"""Consumer: the producers' allocations this process opened, the storages it made of them, and
releases that wait for the device work this process queued on them.
"""
import threading
from dataclasses import dataclass

import torch

from ._hooks import OpenedMemory


class OpenedAllocations:
    """The consumer's opened base allocations (the hooks' OpenedMemory): each opened once per
    process, closed with its last storage."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_handle: dict[bytes, list] = {}  # handle -> [OpenedMemory, live storages]

    def acquire(self, hooks, handle: bytes) -> OpenedMemory:
        with self._lock:
            entry = self._by_handle.get(handle)
            if entry is not None:
                entry[1] += 1
                return entry[0]
            # Opening under the lock: two threads must not map the same allocation twice.
            memory = hooks.open_ipc_mem_handle(handle)
            self._by_handle[handle] = [memory, 1]
            return memory

    def release(self, handle: bytes) -> None:
        with self._lock:
            entry = self._by_handle[handle]
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._by_handle[handle]
        entry[0].close()

    def contains(self, device: torch.device, ptr: int) -> bool:
        with self._lock:
            return any(m.device.type == device.type and m.ptr <= ptr < m.ptr + max(m.size, 1)
                       for m, _ in self._by_handle.values())

    def __len__(self):
        with self._lock:
            return len(self._by_handle)


@dataclass(frozen=True)
class Receipt:
    """Where a received storage's memory came from: enough to forward it."""

    mem_handle: bytes
    offset: int  # bytes into the producer's allocation
    counter_handle: bytes
    slot: int


class ReceivedStorages:
    """Storages made of received memory, by (device, data_ptr, nbytes), while they live."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_key: dict[tuple, list[Receipt]] = {}

    @staticmethod
    def key(storage: torch.UntypedStorage) -> tuple:
        return (str(storage.device), storage.data_ptr(), storage.nbytes())

    def add(self, key: tuple, receipt: Receipt) -> None:
        with self._lock:
            self._by_key.setdefault(key, []).append(receipt)

    def forget(self, key: tuple, receipt: Receipt) -> None:
        with self._lock:
            receipts = self._by_key.get(key, [])
            if receipt in receipts:
                receipts.remove(receipt)
            if not receipts:
                self._by_key.pop(key, None)

    def get(self, storage: torch.UntypedStorage) -> Receipt | None:
        with self._lock:
            receipts = self._by_key.get(self.key(storage))
            return receipts[0] if receipts else None


class DeferredReleases:
    """Releases that run once the device work queued before them is done, so the producer never
    frees memory this process's streams still read or write (torch's CUDA consumer synchronizes
    its stream instead; this does not block the thread that dropped the storage)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: list[tuple[torch.Event, object]] = []

    def after_queued_work(self, device: torch.device, release) -> bool:
        """Run `release` now if the current stream of `device` is idle, else later; returns
        whether it is still pending."""
        try:
            stream = torch.get_device_module(device).current_stream(device)
            done = stream.query()  # nothing queued: no event needed
            if not done:
                event = torch.Event(device=device)
                event.record(stream)
                done = event.query()
        except Exception:  # e.g. at interpreter shutdown: wait for the device instead
            torch.accelerator.synchronize(device)
            done = True
        if done:
            release()
            return False
        with self._lock:
            self._pending.append((event, release))
        return True

    def poll(self) -> bool:
        """Run the releases whose work is done; returns whether some are still pending."""
        with self._lock:
            ready, waiting = [], []
            for entry in self._pending:
                (ready if entry[0].query() else waiting).append(entry)
            self._pending = waiting
        for _event, release in ready:
            release()
        return bool(waiting)

    def __len__(self):
        with self._lock:
            return len(self._pending)
