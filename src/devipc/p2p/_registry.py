"""The tensor registry: one registration per storage, tied to the storage's life.

Registration is per storage, not per data_ptr: every view of a registered storage finds the same
registration (and its own byte offset in it). Ids count up and are never reused in a process. A
registration ends by `deregister`, or when its storage object dies: a `weakref.finalize` on the
storage runs while the storage is being destroyed, before its memory goes back to the allocator,
so an address can never be reused while a registration still names it.

Peers learn whether a registration is still alive from the registry page, a small memfd this process
owns and peers map read-only in effect: word `slot` holds the registration's id while it lives and 0
after. It has PAGE_SLOTS (65,536) words, so at most that many registrations live at once in a
process (DevIpcError past that; an ended one gives its slot back). Ids are never reused, so the id
doubles as the generation: a peer that cached (handle, id) and reads another value knows its cached
mapping is stale. The word is cleared first of all when a registration ends, before listeners run
and before the memory can go. The page's header holds the owner's lifeline (`_lifeline`): peers read
from it whether the owner still lives.

A registration covers the memory its storage had when it was registered. Device memory is held
through devipc's core (`_sharing.hold`) until the registration ends, whatever becomes of the
storage, so a peer (over IPC or NIXL) never reaches memory that went back to the allocator. When
the storage stops pointing at that memory (`resize_`, on a device whose hooks keep sent storages
resizable; elsewhere resizing a registered storage raises), the registration ends: at once when
the owner advertises or registers it again, else within a collector round (peers then get
RemoteTensorFreedError), and the old memory goes once it ended. Register the storage again for
its new memory.
"""

import itertools
import logging
import os
import threading
import weakref
from typing import Any

import torch

from .._core import _lifeline, _sharing
from .._core._errors import DevIpcError, NotRegisteredError
from .._core._hooks import hooks_for
from .._core._memfd import SharedFile, WordTable
from .._core._memory import TensorOrStorage, untyped

__all__ = [
    "PAGE_BYTES",
    "PAGE_LIFELINE",
    "PAGE_MAGIC",
    "PAGE_SLOTS",
    "Registration",
    "Registry",
    "registry",
    "word_offset",
]

_log = logging.getLogger("devipc")
PAGE_MAGIC = b"P2PR"
PAGE_SLOTS = 1 << 16  # live registrations at most; slots are reused, ids never
PAGE_BYTES = WordTable.size(PAGE_SLOTS, 1)  # one word a slot, after the header
# The header: the owner's lifeline (`_lifeline`), its mutex from byte 0 and, in this word, the id
# its `hold` returned (0: none, peers poll the owner's pidfd).
PAGE_LIFELINE = 7
assert _lifeline.RESERVED + 8 <= 8 * PAGE_LIFELINE


def word_offset(slot: int) -> int:
    """The byte offset of `slot`'s word in the registry page."""
    return WordTable.HEADER + 8 * slot


class Registration:
    """One registered storage. `id` is never reused; `base` is the storage's data_ptr, `nbytes`
    its size."""

    __slots__ = (
        "id",
        "nbytes",
        "device",
        "base",
        "slot",
        "_ref",
        "_key",
        "_finalizer",
        "_hold",
        "__weakref__",
    )

    def __init__(self, reg_id: int, storage: torch.UntypedStorage, slot: int):
        self.id, self.slot = reg_id, slot
        self.nbytes, self.device, self.base = storage.nbytes(), storage.device, storage.data_ptr()
        self._ref, self._key = weakref.ref(storage), id(storage)
        self._finalizer: weakref.finalize | None = None
        self._hold: _sharing.Hold | None = None  # device memory kept while it lives

    def moved(self, storage: torch.UntypedStorage) -> bool:
        """Whether `storage` no longer holds the memory this registration covers."""
        return storage.data_ptr() != self.base or storage.nbytes() != self.nbytes

    def storage(self) -> torch.UntypedStorage | None:
        """The registered storage, or None once it died."""
        return self._ref()

    @property
    def alive(self) -> bool:
        return registry.is_alive(self)

    def __repr__(self) -> str:
        state = "alive" if self.alive else "ended"
        return f"<devipc.p2p.Registration {self.id}: {self.nbytes} bytes on {self.device}, {state}>"


