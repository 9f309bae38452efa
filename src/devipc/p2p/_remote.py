"""Peer side, same host: a connected peer's registry page, and the peer's registrations this
process opened, each once, cached by (memory handle, registration id) — never by local pointer.

Before every transfer the registration's word in the peer's page is read: the id it was opened
under means the registration lives; anything else means the owner freed or deregistered it, so
the cached mapping is dropped (a device storage from devipc's core, whose slot and mapping are
released after the device work queued on them; a CPU mapping is unmapped once no copy uses it)
and the transfer raises RemoteTensorFreedError. Memory the peer maps can never be reused under
it: a device allocation is held by the slot the peer took, a shared file's pages by the mapping.
"""

import contextlib
import ctypes
import errno
import os
import select
import threading
from collections.abc import Iterable
from typing import cast

import torch

from .._core import _sharing
from .._core._errors import DevIpcError, InvalidHandleError, PeerGoneError, RemoteTensorFreedError
from .._core._hooks import hooks_for
from .._core._host import host_addressable, map_shared_file
from .._core._lifeline import TID_MASK as LIFELINE_TID
from .._core._memfd import MappedFile, open_shared_file, pid_alive
from .._core._refcount import open_counter_file
from ._descriptor import DEVICE, Descriptor, Metadata
from ._registry import PAGE_BYTES, PAGE_LIFELINE, PAGE_MAGIC, PAGE_SLOTS, word_offset

__all__ = ["Peer", "RemoteEntry"]

_POLL_EVERY = 64  # reads of an owner's lifeline word between two polls of its pidfd


class RemoteEntry:
    """One registration of the peer, opened here: `data` is all of its bytes (uint8); `host`
    their address when they are host memory this process mapped itself (CPU), else None."""

    __slots__ = (
        "reg_id",
        "slot",
        "data",
        "device",
        "host",
        "address",
        "waited",
        "dropped",
        "_mapping",
        "_pins",
    )

    def __init__(self, desc: Descriptor, data: torch.Tensor, mapping: MappedFile | None = None):
        self.reg_id, self.slot, self.device = desc.reg_id, desc.slot, data.device
        self.data: torch.Tensor | None = data  # None once unmapped
        self.host = None if mapping is None else mapping.address
        # the first byte's address where this process's CPU may copy it directly: CPU memory,
        # or memory of a device whose hooks say it is host-addressable ("DRAM"); else None
        self.address = (
            self.host
            if mapping is not None or not host_addressable(data.device)
            else data.data_ptr()
        )
        self.waited: set[bytes] = set()  # events of advertisements already waited for
        self._mapping = mapping  # CPU: our mapping of the owner's shared file
        self._pins = 0  # transfers using the memory now: `pin`, `unpin`
        self.dropped = False  # out of the peer's cache (`drop`): unmapped once no transfer pins it

    # All but `unmap` run under the peer's lock, which guards `_pins` and `dropped`: an entry
    # takes no lock of its own.
    def pin(self) -> None:
        """One more transfer uses this entry's memory: it stays mapped until `unpin`."""
        self._pins += 1

    def unpin(self) -> bool:
        """The transfer that pinned this entry let go; whether it is now to be unmapped
        (dropped, and no transfer left). An unpin without its pin is a bug: it would unmap
        memory under another thread's copy, so it raises instead."""
        if self._pins <= 0:
            raise RuntimeError(
                f"devipc.p2p: registration {self.reg_id}'s entry was unpinned "
                f"more often than pinned"
            )
        self._pins -= 1
        return self.dropped and not self._pins

    def drop(self) -> bool:
        """Out of the peer's cache: no new transfer may pin it; whether it is to be unmapped now
        (no transfer pins it), else the last `unpin` says so."""
        self.dropped = True
        return not self._pins

    def unmap(self) -> None:
        """Let go of the memory, once dropped and unpinned: a device storage's slot and mapping
        devipc's core releases after the work queued on them; a CPU mapping at once."""
        self.data = None
        if self._mapping is not None:
            self._mapping.close()

    @property
    def pins(self) -> int:
        """How many transfers pin this entry now."""
        return self._pins


