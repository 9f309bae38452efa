"""Shared memory that another process can open by plain bytes, and that never leaks a name.

A memfd has no name in /dev/shm: it dies with the last process holding its fd or a mapping of it,
also under SIGKILL. Another process of the same user opens it through /proc/<pid>/fd/<fd>; the
random token in the memfd's name proves the fd is still the one the handle was made for.
"""
import ctypes
import errno
import mmap
import os
import secrets
import struct

from ._errors import InvalidHandleError, PeerGoneError

_FORMAT = "<4sHiiQ16s"  # magic, version, pid, fd, size, token
HANDLE_SIZE = struct.calcsize(_FORMAT)
_VERSION = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class MappedFile:
    """A MAP_SHARED mapping that, unlike mmap.mmap, keeps no duplicate of the file descriptor.

    `fd` is the descriptor of a peer's file this process opened and keeps for byte-range locks
    (closed with the mapping), or -1.
    """

    __slots__ = ("address", "size", "fd")

    def __init__(self, fd: int, size: int, keep_fd: bool = False):
        address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed")
        self.address, self.size = address, size
        self.fd = fd if keep_fd else -1

    def int64(self, index: int) -> ctypes.c_int64:
        """The aligned int64 at `index`: loads and stores of it are single instructions."""
        return ctypes.c_int64.from_address(self.address + 8 * index)

    def bytes(self, start: int, end: int) -> bytes:
        return ctypes.string_at(self.address + start, end - start)

    def write(self, start: int, data: bytes) -> None:
        ctypes.memmove(self.address + start, data, len(data))

    def close(self) -> None:
        """Idempotent."""
        if self.address:
            _libc.munmap(self.address, self.size)
            self.address = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SharedFile:
    """A memfd this process created and maps; `handle` lets another process map it too."""

    __slots__ = ("fd", "size", "buffer", "handle", "_token")

    def __init__(self, magic: bytes, size: int):
        self._token = secrets.token_bytes(16)
        self.fd = os.memfd_create(f"devipc-{magic.decode()}-{self._token.hex()}", os.MFD_CLOEXEC)
        self.size = size
        try:
            os.ftruncate(self.fd, size)
            self.buffer = MappedFile(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.handle = struct.pack(_FORMAT, magic, _VERSION, os.getpid(), self.fd, size,
                                  self._token)

    def close(self) -> None:
        """Idempotent. Peers that mapped the file keep their mapping."""
        if self.fd >= 0:
            self.buffer.close()
            os.close(self.fd)
            self.fd = -1

    def __repr__(self):
        state = "closed" if self.fd < 0 else f"fd={self.fd}"
        return f"<SharedFile {self.size} bytes {state}>"


def open_shared_file(handle: bytes, magic: bytes) -> MappedFile:
    """Map the file a peer's handle names, keeping this open of it for byte-range locks;
    InvalidHandleError or PeerGoneError otherwise."""
    if not isinstance(handle, bytes) or len(handle) != HANDLE_SIZE:
        raise InvalidHandleError(f"a devipc {magic.decode()} handle has {HANDLE_SIZE} bytes, "
                                 f"got {len(handle) if isinstance(handle, bytes) else handle!r}")
    got_magic, version, pid, fd, size, token = struct.unpack(_FORMAT, handle)
    if got_magic != magic or version != _VERSION or pid <= 0 or fd < 0 or size <= 0:
        raise InvalidHandleError(f"not a devipc {magic.decode()} handle (magic {got_magic!r}, "
                                 f"version {version})")
    path = f"/proc/{pid}/fd/{fd}"
    try:
        peer_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as error:
        if not _alive(pid):
            raise PeerGoneError(f"process {pid} that exported this {magic.decode()} handle has "
                                f"exited; keep the producer alive until consumers have opened "
                                f"what it sent") from None
        raise InvalidHandleError(f"cannot open {path} for a {magic.decode()} handle: {error}. "
                                 f"Both processes must run as the same user.") from None
    try:
        name = os.readlink(f"/proc/self/fd/{peer_fd}")
        if token.hex() not in name or os.fstat(peer_fd).st_size != size:
            raise InvalidHandleError(f"{path} is not the file this {magic.decode()} handle names "
                                     f"(the handle is stale or forged)")
        return MappedFile(peer_fd, size, keep_fd=True)
    except BaseException:
        os.close(peer_fd)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as error:
        return error.errno != errno.ESRCH
    return True