def check_registrable(storage: torch.UntypedStorage) -> None:
    """A storage peers can reach without a copy: device memory with IPC hooks, or CPU memory in
    fd-backed shared memory (torch's file_descriptor strategy)."""
    if storage.nbytes() == 0:
        raise ValueError("an empty tensor has no memory to register")
    if storage.device.type == "cpu":
        try:
            storage._get_shared_fd()  # type: ignore[attr-defined]
        except RuntimeError:
            raise ValueError(
                "a CPU tensor is registered only in fd-backed shared memory, which peers map "
                "without a copy: make it with devipc.p2p.create_tensor(..., device='cpu'), or "
                "call tensor.share_memory_() first (a one-time copy) under torch's "
                "'file_descriptor' sharing strategy (the Linux default)"
            ) from None
        return
    hooks_for(storage.device)  # UnsupportedDeviceError: no hooks, peers could not map it


class Registry:
    """The process's registrations. Thread-safe; a finalizer may run inside any call (the
    garbage collector), hence the re-entrant lock and no iteration over live tables."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._next_id = 1
        self._by_storage: dict[int, Registration] = {}  # id(storage object) -> registration
        self._by_id: dict[int, Registration] = {}
        self._free_slots: list[int] = []
        self._used_slots = 0
        self._page: SharedFile | None = None
        self._listeners: list = []
        os.register_at_fork(after_in_child=self._forget_after_fork)

    # -- the page peers read --
    def page(self) -> SharedFile:
        with self._lock:
            if self._page is None:
                page = SharedFile(PAGE_MAGIC, PAGE_BYTES)
                lifeline = _lifeline.hold(page.buffer.address)
                WordTable(page.buffer, 1).store_header(PAGE_LIFELINE, lifeline)
                self._page = page
            return self._page

    def is_alive(self, reg: Registration) -> bool:
        page = self._page
        return (
            page is not None
            and page.buffer.address != 0
            and WordTable(page.buffer, 1).load(reg.slot) == reg.id
        )

    # -- registering --
    def register(self, tensor_or_storage: TensorOrStorage) -> Registration:
        storage = untyped(tensor_or_storage)
        with self._lock:
            found = self._find(storage)
        if found is not None and found.moved(storage):
            self.deregister(found.id)  # its memory moved: a new registration for the new one
        elif found is not None:
            return found
        check_registrable(storage)
        # The memory is held before any peer can learn of it, outside the registry's lock (the
        # core's lock is never taken under it, so a finalizer ending a registration inside the
        # core cannot wait for a thread that waits for the core).
        named: list[int] = []  # the id, once there is one
        held = None
        if storage.device.type != "cpu" and not _sharing.received_via_ipc(storage):
            held = _sharing.hold(storage, lambda: named and self.deregister(named[0]))
        reg = None
        try:
            with self._lock:
                found = self._find(storage)  # another thread may have registered it meanwhile
                if found is None:
                    page = self.page()
                    reg = Registration(next(self._ids), storage, self._take_slot())
                    reg._hold = held
                    named.append(reg.id)
                    self._next_id = reg.id + 1
                    finalizer = reg._finalizer = weakref.finalize(storage, self._collected, reg.id)
                    finalizer.atexit = False
                    self._by_storage[id(storage)] = reg
                    self._by_id[reg.id] = reg
                    WordTable(page.buffer, 1).store(reg.slot, 0, reg.id)
                    listeners = list(self._listeners)
        finally:
            if reg is None and held is not None:
                _sharing.release_hold(held)
        if found is not None or reg is None:
            return found  # type: ignore[return-value]
        try:
            for listener in listeners:
                listener.on_register(reg)
        except BaseException:
            self.deregister(reg.id)
            raise
        return reg

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        if self._used_slots >= PAGE_SLOTS:
            raise DevIpcError(
                f"devipc.p2p holds at most {PAGE_SLOTS:,} live registrations in a process (one "
                f"word each in the registry page peers map), and this process has them all: "
                f"free_tensor or deregister the tensors peers no longer need, or register fewer, "
                f"larger tensors and advertise ranges of them"
            )
        self._used_slots += 1
        return self._used_slots - 1

    def _find(self, storage: torch.UntypedStorage) -> Registration | None:
        reg = self._by_storage.get(id(storage))
        return reg if reg is not None and reg.storage() is storage else None

    def lookup(self, tensor_or_storage: TensorOrStorage) -> Registration:
        storage = untyped(tensor_or_storage)
        with self._lock:
            reg = self._find(storage)
        if reg is None:
            raise NotRegisteredError(
                "this tensor's storage is not registered: call "
                "devipc.p2p.register(tensor) or make it with create_tensor"
            )
        return reg

    def get(self, reg_id: int) -> Registration:
        if not isinstance(reg_id, int) or isinstance(reg_id, bool):
            raise TypeError(f"a tensor id is an int, not {type(reg_id).__name__}")
        with self._lock:
            reg = self._by_id.get(reg_id)
        if reg is None:
            raise NotRegisteredError(
                f"tensor id {reg_id} is not registered "
                f"{'any more' if 0 < reg_id < self._next_id else 'here'}"
            )
        return reg

    # -- ending --
    def deregister(self, reg_id: int) -> bool:
        """End a registration; whether it was live. An id that ended already is a no-op; an id
        this process never issued raises NotRegisteredError."""
        if not isinstance(reg_id, int) or isinstance(reg_id, bool):
            raise TypeError(f"a tensor id is an int, not {type(reg_id).__name__}")
        with self._lock:
            reg = self._by_id.pop(reg_id, None)
            if reg is None:
                if 0 < reg_id < self._next_id:
                    return False
                raise NotRegisteredError(f"tensor id {reg_id} was never registered here")
            # Peers stop first: the word goes before anything else does.
            WordTable(self.page().buffer, 1).store(reg.slot, 0, 0)
            if self._by_storage.get(reg._key) is reg:
                del self._by_storage[reg._key]
            self._free_slots.append(reg.slot)
            listeners = list(self._listeners)
        if reg._finalizer is not None:
            reg._finalizer.detach()
        for listener in listeners:
            try:
                listener.on_deregister(reg)
            except Exception:  # noqa: BLE001 - every listener must hear it
                _log.exception("devipc.p2p: a deregistration listener failed")
        held, reg._hold = reg._hold, None
        if held is not None:
            _sharing.release_hold(held)  # last: peers and listeners let go first
        return True

    def check_current(self, reg: Registration) -> None:
        """NotRegisteredError unless `reg` lives and its storage still holds the memory it
        covers; a storage whose memory moved ends its registration here."""
        storage = reg.storage()
        if storage is not None and self.is_alive(reg):
            if not reg.moved(storage):
                return
            self.deregister(reg.id)
            raise NotRegisteredError(
                f"tensor id {reg.id} ended: its storage was resized after "
                f"it was registered (peers get RemoteTensorFreedError). "
                f"Register it again for its new memory"
            )
        raise NotRegisteredError(f"tensor id {reg.id} is not registered any more")

    def _collected(self, reg_id: int) -> None:
        """The storage is being destroyed (weakref.finalize): end its registration now."""
        self.deregister(reg_id)

    # -- listeners (transports that register memory with a network agent) --
    def add_listener(self, listener: Any) -> None:
        """`listener.on_register(reg)` for every live registration now and every new one, and
        `listener.on_deregister(reg)` when one ends."""
        with self._lock:
            self._listeners.append(listener)
            live = list(self._by_id.values())
        for reg in live:
            listener.on_register(reg)

    def remove_listener(self, listener: object) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def live(self) -> int:
        """How many registrations are live."""
        with self._lock:
            return len(self._by_id)

    def _forget_after_fork(self) -> None:
        """A forked child owns none of its parent's registrations or its page."""
        self._lock = threading.RLock()
        for reg in self._by_id.values():
            if reg._finalizer is not None:
                reg._finalizer.detach()
        self._by_storage, self._by_id, self._free_slots, self._used_slots = {}, {}, [], 0
        self._page, self._listeners = None, []


registry = Registry()
