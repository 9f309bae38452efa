"""Host memory between processes for the weight publisher: a CPU trainer's weights in torch's own
CPU shared memory, and a CPU engine's view of device memory that lies in host memory.

A CPU tensor that torch shares (`share_memory_()`, its default "file_descriptor" strategy) lives
in an unlinked shared-memory file whose fd the storage keeps open. A `HostSend` names that fd:
another process of this host opens it through /proc/<pid>/fd and maps it (`from_file`, owned by
the storage it makes); the file's device and inode, carried in the send, prove that the fd is
still the one it was made for. Nothing is named in /dev/shm, nothing is copied.

A device whose hooks say its memory is host memory (`IpcHooks.memory_kind` "DRAM", as openreg's)
can be read as CPU tensors where it is mapped (`as_host`): a CPU engine reads a device trainer's
weights without a copy. Other devices are refused with the copy to make instead.
"""

import ctypes
import os

import torch

from . import _wire
from ._errors import InvalidHandleError, UnsupportedDeviceError
from ._hooks import get_ipc_hooks
from ._memfd import open_peer_fd, reach_tag

__all__ = [
    "HostSend",
    "as_host",
    "host_addressable",
    "map_shared_file",
    "not_host_memory",
    "share_host",
    "shared_host_storage",
]


def shared_host_storage(nbytes: int) -> torch.UntypedStorage:
    """`nbytes` of CPU memory that `HostSend` can send (torch's fd-backed shared memory)."""
    return torch.UntypedStorage._new_using_fd_cpu(max(nbytes, 1))


def share_host(storage: torch.UntypedStorage) -> int:
    """The fd of a CPU storage's shared-memory file, the storage moved there first if it is not
    (as `share_memory_()` moves it: its data pointer changes, its tensors follow)."""
    try:
        fd, _ = storage._share_fd_cpu_()
    except RuntimeError as error:
        raise ValueError(
            f"this CPU storage cannot be shared: torch shared it by file name "
            f"(torch.multiprocessing.set_sharing_strategy('file_system')?) or "
            f"cannot share it ({error}); use the default 'file_descriptor' "
            f"strategy"
        ) from None
    return fd


class HostSend:
    """A CPU storage's shared-memory file as plain bytes: opened by any process of this host and
    PID namespace of the same user while the sender keeps the storage. Opening maps it again:
    writes cross both ways, and the mapping outlives the sender."""

    __slots__ = ("pid", "fd", "inode", "nbytes", "_reach")

    kind = "bucket"  # what an arena attachment checks of its send

    def __init__(self, pid: int, fd: int, inode: tuple[int, int], nbytes: int, reach: bytes):
        self.pid, self.fd, self.inode, self.nbytes, self._reach = pid, fd, inode, nbytes, reach

    @classmethod
    def of(cls, storage: torch.UntypedStorage) -> "HostSend":
        """The send of a CPU storage, moved into shared memory first if it is not there."""
        if storage.device.type != "cpu":
            raise ValueError(f"a host send is of CPU memory, not {storage.device}")
        fd = share_host(storage)
        status = os.fstat(fd)
        return cls(os.getpid(), fd, (status.st_dev, status.st_ino), storage.nbytes(), reach_tag())

    def __bytes__(self) -> bytes:
        return (
            _wire.Writer(_wire.HOST)
            .bytes(self._reach)
            .int(self.pid)
            .int(self.fd)
            .int(self.inode[0])
            .int(self.inode[1])
            .int(self.nbytes)
            .done()
        )

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, name: str = "host memory handle"
    ) -> "HostSend":
        reader = _wire.Reader(data, (_wire.HOST,), name)
        reach = reader.bytes("host and namespace tag", 8)
        pid = reader.int("pid", 1, (1 << 31) - 1)
        fd = reader.int("fd", 0, (1 << 31) - 1)
        inode = (reader.int("file system"), reader.int("inode"))
        nbytes = reader.int("size", 1)
        reader.end()
        return cls(pid, fd, inode, nbytes, reach)

    def unopened(self) -> bool:
        """An arena's question of a send handed out: a host send may be opened as long as its
        sender keeps the memory (its record says whether it was)."""
        return True

    def revoke(self) -> bool:
        """Nothing to take back: the arena's record refuses an open once it is reused."""
        return True

    def open(self, what: str) -> torch.UntypedStorage:
        """This process's mapping of the sender's memory, as a CPU storage that owns it.
        InvalidHandleError for a stale, forged or unreachable send; PeerGoneError once the
        sender exited. `what`: what errors call the handle the user holds."""
        fd = open_peer_fd(self._reach, self.pid, self.fd, what)
        try:
            status = os.fstat(fd)
            if (status.st_dev, status.st_ino) != self.inode or status.st_size < self.nbytes:
                raise InvalidHandleError(
                    f"fd {self.fd} of process {self.pid} is not the memory "
                    f"this {what} names (it is stale or forged)"
                )
            return map_shared_file(fd, self.nbytes)
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"<HostSend {self.nbytes} bytes of process {self.pid}>"


def map_shared_file(fd: int, nbytes: int) -> torch.UntypedStorage:
    """The first `nbytes` of the shared file `fd` (opened here), mapped by a CPU storage that owns
    its mapping: writes cross both ways, and it outlives the fd and the file's other holders."""
    storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", True, nbytes)
    assert isinstance(storage, torch.UntypedStorage)
    return storage


def host_addressable(device: torch.device) -> bool:
    """Whether the CPU may read and write `device`'s memory at its tensors' addresses: the CPU's
    own, or a device whose hooks report its memory as "DRAM" (`IpcHooks.memory_kind`)."""
    if device.type == "cpu":
        return True
    hooks = get_ipc_hooks(device.type)
    return hooks is not None and hooks.memory_kind(device.index or 0) == "DRAM"


def as_host(storage: torch.UntypedStorage, what: str) -> torch.UntypedStorage:
    """The same bytes as a CPU storage that keeps `storage` alive: zero-copy, for a device whose
    memory is host memory. UnsupportedDeviceError, saying which copy to make, otherwise."""
    if storage.device.type == "cpu":
        return storage
    if not host_addressable(storage.device):
        raise not_host_memory(storage.device, what)
    nbytes = storage.nbytes()
    if not nbytes:
        return torch.UntypedStorage(0)
    buffer = (ctypes.c_char * nbytes).from_address(storage.data_ptr())
    buffer.keep = storage  # type: ignore[attr-defined]  # the device mapping lives as long
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


def not_host_memory(device: torch.device, what: str) -> UnsupportedDeviceError:
    return UnsupportedDeviceError(
        f"{device.type} memory is not host memory (its IPC hooks' memory_kind is not 'DRAM'), "
        f"so a {what} cannot be read on the CPU without a copy: open it on {device.type} "
        f"and copy what the CPU needs (copy_into a CPU model copies once per generation)"
    )