_VIEWS_KEPT = 4096
_views: dict[tuple[int, int], memoryview] = {}


def host_bytes(address: int, nbytes: int) -> memoryview:
    """The `nbytes` at host `address`, as bytes Python copies with a slice assignment: a quarter
    of a `ctypes.memmove` call, whose argument conversion is most of a small copy. Views are kept
    by range; one owns nothing, so it is used only while a live tensor or mapping covers it."""
    view = _views.get((address, nbytes))
    if view is None:
        if len(_views) >= _VIEWS_KEPT:
            _views.clear()
        view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
        _views[(address, nbytes)] = view
    return view


def where(desc: Descriptor) -> tuple:
    """Everything a descriptor says about the memory of its registration: every descriptor of
    one registration says the same."""
    return (desc.device, desc.storage_bytes, desc.mem_offset, desc.counter, desc.anchor)


def _key(desc: Descriptor) -> tuple:
    """A registration's key in a peer's cache: (handle, generation), and the rest of what the
    descriptor says about the memory, so a forged one gets an entry of its own, never another
    one's. Kept on the (immutable) descriptor: decoded ones are reused call after call."""
    key = desc.__dict__.get("_peer_key")
    if key is None:
        key = (desc.kind, desc.mem, desc.fd, desc.reg_id, desc.slot, where(desc))
        object.__setattr__(desc, "_peer_key", key)
    return key


