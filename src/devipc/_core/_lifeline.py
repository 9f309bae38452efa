"""A process's life as a word of shared memory, which peers read without a system call.

The owner puts a robust, process-shared pthread mutex in a page its peers map, and a thread of
its own locks it and then waits for the rest of the process's life. However the process ends
(exit, a signal, SIGKILL), the kernel goes through each dying thread's robust-futex list before
the process can be reaped, and marks the mutex's futex word: the holder's thread id gives way
to FUTEX_OWNER_DIED. So a peer learns whether the owner lives from one load, where it would
otherwise poll the owner's pidfd (a system call, most of a small copy's cost).

The futex word is the first 4 bytes of glibc's pthread_mutex_t. `hold` checks that once the
mutex is locked; where it does not hold (another C library, a big-endian machine) `hold`
returns 0, and peers poll the pidfd as before.
"""

import ctypes
import platform
import sys
import threading

__all__ = ["RESERVED", "TID_MASK", "hold"]

RESERVED = 48  # bytes; glibc's pthread_mutex_t: 40 (x86-64, riscv64, ppc64le, s390x), 48 (aarch64)
TID_MASK = 0x3FFFFFFF  # FUTEX_TID_MASK: the holder's thread id; the bits above it are flags
_SHARED = _ROBUST = 1  # PTHREAD_PROCESS_SHARED, PTHREAD_MUTEX_ROBUST
_MARK = int.from_bytes(b"lifeline", "little")
_SUPPORTED = (
    sys.platform == "linux" and sys.byteorder == "little" and platform.libc_ver()[0] == "glibc"
)


def hold(address: int, timeout: float = 10.0) -> int:
    """Lock a robust mutex made at `address` (RESERVED zeroed bytes of shared memory, 8-byte
    aligned, and 8 more that it uses during the call to check that the mutex fits in RESERVED)
    by a thread that then waits as long as this process lives: the thread's id, which
    the int64 word at `address` holds under TID_MASK until this process dies; 0 where that cannot
    be done here. A peer reads `word & TID_MASK == id` for "the process lives"."""
    if not _SUPPORTED:
        return 0
    try:
        libc = ctypes.CDLL(None)
        steps = (
            libc.pthread_mutexattr_init,
            libc.pthread_mutexattr_setpshared,
            libc.pthread_mutexattr_setrobust,
            libc.pthread_mutex_init,
            libc.pthread_mutex_lock,
        )
    except (OSError, AttributeError):  # a libc without robust shared mutexes: no lifeline
        return 0
    init_attr, set_shared, set_robust, init, lock = steps
    attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t: 4 bytes in glibc
    mutex = ctypes.c_void_p(address)
    after = ctypes.c_int64.from_address(address + RESERVED)
    after.value = _MARK  # a mutex larger than RESERVED would overwrite it
    failed = (
        init_attr(attr)
        or set_shared(attr, _SHARED)
        or set_robust(attr, _ROBUST)
        or init(mutex, attr)
    )
    fits = after.value == _MARK
    after.value = 0
    if failed or not fits:
        return 0
    locked = threading.Event()
    holders: list[int] = []

    def park() -> None:
        if lock(mutex) != 0:
            locked.set()
            return
        holders.append(threading.get_native_id())
        locked.set()
        threading.Event().wait()  # never set: the mutex is let go only by the process's end

    try:
        threading.Thread(target=park, name="devipc-lifeline", daemon=True).start()
    except RuntimeError:  # at interpreter shutdown
        return 0
    if not locked.wait(timeout) or not holders:
        return 0
    tid = holders[0]
    return tid if ctypes.c_int64.from_address(address).value & TID_MASK == tid else 0
