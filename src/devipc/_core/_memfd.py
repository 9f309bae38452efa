"""Shared memory that another process can open by plain bytes, and that never leaks a name.

A memfd has no name in /dev/shm: it dies with the last process holding its fd or a mapping of it,
also under SIGKILL. Another process of the same user opens it through /proc/<pid>/fd/<fd>; the
random token in the memfd's name proves the fd is still the one the handle was made for.
docs/ipc-handles.md specifies the protocol; the openreg runtime (ipc.cpp) follows it too.
"""

import builtins
import ctypes
import errno
import functools
import hashlib
import mmap
import os
import secrets
import struct

from ._errors import InvalidHandleError, PeerGoneError

_FORMAT = "<4sHiiQ16s"  # magic, version, pid, fd, size, token
HANDLE_SIZE = struct.calcsize(_FORMAT)
VERSION = 2  # 2: the token's first 8 bytes are the maker's reach

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class MappedFile:
    """A MAP_SHARED mapping that, unlike mmap.mmap, keeps no duplicate of the file descriptor.

    `fd` is the descriptor of a peer's file this process opened and keeps for byte-range locks
    (closed with the mapping), or -1. `words` is the mapping as aligned int64s: a load or store
    of one is a single instruction, and raises ValueError once the mapping is closed.
    """

    __slots__ = ("address", "size", "fd", "words")

    def __init__(self, fd: int, size: int, keep_fd: bool = False):
        address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed")
        self.address, self.size = address, size
        self.fd = fd if keep_fd else -1
        whole = (ctypes.c_char * (size // 8 * 8)).from_address(address)
        self.words = memoryview(whole).cast("B").cast("q")

    def int64(self, index: int) -> ctypes.c_int64:
        """The aligned int64 at `index`: loads and stores of it are single instructions."""
        if not self.address:
            raise ValueError("the mapping is closed")  # never a read near address 0
        return ctypes.c_int64.from_address(self.address + 8 * index)

    def bytes(self, start: int, end: int) -> bytes:
        return ctypes.string_at(self.address + start, end - start)

    def write(self, start: int, data: builtins.bytes) -> None:
        ctypes.memmove(self.address + start, data, len(data))

    def close(self) -> None:
        """Idempotent."""
        if self.address:
            self.words.release()  # before the pages go: no load through it reaches them
            _libc.munmap(self.address, self.size)
            self.address = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SharedFile:
    """A memfd this process created and maps; `handle` lets another process map it too."""

    __slots__ = ("fd", "size", "buffer", "handle", "_token")

    def __init__(self, magic: bytes, size: int):
        self._token = reach_tag() + secrets.token_bytes(8)
        self.fd = os.memfd_create(_memfd_name(magic, self._token), os.MFD_CLOEXEC)
        self.size = size
        try:
            os.ftruncate(self.fd, size)
            self.buffer = MappedFile(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.handle = struct.pack(_FORMAT, magic, VERSION, os.getpid(), self.fd, size, self._token)

    def close(self) -> None:
        """Idempotent. Peers that mapped the file keep their mapping."""
        if self.fd >= 0:
            self.buffer.close()
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        state = "closed" if self.fd < 0 else f"fd={self.fd}"
        return f"<SharedFile {self.size} bytes {state}>"


def open_shared_file(handle: bytes, magic: bytes, what: str | None = None) -> MappedFile:
    """Map the file a peer's handle names, by the open procedure of docs/ipc-handles.md, and keep
    this open of it (`MappedFile.fd`) for byte-range locks.

    InvalidHandleError saying so if the producer is on another host or in another PID namespace;
    PeerGoneError if the producer has exited (a zombie too: its fds are closed already),
    InvalidHandleError for a malformed, forged or stale handle and for a denied open, OSError when
    this process is out of fds or memory. `what` is what errors call the handle (the object a
    user holds: "WeightPublisher token"), else "devipc <magic> handle".
    """
    what = what or f"devipc {magic.decode()} handle"
    if not isinstance(handle, bytes) or len(handle) != HANDLE_SIZE:
        raise InvalidHandleError(
            f"a {what} has {HANDLE_SIZE} bytes, "
            f"got {len(handle) if isinstance(handle, bytes) else handle!r}"
        )
    got_magic, version, pid, fd, size, token = struct.unpack(_FORMAT, handle)
    if got_magic != magic or version != VERSION or pid <= 0 or fd < 0 or size <= 0:
        raise InvalidHandleError(f"not a {what} (magic {got_magic!r}, version {version})")
    peer_fd = open_peer_fd(token[:8], pid, fd, what)
    path = f"/proc/{pid}/fd/{fd}"
    try:
        # What was opened, not the path again: the producer may reuse fd numbers. The exact name:
        # a regular file that merely carries the token in its name is not our memfd.
        name = os.readlink(f"/proc/self/fd/{peer_fd}")
        if (
            name != f"/memfd:{_memfd_name(magic, token)} (deleted)"
            or os.fstat(peer_fd).st_size != size
        ):
            raise InvalidHandleError(
                f"{path} is not the file this {what} names (it is stale or forged)"
            )
        return MappedFile(peer_fd, size, keep_fd=True)
    except BaseException:
        os.close(peer_fd)
        raise


def open_peer_fd(reach: bytes, pid: int, fd: int, what: str) -> int:
    """This process's own open (O_RDWR) of fd `fd` of process `pid`, through /proc: the first
    step of opening a peer's file by plain bytes; the caller checks that it is the file it names.
    `reach`: the maker's `reach_tag`. InvalidHandleError for a peer on another host or PID
    namespace, a denied, closed or forged fd; PeerGoneError once the peer exited (a zombie too);
    OSError when this process is out of fds or memory."""
    check_reach(reach, pid, what)
    if not pid_alive(pid):
        raise _peer_gone(pid, what)
    path = f"/proc/{pid}/fd/{fd}"
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as error:
        if not pid_alive(pid):
            raise _peer_gone(pid, what) from None
        if error.errno in (errno.EACCES, errno.EPERM):
            raise InvalidHandleError(
                f"permission denied opening {path} for a {what}: the consumer must run as "
                f"the same user as process {pid}, in the same PID namespace, and process {pid} "
                f"must be dumpable (one that dropped privileges or called "
                f"prctl(PR_SET_DUMPABLE, 0) cannot be opened even by its own user)"
            ) from None
        if error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            raise
        if error.errno == errno.ENOENT:
            raise InvalidHandleError(
                f"fd {fd} of process {pid} cannot be opened: it is no "
                f"longer open there (the file of this {what} was released, "
                f"or it is stale)"
            ) from None
        raise InvalidHandleError(
            f"fd {fd} of process {pid} cannot be opened as the file of a "
            f"{what} ({error.strerror}): it is forged or stale"
        ) from None


def host_identity() -> bytes:
    """Same bytes in two processes iff they can open each other's fds through /proc: one boot
    of one kernel, one PID namespace; b"" where /proc does not say."""
    try:
        with builtins.open("/proc/sys/kernel/random/boot_id", "rb") as boot:
            boot_id = boot.read().strip()
        return boot_id + b"/" + str(os.stat("/proc/self/ns/pid").st_ino).encode()
    except OSError:
        return b""


@functools.cache
def reach_tag() -> bytes:
    """8 bytes: 4 of a digest of this boot (the host), 4 of this PID namespace; zeros where
    /proc does not say (then nothing is checked)."""
    identity = host_identity()
    if not identity:
        return bytes(8)
    boot, _, namespace = identity.partition(b"/")
    return (
        hashlib.blake2b(boot, digest_size=4).digest()
        + hashlib.blake2b(namespace, digest_size=4).digest()
    )


def check_reach(tag: bytes, pid: int, what: str) -> None:
    """InvalidHandleError naming the fixes when the handle's maker is on another host or in
    another PID namespace: its /proc/<pid>/fd cannot be reached from here."""
    mine = reach_tag()
    if tag == mine or not any(tag) or not any(mine):
        return
    if tag[:4] != mine[:4]:
        where = "on another host (or another boot of this one)"
        fix = "move tensors between hosts with devipc.p2p's Endpoint(transport='nixl')"
    else:
        where = "in another PID namespace (another container, or `unshare --pid`)"
        fix = (
            "run both processes in one PID namespace (`docker run --pid=host` or "
            "`--pid=container:<producer>`; Kubernetes: both containers in one pod with "
            "`shareProcessNamespace: true`), or use devipc.p2p's Endpoint(transport='nixl')"
        )
    raise InvalidHandleError(
        f"this {what} was made by process {pid} {where}: its memory "
        f"cannot be opened from here through /proc/{pid}/fd. To share, {fix}"
    )


class WordTable:
    """The layout of devipc's shared word files (counter slots, arena records, the p2p registry
    page): a 64-byte header of int64 words, then records of `fields` int64 words each. Loads and
    stores of a word are single aligned instructions; a record's bytes are its lock range."""

    HEADER = 64

    __slots__ = ("mapping", "fields", "_words")

    def __init__(self, mapping: MappedFile, fields: int):
        self.mapping, self.fields = mapping, fields
        self._words = mapping.words

    def load(self, record: int, field: int = 0) -> int:
        return self._words[self.HEADER // 8 + self.fields * record + field]

    def store(self, record: int, field: int, value: int) -> None:
        self._words[self.HEADER // 8 + self.fields * record + field] = value

    def load_header(self, index: int = 0) -> int:
        return self._words[index]

    def store_header(self, index: int, value: int) -> None:
        self._words[index] = value

    @classmethod
    def size(cls, records: int, fields: int) -> int:
        return cls.HEADER + 8 * fields * records

    def lock_range(self, record: int) -> tuple[int, int]:
        """(start, length) of a record's bytes in the file."""
        return self.HEADER + 8 * self.fields * record, 8 * self.fields


def handle_pid(handle: bytes) -> int:
    """The pid a well-formed handle names (the process that owns the memfd)."""
    return struct.unpack_from(_FORMAT, handle)[2]


def producer_alive(handle: bytes) -> bool:
    """Whether the process that a well-formed handle names still lives."""
    return pid_alive(handle_pid(handle))


def _memfd_name(magic: bytes, token: bytes) -> str:
    return f"devipc-{magic.decode()}-{token.hex()}"


def _peer_gone(pid: int, what: str) -> PeerGoneError:
    return PeerGoneError(
        f"process {pid} that made this {what} has exited; a process must "
        f"stay alive until what it sends is opened"
    )


def pid_exists(pid: int) -> bool:
    """Whether `pid` names a process, a zombie included: one system call, no /proc read."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, another user's
    return True


def pid_alive(pid: int) -> bool:
    """Exists and is not a zombie or dying (state Z or X): an exited process holds no fds even
    before its parent reaps it, while kill(pid, 0) still succeeds on it."""
    if not pid_exists(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            line = stat.read()
    except OSError:
        return True  # no procfs view: trust kill()
    # The state follows the command name, which may itself hold spaces and parentheses.
    return line[line.rfind(b")") + 2 :][:1] not in (b"Z", b"X")