class Peer:
    """A peer process reached through its registry page. Thread-safe."""

    def __init__(self, meta: Metadata):
        self.pid, self.page_handle = meta.pid, meta.page
        self._lock = threading.Lock()
        self._entries: dict[tuple, RemoteEntry] = {}
        page = open_shared_file(meta.page, PAGE_MAGIC)  # PeerGoneError if it exited
        if page.size != PAGE_BYTES:
            page.close()
            raise InvalidHandleError(
                f"a registry page has {PAGE_BYTES} bytes, this one {page.size}"
            )
        self._page: MappedFile | None = page  # None once closed
        self._words: ctypes.Array[ctypes.c_int64] | None = (
            ctypes.c_int64 * PAGE_SLOTS
        ).from_address(page.address + word_offset(0))
        self._head = page.words  # the page as int64s (released with it)
        self._lifeline = page.words[PAGE_LIFELINE]  # the owner's lifeline; 0: its pidfd's poll
        self._reads = 0  # of the lifeline, for `_owner_lives`
        self._gone = False  # the owner exited: set before the close, so every thread says so
        self._exited = select.epoll()  # the pidfd turns readable once the process exits (epoll:
        try:  # threads may poll it at once); a pidfd never names another process with its pid
            self._pidfd = os.pidfd_open(self.pid)
            self._exited.register(self._pidfd, select.EPOLLIN)
        except (AttributeError, OSError):
            self._pidfd = -1

    # -- liveness --
    def check_alive(self) -> None:
        """PeerGoneError, the connection closed, once the owner exited (in every thread, also
        those that find it closed by another); ValueError once closed. Called before a copy's
        first path (the short ones look in `copy_live`, `move_live`)."""
        if not self._owner_lives():  # once closed, it raises why (`_closed`)
            self._gone = True
            self.close()
            raise self._closed()

    def _closed(self) -> Exception:
        """Why the connection is closed: PeerGoneError once its owner exited, else ValueError."""
        if self._gone:
            return PeerGoneError(
                f"peer process {self.pid} has exited: its tensors cannot be "
                f"read or written any more; this connection is closed"
            )
        return ValueError("this connection is closed: connect again")

    def _owner_lives(self) -> bool:
        """One load of the owner's lifeline word (`_lifeline`); every _POLL_EVERY-th time, and
        always where its page has none, an `epoll_wait` of its pidfd too: the memory of a
        process the OOM killer ended may be reaped before the kernel walks its robust list,
        and the word then stays as it was. Once closed, raises why (`_closed`)."""
        if self._page is None:
            raise self._closed()
        lifeline = self._lifeline
        if lifeline:
            try:
                if self._head[0] & LIFELINE_TID != lifeline:
                    return False
            except ValueError:  # closed meanwhile: the view went before the pages
                raise self._closed() from None
            self._reads += 1
            if self._reads % _POLL_EVERY:
                return True
        try:
            return self._polled()
        except ValueError:  # closed meanwhile: the epoll went with it
            raise self._closed() from None

    def _polled(self) -> bool:
        """Whether the owner lives, by its pidfd; once it says no, that answer sticks."""
        lives = not self._exited.poll(0) if self._pidfd >= 0 else pid_alive(self.pid)
        if not lives:
            self._lifeline = 0  # the word may say otherwise: the next looks ask the kernel too
        return lives

    def _live(self, reg_id: int, slot: int) -> bool:
        """Whether the owner's registration `reg_id` still lives (an aligned 8-byte load). Call
        with the lock: `close` unmaps the page under it."""
        words = self._words
        return words is not None and words[slot] == reg_id

    def _is_live(self, reg_id: int, slot: int) -> bool:
        with self._lock:
            return self._live(reg_id, slot)

    def check_live(self, words: list[tuple[int, int]]) -> None:
        """RemoteTensorFreedError, after a sweep, if any (slot, registration id) of `words`
        ended; once closed, why (`_closed`)."""
        with self._lock:
            if self._words is None:
                raise self._closed()
            ended = self._ended(words)
        if ended is not None:
            self.sweep()
            raise self._freed(ended)

    def _ended(self, words: list[tuple[int, int]]) -> int | None:
        """The first registration id of `words` ((slot, id) pairs) that ended, or None. Call
        with the lock, the page mapped. A loop, not a generator: one or a few words a post."""
        page = cast(ctypes.Array, self._words)
        for slot, reg_id in words:
            if page[slot] != reg_id:
                return reg_id
        return None

    def sweep(self) -> int:
        """Drop every cached registration the owner ended; how many."""
        with self._lock:
            stale = [
                key
                for key, entry in self._entries.items()
                if not self._live(entry.reg_id, entry.slot)
            ]
            entries = [self._entries.pop(key) for key in stale]
        for entry in entries:
            self._drop(entry)
        return len(entries)

    # -- opening --
    def open_all(self, descs: list[Descriptor]) -> list[RemoteEntry]:
        """`open` of each descriptor, under one lock for those already open and live (vectors
        of many ranges of a few registrations). Every entry comes back pinned, once per
        descriptor: `unpin(entries)` when the copies using them are queued or done."""
        entries: list = []  # of RemoteEntry, once every missing one is opened
        missing: list[int] = []  # their places: not cached, or cached but ended (`open` says)
        with self._lock:
            words, cached = self._words, self._entries
            for desc in descs:
                entry = cached.get(desc.__dict__.get("_peer_key") or _key(desc))
                if entry is None or words is None or words[desc.slot] != desc.reg_id:
                    missing.append(len(entries))
                    entries.append(None)
                else:
                    entry.pin()
                    entries.append(entry)
        pinned = [entry for entry in entries if entry is not None]  # by this call, each once
        try:
            for i in missing:
                entry = self.open(descs[i])
                pinned.append(entry)
                entries[i] = entry
        except BaseException:
            self.unpin(pinned)
            raise
        return entries

    def open(self, desc: Descriptor) -> RemoteEntry:
        """The opened registration `desc` names, pinned (see `open_all`); RemoteTensorFreedError
        if it ended."""
        key = _key(desc)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and self._live(desc.reg_id, desc.slot):
                entry.pin()
                return entry
            if entry is not None:
                del self._entries[key]
        if entry is not None:
            self._drop(entry)
            raise self._freed(desc.reg_id)
        if not self._is_live(desc.reg_id, desc.slot):
            raise self._freed(desc.reg_id)
        entry = self._open_device(desc) if desc.kind == DEVICE else self._open_cpu(desc)
        with self._lock:
            other = self._entries.get(key)
            if other is None and self._page is not None:
                self._entries[key] = other = entry
            if other is not None:
                other.pin()
        if other is not entry:  # another thread won, or we were closed
            self._drop(entry)
            if other is None:
                raise self._closed()
        return other

    def _freed(self, reg_id: int) -> Exception:
        """RemoteTensorFreedError for a registration whose word says it ended; once the
        connection closed (its words unmapped), why it closed."""
        if self._words is None:
            return self._closed()
        return RemoteTensorFreedError(
            f"remote tensor {reg_id} of process {self.pid} was freed or deregistered by its "
            f"owner; this process closed its mapping of it. Ask the owner for a new descriptor."
        )

    def _open_device(self, desc: Descriptor) -> RemoteEntry:
        """Take a slot of our own in the anchor's counter file (the core's forwarding path), then
        check the registration: its word is cleared before its memory can be let go, so a live
        word read after the slot was taken means the slot holds that memory."""
        hooks_for(desc.device)  # UnsupportedDeviceError: this process cannot reach it
        try:
            index = self._take_slot(desc)
        except InvalidHandleError:
            if not self._is_live(desc.reg_id, desc.slot):  # its file went with the export
                raise self._freed(desc.reg_id) from None
            raise
        try:
            if not self._is_live(desc.reg_id, desc.slot):
                raise self._freed(desc.reg_id)
            storage = _sharing.new_shared_device(
                desc.device,
                desc.mem,
                desc.storage_bytes,
                desc.mem_offset,
                desc.counter,
                index,
                b"",
                False,
            )
        except BaseException:
            with contextlib.suppress(DevIpcError, OSError):  # never left SENT
                _sharing.release_ipc_counter_device(desc.counter, index)
            raise
        data = torch.empty(0, dtype=torch.uint8, device=storage.device)
        data.set_(storage, 0, (desc.storage_bytes,))  # type: ignore[call-overload]
        return RemoteEntry(desc, data)

    def _take_slot(self, desc: Descriptor) -> int:
        counter = open_counter_file(desc.counter)
        try:
            if desc.anchor >= counter.cursor():
                raise InvalidHandleError(f"anchor slot {desc.anchor} was never sent")
            index = counter.take(counter.export(desc.anchor))
        finally:
            counter.mapping.close()
        if index is None:
            raise DevIpcError(
                f"the ref-counter file of process {self.pid} that this descriptor "
                f"names is full: ask the owner to advertise the tensor again"
            )
        return index

    def _open_cpu(self, desc: Descriptor) -> RemoteEntry:
        fd = self._open_fd(desc)
        try:
            mapping = MappedFile(fd, desc.storage_bytes)
        finally:
            os.close(fd)
        if not self._is_live(desc.reg_id, desc.slot):  # the fd may have been reused meanwhile
            mapping.close()
            raise self._freed(desc.reg_id)
        buffer = (ctypes.c_uint8 * desc.storage_bytes).from_address(mapping.address)
        return RemoteEntry(desc, torch.frombuffer(buffer, dtype=torch.uint8), mapping)

    def _open_fd(self, desc: Descriptor) -> int:
        """An fd of the shared file of the CPU registration `desc` names, checked to be that
        file (its inode and size)."""
        path = f"/proc/{self.pid}/fd/{desc.fd}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as error:
            if not pid_alive(self.pid):
                raise PeerGoneError(f"peer process {self.pid} has exited") from None
            if error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                raise
            if not self._is_live(desc.reg_id, desc.slot):  # its storage closed the fd
                raise self._freed(desc.reg_id) from None
            raise InvalidHandleError(
                f"{path} cannot be opened ({error.strerror}): the descriptor is stale or forged"
            ) from None
        try:
            stat = os.fstat(fd)
            if stat.st_ino != desc.anchor or stat.st_size != desc.storage_bytes:
                # The owner clears the word before the storage (and its fd) can go: an fd
                # number reused by another file means the registration ended, else a forgery.
                if not self._is_live(desc.reg_id, desc.slot):
                    raise self._freed(desc.reg_id)
                raise InvalidHandleError(
                    f"{path} is not the shared file this descriptor names (stale or forged)"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def map(self, desc: Descriptor) -> torch.Tensor:
        """The range `desc` names, as a uint8 tensor over the owner's memory that keeps what it
        maps (the connection's `map`): a device storage opened with a ref-counter slot of its
        own, host memory mapped again by a storage of its own. Neither is the cache's, so no
        sweep or close unmaps it under the tensor's views."""
        if desc.kind == DEVICE:
            data = self._open_device(desc).data
            assert data is not None
        else:
            fd = self._open_fd(desc)
            try:
                storage = map_shared_file(fd, desc.storage_bytes)
            finally:
                os.close(fd)
            if not self._is_live(desc.reg_id, desc.slot):
                raise self._freed(desc.reg_id)
            data = torch.empty(0, dtype=torch.uint8)
            data.set_(storage, 0, (desc.storage_bytes,))  # type: ignore[call-overload]
        return data[desc.offset : desc.offset + desc.nbytes]

    # -- copies pin the entries they use: a pinned entry is unmapped only once unpinned --
    def pin_live(self, entries: list[RemoteEntry]) -> bool:
        """Pin each of `entries` (cached before) once, if every one is still live and mapped;
        False, nothing pinned, once one ended (the caller's full path then says why)."""
        with self._lock:
            words = self._words
            if words is None or any(
                words[entry.slot] != entry.reg_id or entry.dropped for entry in entries
            ):
                return False
            for entry in entries:
                entry.pin()
        return True

    def move_live(
        self, words: list[tuple[int, int]], rows: list[tuple[memoryview, memoryview]]
    ) -> bool:
        """Copy each (destination, source) of `rows`, host bytes (`host_bytes`) in mappings
        pinned by the caller, if the owner and every (slot, registration id) of `words` are still
        live; False, nothing copied, once one ended (`check_alive` and `check_live` say which) or
        the connection closed."""
        with self._lock:
            if self._words is None or self._ended(words) is not None or not self._owner_lives():
                return False
            for dst, src in rows:
                dst[:] = src
        return True

    def copy_live(self, entry: RemoteEntry, dst: memoryview, src: memoryview) -> bool:
        """Copy between host bytes (`host_bytes`), one side in `entry`'s mapping, if its
        registration and its owner are still live and it is mapped: under the lock, so nothing
        unmaps it meanwhile. False, nothing copied, else."""
        with self._lock:
            words = self._words
            if (
                words is None
                or words[entry.slot] != entry.reg_id
                or entry.dropped
                or not self._owner_lives()
            ):
                return False
            dst[:] = src
        return True

    def unpin(self, entries: Iterable[RemoteEntry]) -> None:
        """Let go of what `open_all`, `open` or `pin_live` pinned, each pin once."""
        with self._lock:
            closing = [entry for entry in entries if entry.unpin()]
        for entry in closing:
            entry.unmap()

    def _drop(self, entry: RemoteEntry) -> None:
        with self._lock:
            idle = entry.drop()
        if idle:
            entry.unmap()

    def mapped(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        """Drop every cached registration and the page. Idempotent."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
            page, self._page, self._words = self._page, None, None
            if page is not None:
                page.close()  # under the lock: no `_live` reads it meanwhile
            self._exited.close()
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
        for entry in entries:
            self._drop(entry)
