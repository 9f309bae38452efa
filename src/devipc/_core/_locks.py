"""Byte-range locks that the kernel drops when their holder dies, however it dies.

Open-file-description (OFD) locks belong to one open of a file, not to a process: two opens of the
same memfd in one process exclude each other, and every lock of a process is released when it
exits, SIGKILL included. The ref-counter slots use them as liveness: a consumer holds a write lock
on its slot for as long as it holds what it was sent.
"""

import errno
import fcntl
import struct

# struct flock of Linux on 64-bit: l_type, l_whence, (pad), l_start, l_len, l_pid (0 for OFD
# locks), (pad).
_flock = struct.Struct("hhxxxxqqixxxx").pack


def try_lock(fd: int, start: int, length: int) -> bool:
    """Take a write lock on [start, start + length) without waiting; False if another holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, 0, start, length, 0))
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def lock(fd: int, start: int, length: int) -> None:
    """Take a write lock, waiting for its holder; only for locks held for a few instructions."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _flock(fcntl.F_WRLCK, 0, start, length, 0))


def unlock(fd: int, start: int, length: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, 0, start, length, 0))
