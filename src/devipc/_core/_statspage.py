"""Each devipc process's stats page: a 4 KiB memfd named "devipc-STAT-<token>" holding the JSON
of `devipc.stats()`, so that `devipc info --pid P` shows what P holds without attaching a
debugger to it: a process of the same user reads the page through /proc/P/fd.

The collector thread rewrites it (`publish`) at most once a second while it has work, and on the
round that finds none left; a send or an open never touches it. The page dies with the process
(a memfd has no name in /dev/shm); a forked child makes its own.
"""

import functools
import json
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable

from ._memfd import SharedFile

__all__ = [
    "LINK_PREFIX",
    "BadStatsPageError",
    "StatsPageError",
    "find_pages",
    "publish",
    "read_page",
    "start",
]

MAGIC = b"STAT"
LINK_PREFIX = "/memfd:devipc-STAT-"  # how the page reads in /proc/<pid>/fd
_LINK = re.compile(re.escape(LINK_PREFIX) + r"[0-9a-f]{32} \(deleted\)")
PAGE_BYTES = 4096
HEADER = 16  # int64 sequence number (odd while a write is under way), int64 length of the JSON
INTERVAL = 1.0  # seconds between rewrites while the collector has work

_lock = threading.Lock()
_page: SharedFile | None = None
_numbers: Callable[[], dict] = dict
_started = _written = 0.0


class StatsPageError(LookupError):
    """A process's stats page cannot be read; the message says why and what to do."""


class BadStatsPageError(StatsPageError):
    """A process holds a file named like a stats page that is not one devipc wrote: any process
    can name a memfd so, or make a FIFO's path read so (in its own mount namespace)."""


def start(numbers: Callable[[], dict]) -> None:
    """Make this process's page and write `numbers()` into it (once, at import)."""
    global _numbers
    _numbers = numbers
    _renew()
    publish(settled=True)
    os.register_at_fork(after_in_child=_renew)


def _renew() -> None:
    """A new page for this process: a forked child must not write over its parent's. It shows
    no numbers until the child's collector runs (another thread may have held a lock of theirs
    at the fork)."""
    global _page, _started, _lock
    _lock = threading.Lock()
    if _page is not None:
        _page.close()
    try:
        _page = SharedFile(MAGIC, PAGE_BYTES)
    except OSError:  # no memfd here: devipc cannot share either, `devipc doctor` says so
        _page = None
    _started = time.time()
    _write(None)


def publish(settled: bool = False) -> None:
    """Rewrite the page with the current numbers: when `settled` (nothing pending any more), or
    when the last write is INTERVAL old."""
    global _written
    now = time.monotonic()
    if _page is not None and (settled or now - _written >= INTERVAL):
        _written = now
        _write(_numbers())


def _write(numbers: dict | None) -> None:
    if _page is None:
        return
    with _lock:
        page = {"pid": os.getpid(), "started": _started, "updated": time.time(), "stats": numbers}
        body = json.dumps(page).encode()
        if len(body) > PAGE_BYTES - HEADER:
            page["stats"] = {"error": f"{len(body)} bytes do not fit"}
            body = json.dumps(page).encode()
        sequence, length = _page.buffer.int64(0), _page.buffer.int64(1)
        sequence.value += 1  # odd: a reader retries
        length.value = len(body)
        _page.buffer.write(HEADER, body)
        sequence.value += 1


def read_page(pid: int) -> dict:
    """The page of process `pid` (its `stats`, `updated`, `started`), read through /proc;
    StatsPageError saying why not."""
    fds = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fds)
    except FileNotFoundError:
        raise StatsPageError(
            f"no process {pid} here: it exited, or it runs in another PID namespace (another "
            f"container: this /proc shows only this namespace's processes); run `devipc info` "
            f"in its container, or share the namespace (docker run --pid=host)"
        ) from None
    except PermissionError:
        raise StatsPageError(_denied(pid, fds)) from None
    refused = ""
    for name in names:
        try:
            link = os.readlink(f"{fds}/{name}")
            if not link.startswith(LINK_PREFIX):
                continue
            return _read_candidate(pid, f"{fds}/{name}", link)
        except PermissionError:
            raise StatsPageError(_denied(pid, fds)) from None
        except OSError:
            continue  # closed meanwhile, or the process exited
        except BadStatsPageError as error:
            refused = str(error)  # another fd may still be the genuine page
    if refused:
        raise BadStatsPageError(refused)
    raise StatsPageError(
        f"process {pid} has no devipc stats page: it has not imported devipc "
        f"(or a devipc older than its stats pages)"
    )


def _read_candidate(pid: int, path: str, link: str) -> dict:
    """The page behind `path`, once it is known to be a memfd of a page's size: never opens what
    could block (a FIFO, a file of a FUSE mount), never trusts the bytes."""

    def bad(why: str) -> BadStatsPageError:
        return BadStatsPageError(
            f"process {pid} holds a file named like a devipc stats page "
            f"that cannot be read as one ({why}): a forged page, or one "
            f"of another devipc version"
        )

    if not _LINK.fullmatch(link):
        raise bad(f"{link!r} is not a page's name")
    if _mount_id(path.replace("/fd/", "/fdinfo/")) != _memfd_identity()[1]:
        raise bad("not a memfd")  # asked of /proc alone: nothing of the file's own is run
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        found = os.fstat(fd)
        if os.readlink(f"/proc/self/fd/{fd}") != link:
            raise FileNotFoundError  # the fd number was reused meanwhile
        if not stat.S_ISREG(found.st_mode) or found.st_dev != _memfd_identity()[0]:
            raise bad("not a memfd")
        if found.st_size != PAGE_BYTES:
            raise bad(f"{found.st_size} bytes, a page has {PAGE_BYTES}")
        page, why = _parse(fd)
    finally:
        os.close(fd)
    if why:
        raise bad(why)
    return page


