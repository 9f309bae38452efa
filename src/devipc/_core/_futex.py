"""Sleeping on a word of shared memory until another process changes it (Linux futexes).

A futex on a MAP_SHARED mapping is keyed by the file and offset, so processes that map the same
memfd wait and wake on the same word: a waiter costs no CPU, and a wake costs one system call.
The 32-bit futex word is the low half of one of devipc's aligned int64 words (little-endian), so
a counter that only grows changes it at every step. Where futexes are missing (not Linux, an
unknown architecture) a wait is a millisecond's sleep: callers poll.
"""

import ctypes
import errno
import os
import platform
import sys
import time

__all__ = ["available", "wait", "wake"]

_SYSCALL = {"x86_64": 202, "aarch64": 98, "riscv64": 98, "ppc64le": 221, "s390x": 238}
_WAIT, _WAKE = 0, 1  # FUTEX_WAIT, FUTEX_WAKE, not the private variants: other processes wake us
_LITTLE = sys.byteorder == "little"


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_NUMBER = _SYSCALL.get(platform.machine(), -1) if sys.platform == "linux" and _LITTLE else -1
_libc = ctypes.CDLL(None, use_errno=True) if _NUMBER >= 0 else None


def available() -> bool:
    return _libc is not None


def _low(value: int) -> int:
    """The futex word's view of an int64 value: its low 32 bits, signed."""
    low = value & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


def wait(address: int, seen: int, timeout: float | None) -> None:
    """Sleep while the int64 at `address` still holds `seen`, at most `timeout` seconds (None:
    no bound); returns early on a wake, a change, or a signal: callers re-read and loop."""
    if not available():
        time.sleep(0.001 if timeout is None else min(0.001, max(0.0, timeout)))
        return
    spec = None
    if timeout is not None:
        seconds = max(0.0, timeout)
        spec = ctypes.byref(_Timespec(int(seconds), int((seconds % 1) * 1e9)))
    assert _libc is not None
    result = _libc.syscall(
        ctypes.c_long(_NUMBER),
        ctypes.c_void_p(address),
        _WAIT,
        ctypes.c_int(_low(seen)),
        spec,
        None,
        0,
    )
    if result == -1:
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(code, f"futex wait failed: {os.strerror(code)}")


def wake(address: int) -> None:
    """Wake every process sleeping on the int64 at `address` (after changing it)."""
    if available():
        assert _libc is not None
        _libc.syscall(
            ctypes.c_long(_NUMBER),
            ctypes.c_void_p(address),
            _WAKE,
            ctypes.c_int(0x7FFFFFFF),
            None,
            None,
            0,
        )
