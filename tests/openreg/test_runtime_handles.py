"""The openreg runtime's side of docs/ipc-handles.md: a zombie exporter is gone, only the exact
memfd name is opened, a denied open names the rules. The core's side is in test_memfd.py.
"""
import os
import struct

import pytest
from _support import run_python, zombie_child

from devipc import InvalidHandleError, PeerGoneError
from devipc_openreg import _runtime as rt

# HandleData: magic, version, kind, pid, fd, size, physical, slot, seq, token, 12 zero bytes.
LAYOUT = "=IHHiiQiiI16s12x"
MEMORY, EVENT = 1, 2
PAGE_BYTES = 16384  # an event handle's page


def test_the_layout_matches_a_real_handle():
    p = rt.malloc(4096, 0)
    try:
        handle, _ = rt.ipc_get_mem_handle(p)
        assert struct.calcsize(LAYOUT) == len(handle) == rt.IPC_HANDLE_SIZE
        magic, version, kind, pid, _fd, size, physical, slot, _seq, _token = \
            struct.unpack(LAYOUT, handle)
        assert (handle[:4], version, kind, pid, physical, slot) == \
            (b"ORIP", 1, MEMORY, os.getpid(), 0, -1)
        assert size % 4096 == 0
    finally:
        rt.free(p)


PRODUCERS = {
    "memory": "from devipc_openreg import _runtime as rt\n"
              "print(rt.ipc_get_mem_handle(rt.malloc(4096, 0))[0].hex())",
    "event": "from devipc_openreg import _runtime as rt\n"
             "print(rt.ipc_get_event_handle(rt.event_create(True, False)).hex())",
}


@pytest.mark.parametrize("kind", PRODUCERS)
def test_handle_of_an_exited_but_unreaped_producer_says_peer_gone(kind):
    # A zombie still answers kill(pid, 0), but its fds are closed: it is gone.
    with zombie_child(PRODUCERS[kind]) as (pid, out):
        handle = bytes.fromhex(out.split()[-1])
        assert struct.unpack(LAYOUT, handle)[3] == pid
        open_handle = rt.ipc_open_mem_handle if kind == "memory" else rt.ipc_open_event_handle
        with pytest.raises(PeerGoneError, match=f"process {pid} .* has exited"):
            open_handle(handle)


def forged(kind, fd, size, token, physical=0):
    slot = -1
    return struct.pack(LAYOUT, 0x5049524F, 1, kind, os.getpid(), fd, size,
                       physical if kind == MEMORY else -1, slot, 0, token)


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
            rt.event_destroy(rt.ipc_open_event_handle(forged(kind, fd, size, token)))
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a consumer as another user")
def test_a_consumer_of_another_user_is_told_the_rules():
    p = rt.malloc(4096, 0)
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
        rt.free(p)