@functools.cache
def _memfd_identity() -> tuple[int, int]:
    """(st_dev, mount id) that every memfd has: all are files of one kernel-internal mount."""
    try:
        probe = os.memfd_create("devipc-probe", os.MFD_CLOEXEC)
    except OSError as error:
        raise StatsPageError(
            f"no memfd here ({error.strerror}): no devipc process here has a "
            f"stats page; `devipc doctor` says what to fix"
        ) from None
    try:
        return os.fstat(probe).st_dev, _mount_id(f"/proc/self/fdinfo/{probe}")
    finally:
        os.close(probe)


def _mount_id(fdinfo: str) -> int:
    with open(fdinfo) as lines:
        for line in lines:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    return -1


def _parse(fd: int) -> tuple[dict, str]:
    """The page's JSON, or why the bytes are not a page."""
    for _ in range(1000):  # a write takes microseconds: retry while one is under way
        data = os.pread(fd, PAGE_BYTES, 0)
        sequence = int.from_bytes(data[:8], "little")
        length = int.from_bytes(data[8:16], "little")
        if sequence % 2 == 0 and int.from_bytes(os.pread(fd, 8, 0), "little") == sequence:
            if not 0 < length <= PAGE_BYTES - HEADER:
                return {}, f"a length of {length} bytes"
            try:
                page = json.loads(data[HEADER : HEADER + length].decode())
            except (ValueError, RecursionError) as error:  # bad UTF-8 or JSON, absurd nesting
                return {}, f"no JSON: {str(error)[:80]}"
            return page, _shape_error(page)
        time.sleep(0.001)
    return {}, "it kept changing while read; try again"


# What a page's stats hold (`devipc.stats()` and the torch threads): counts, and one age in
# seconds. A page of a newer devipc may hold more; every one of these must be there.
_COUNTS = (
    "exports",
    "sent",
    "unopened",
    "counter_files",
    "mapped",
    "mapped_idle",
    "mapped_counter_files",
    "pending_releases",
    "buckets_shared",
    "bucket_tensors_shared",
    "torch_threads",
)
_SECONDS = ("oldest_unopened_s",)


def _number(value: object, count: bool = False) -> bool:
    """Whether a JSON value is a number devipc writes: finite (an int that fits a float), not a
    bool; a `count` is also a whole number, not negative."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or count
        and not isinstance(value, int)
    ):
        return False  # (JSON's true is a Python int)
    try:
        return math.isfinite(value) and (value >= 0 or not count)
    except OverflowError:  # an int no float holds
        return False


def _shape_error(page: object) -> str:
    """What in a parsed page is not as devipc writes it, or "": every key is read from bytes
    any process of the user could have written."""
    if not isinstance(page, dict):
        return f"a JSON {type(page).__name__}, not an object"
    if not _number(page.get("pid"), count=True):
        return "no number 'pid'"
    for key in ("started", "updated"):
        if not _number(page.get(key)):
            return f"no number {key!r}"
    if "stats" not in page:
        return "no 'stats'"
    stats = page["stats"]
    if stats is None:
        return ""
    if not isinstance(stats, dict):
        return "'stats' is not an object"
    if set(stats) == {"error"} and isinstance(stats["error"], str):
        return ""
    for keys, count in ((_COUNTS, True), (_SECONDS, False)):
        for key in keys:
            if not _number(stats.get(key), count):
                return f"stats {key!r} is {'missing' if key not in stats else 'not a number'}"
    return ""


def _denied(pid: int, path: str) -> str:
    owner = _uid_of(pid)
    who = (
        f"it runs as uid {owner}, you as uid {os.getuid()}"
        if owner not in (None, os.getuid())
        else "it is not dumpable (it changed user, or called prctl(PR_SET_DUMPABLE, 0))"
    )
    return (
        f"permission denied opening {path}: {who}. Run this as the user of process {pid} or "
        f"with CAP_SYS_PTRACE (sudo; in a container: --cap-add SYS_PTRACE). Yama's "
        f"ptrace_scope is not the cause: it limits attaching, not reading /proc/<pid>/fd"
    )


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        pass  # gone, or not ours to read: its owner is unknown
    return None


def find_pages() -> tuple[dict[int, dict], dict[int, str]]:
    """({pid: page} of every other process with a stats page that this one can read, {pid: why}
    of those holding a file named like a page that is not one)."""
    found, refused = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                found[int(entry)] = read_page(int(entry))
            except BadStatsPageError as error:
                refused[int(entry)] = str(error)
            except (StatsPageError, OSError):
                pass  # not ours to read, gone, or no devipc in it
    return found, refused
