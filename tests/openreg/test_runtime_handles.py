"""The openreg runtime's side of docs/ipc-handles.md: a zombie exporter is gone, only the exact
memfd name is opened, a denied open names the rules, a forged event handle is refused instead of
waited on, a forged device field is an invalid handle. The core's side is in test_memfd.py.
"""

import json
import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time

import _native as native
import pytest
from _support import FRESH_TIMEOUT, TIMEOUT, fresh_env, run_python, zombie_child

from devipc import InvalidHandleError, PeerGoneError
from devipc_openreg import _runtime as rt

# HandleData: magic, version, kind, pid, fd, size, physical, slot, epoch, token, 12 zero bytes.
LAYOUT = "=IHHiiQiiI16s12x"
MEMORY, EVENT = 1, 2
SLOT_LAYOUT = "=IIQ"  # an event page's slot: epoch, completed, latest (recorder pid << 32 | seq)
SLOTS = 8192
PAGE_BYTES = SLOTS * struct.calcsize(SLOT_LAYOUT)
SLOT_AT = 28  # offset of slot (i32) and epoch (u32) in a handle


def test_the_layout_matches_a_real_handle():
    p = native.malloc(4096, 0)
    try:
        handle, _ = rt.ipc_get_mem_handle(p)
        assert struct.calcsize(LAYOUT) == len(handle) == rt.IPC_HANDLE_SIZE
        magic, version, kind, pid, _fd, size, physical, slot, _epoch, _token = struct.unpack(
            LAYOUT, handle
        )
        assert (handle[:4], version, kind, pid, physical, slot) == (
            b"ORIP",
            1,
            MEMORY,
            os.getpid(),
            0,
            -1,
        )
        assert size % 4096 == 0
    finally:
        native.free(p)


PRODUCERS = {
    "memory": "import _native as native\n"
    "from devipc_openreg import _runtime as rt\n"
    "print(rt.ipc_get_mem_handle(native.malloc(4096, 0))[0].hex())",
    "event": "from devipc_openreg import _runtime as rt\n"
    "print(rt.ipc_get_event_handle(rt.event_create(True, False)).hex())",
}


@pytest.mark.parametrize("kind", PRODUCERS)
def test_handle_of_an_exited_but_unreaped_producer_says_peer_gone(kind):
    # A zombie still answers kill(pid, 0), but its fds are closed: it is gone.
    with zombie_child(PRODUCERS[kind], PYTHONPATH=native.PYTHONPATH) as (pid, out):
        handle = bytes.fromhex(out.split()[-1])
        assert struct.unpack(LAYOUT, handle)[3] == pid
        open_handle = rt.ipc_open_mem_handle if kind == "memory" else rt.ipc_open_event_handle
        with pytest.raises(PeerGoneError, match=f"process {pid} .* has exited"):
            open_handle(handle)


def forged(kind, fd, size, token, physical=0):
    slot, epoch = (-1, 0) if kind == MEMORY else (0, 1)  # an event: slot 0, first epoch
    return struct.pack(
        LAYOUT,
        0x5049524F,
        1,
        kind,
        os.getpid(),
        fd,
        size,
        physical if kind == MEMORY else -1,
        slot,
        epoch,
        token,
    )


# (handle kind, what its fd is, that file's name); {hex} is the forged handle's token.
DECOYS = [
    (MEMORY, "file", "{hex}"),
    (MEMORY, "file", "openreg:0:{hex}"),
    (MEMORY, "file", "memfd:openreg:0:{hex} (deleted)"),  # its link name ends like a memfd's
    (MEMORY, "deleted file", "openreg:0:{hex}"),
    (MEMORY, "memfd", "openreg:0:{hex} x"),  # a prefix match with a space after it
    (MEMORY, "memfd", "openreg:0:{hex}0"),
    (MEMORY, "memfd", "openreg:1:{hex}"),  # another device's segment
    (MEMORY, "memfd", "openreg:progress:{hex}"),  # an event page as memory
    (MEMORY, "memfd", "devipc-TEST-{hex}"),  # the core's kind of file
    (EVENT, "memfd", "openreg:0:{hex}"),  # a segment as an event page
    (EVENT, "file", "openreg:progress:{hex}"),
]


def decoy(tmp_path, what, name, size):
    """An fd of this process (the forged handle's producer) whose name carries the token."""
    if what == "memfd":
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return fd
    path = tmp_path / name
    path.write_bytes(bytes(size))
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    if what == "deleted file":
        path.unlink()
    return fd


@pytest.mark.parametrize("kind, what, name", DECOYS)
def test_only_the_exact_memfd_name_is_opened(tmp_path, kind, what, name):
    token = os.urandom(16)
    name = name.format(hex=token.hex())
    size = 4096 if kind == MEMORY else PAGE_BYTES
    fd = decoy(tmp_path, what, name, size)
    try:
        handle = forged(kind, fd, size, token)
        open_handle = rt.ipc_open_mem_handle if kind == MEMORY else rt.ipc_open_event_handle
        with pytest.raises(InvalidHandleError, match="forged or stale"):
            open_handle(handle)
        with open("/proc/self/maps") as maps:
            assert name not in maps.read()
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", [MEMORY, EVENT])
def test_the_exact_memfd_name_is_opened(kind):
    """The control for the decoys above: the same forging with the right name maps."""
    token = os.urandom(16)
    tag = "0" if kind == MEMORY else "progress"
    size = 4096 if kind == MEMORY else PAGE_BYTES
    fd = os.memfd_create(f"openreg:{tag}:{token.hex()}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        if kind == MEMORY:
            base, got_size, device = rt.ipc_open_mem_handle(forged(kind, fd, size, token))
            assert (got_size, device) == (size, 0)
            rt.ipc_close_mem_handle(base)
        else:
            os.pwrite(fd, struct.pack("=I", 1), 0)  # slot 0 handed out, at epoch 1
            rt.event_destroy(rt.ipc_open_event_handle(forged(kind, fd, size, token)))
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a consumer as another user")
def test_a_consumer_of_another_user_is_told_the_rules():
    p = native.malloc(4096, 0)
    try:
        handle, _ = rt.ipc_get_mem_handle(p)
        out = run_python(f"""
import os
from devipc import InvalidHandleError
from devipc_openreg import _runtime as rt
rt.device_count()
os.setgid(65534)
os.setuid(65534)
try:
    rt.ipc_open_mem_handle(bytes.fromhex("{handle.hex()}"))
except InvalidHandleError as error:
    print(error)
""").stdout
        assert "permission denied" in out and "same user" in out and "dumpable" in out
    finally:
        native.free(p)


# ---- event pages: what a handle may name ------------------------------------------------------
def slot_epoch(handle):
    return struct.unpack_from("=iI", handle, SLOT_AT)


def with_slot_epoch(handle, slot, epoch):
    forged = bytearray(handle)
    struct.pack_into("=iI", forged, SLOT_AT, slot, epoch)
    return bytes(forged)


def read_slot(fd, slot):
    with (
        open(f"/proc/self/fd/{fd}", "rb") as page,
        mmap.mmap(page.fileno(), PAGE_BYTES, prot=mmap.PROT_READ) as m,
    ):
        return struct.unpack_from(SLOT_LAYOUT, m, struct.calcsize(SLOT_LAYOUT) * slot)


def test_the_page_holds_the_event_state():
    """The layout of docs/ipc-handles.md, read from this process's own page."""
    stream = native.stream_create(0)
    ev = rt.event_create(interprocess=True, timing=False)
    try:
        handle = rt.ipc_get_event_handle(ev)
        _, _, _, pid, fd, size, _, slot, epoch, _ = struct.unpack(LAYOUT, handle)
        assert (pid, size) == (os.getpid(), PAGE_BYTES) and 0 <= slot < SLOTS and epoch % 2 == 1
        _, completed, latest = read_slot(fd, slot)
        assert latest & 0xFFFFFFFF == completed  # a slot's values only grow, even when reused
        for _ in range(2):
            rt.event_record(ev, stream)
        native.stream_synchronize(stream)
        assert rt.ipc_get_event_handle(ev) == handle  # the handle names the event, not a record
        now_epoch, now_completed, now_latest = read_slot(fd, slot)
        assert (now_epoch, now_latest >> 32) == (epoch, os.getpid())
        assert now_latest & 0xFFFFFFFF == now_completed == (latest & 0xFFFFFFFF) + 2
    finally:
        rt.event_destroy(ev)
        native.stream_destroy(stream)
    assert read_slot(fd, slot)[0] == epoch + 1  # even: free, once its records have run


# A fresh exporter: stream 1 records event A three times, stream 2 records B once; C is destroyed
# after its handle was taken. Then it stays alive, so a waiter on a record that never comes would
# wait until killed.
EVENT_PRODUCER = """
import json, time
import _native as native
from devipc_openreg import _runtime as rt
s1, s2 = native.stream_create(0), native.stream_create(0)
a, b, c = (rt.event_create(interprocess=True, timing=False) for _ in range(3))
for _ in range(3):
    rt.event_record(a, s1)
rt.event_record(b, s2)
rt.event_record(c, s2)
native.device_synchronize(0)
handles = [rt.ipc_get_event_handle(e).hex() for e in (a, b, c)]
rt.event_destroy(c)
print(json.dumps(handles), flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def exported_events():
    """(handles of A, B, C) of a live exporter running EVENT_PRODUCER."""
    proc = subprocess.Popen(
        [sys.executable, "-c", EVENT_PRODUCER],
        env=fresh_env(PYTHONPATH=native.PYTHONPATH),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], FRESH_TIMEOUT)
        line = proc.stdout.readline() if ready else ""
        assert line, f"the exporter printed no handles: {proc.poll()=}"
        yield tuple(bytes.fromhex(h) for h in json.loads(line))
    finally:
        proc.send_signal(signal.SIGKILL)  # also releases any waiter a regression left behind
        proc.wait(FRESH_TIMEOUT)


def open_and_wait(handle, timeout=TIMEOUT):
    """Opens an event handle, makes a stream wait on it and synchronizes that stream, in a thread:
    returns what it raised (None if nothing) and the seconds it took; fails if it does not end
    within `timeout` instead of hanging the suite."""
    outcome = []

    def run():
        start = time.monotonic()
        try:
            event = rt.ipc_open_event_handle(handle)
            stream = native.stream_create(0)
            try:
                rt.stream_wait_event(stream, event)
                native.stream_synchronize(stream)
            finally:
                native.stream_destroy(stream)
                rt.event_destroy(event)
            outcome.append((None, time.monotonic() - start))
        except Exception as error:  # noqa: BLE001 - returned, for the test to check
            outcome.append((error, time.monotonic() - start))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"opening and waiting on the handle did not end within {timeout} s"
    return outcome[0]


def test_genuine_event_handles_are_waited_on(exported_events):
    a, b, c = exported_events
    assert (slot_epoch(a), slot_epoch(b), slot_epoch(c)) == ((0, 1), (1, 1), (2, 1))
    for handle in (a, b, c):  # c: destroyed by its creator, so there is nothing to wait for
        assert open_and_wait(handle)[0] is None
    retired = rt.ipc_open_event_handle(c)
    try:
        with pytest.raises(rt.OpenRegError, match="destroyed this interprocess event"):
            rt.event_record(retired, None)
    finally:
        rt.event_destroy(retired)


@pytest.mark.parametrize(
    "slot, epoch, message",
    [
        (0, 3, "only at epoch 1"),  # a later epoch of A's slot
        (0, 1001, "only at epoch 1"),
        (2, 3, "only at epoch 2"),  # C's slot: freed, not handed out again
        (3, 1, "never handed out event slot 3"),  # the next free slot
        (SLOTS - 1, 1, "never handed out"),
        (0, 0, "corrupted"),  # live epochs are odd
        (0, 2, "corrupted"),
        (-1, 1, "corrupted"),
        (SLOTS, 1, "corrupted"),
    ],
    ids=[
        "epoch+2",
        "epoch+1000",
        "freed slot",
        "next free slot",
        "last slot",
        "epoch 0",
        "even epoch",
        "slot -1",
        "slot past the page",
    ],
)
def test_forged_event_handles_are_refused_before_waiting(exported_events, slot, epoch, message):
    a, _, _ = exported_events
    error, seconds = open_and_wait(with_slot_epoch(a, slot, epoch))
    assert isinstance(error, InvalidHandleError), error
    assert message in str(error)
    assert seconds < 5


# ---- memory handles: the device field ---------------------------------------------------------
@pytest.mark.parametrize("physical", [-1, 2, 1000, 2**31 - 1])
def test_a_forged_device_field_is_an_invalid_handle(physical):
    # 2 and up are no device here (2 visible); the memfd's name says which device it really is.
    p = native.malloc(4096, 0)
    try:
        handle = bytearray(rt.ipc_get_mem_handle(p)[0])
        struct.pack_into("=i", handle, 24, physical)
        with pytest.raises(InvalidHandleError):
            rt.ipc_open_mem_handle(bytes(handle))
    finally:
        native.free(p)


# ---- what may be passed as a handle -----------------------------------------------------------
@pytest.mark.parametrize(
    "handle",
    [[0] * 64, "x" * 64, None, 64, b"\0" * 63, bytearray(65), memoryview(b"\0" * 63)],
    ids=["list", "str", "None", "int", "63 bytes", "65 bytes", "short view"],
)
@pytest.mark.parametrize(
    "open_handle", [rt.ipc_open_mem_handle, rt.ipc_open_event_handle], ids=["memory", "event"]
)
def test_anything_but_handle_bytes_is_an_invalid_handle(open_handle, handle):
    with pytest.raises(InvalidHandleError, match="is 64 bytes"):
        open_handle(handle)


@pytest.mark.parametrize("as_type", [bytearray, memoryview], ids=["bytearray", "memoryview"])
def test_handles_open_from_bytearray_and_memoryview(as_type):
    p = native.malloc(4096, 0)
    ev = rt.event_create(interprocess=True, timing=False)
    try:
        base, size, device = rt.ipc_open_mem_handle(as_type(rt.ipc_get_mem_handle(p)[0]))
        device_of_p, _, size_of_p, _ = native.pointer_attributes(p)
        assert (size, device) == (size_of_p, device_of_p)
        rt.ipc_close_mem_handle(base)
        rt.event_destroy(rt.ipc_open_event_handle(as_type(rt.ipc_get_event_handle(ev))))
    finally:
        rt.event_destroy(ev)
        native.free(p)


# ---- fork -------------------------------------------------------------------------------------
USE_AFTER_FORK = """
import json, os, torch
torch.ones(4, device="openreg")  # the parent uses the device
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read)
    try:
        torch.ones(4, device="openreg")
        outcome = ["no error", ""]
    except BaseException as error:
        outcome = [type(error).__name__, str(error)]
    os.write(write, json.dumps(outcome).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read) as pipe:
    outcome = pipe.read()
os.waitpid(pid, 0)
print(outcome)
"""


def test_a_forked_child_is_told_to_use_spawn():
    error_type, message = json.loads(run_python(USE_AFTER_FORK).stdout.splitlines()[-1])
    assert error_type != "OutOfMemoryError", message
    assert error_type == "RuntimeError", message
    assert (
        "Cannot re-initialize openreg in forked subprocess. To use openreg with "
        "multiprocessing, you must use the 'spawn' start method" in message
    )
