import os
import random
import socket
import struct

import _workers
import pytest
from _support import TIMEOUT, open_fds, run_python, zombie_child

from devipc import InvalidHandleError, PeerGoneError
from devipc._core._memfd import (
    HANDLE_SIZE,
    VERSION,
    SharedFile,
    WordTable,
    open_shared_file,
    reach_tag,
)

_FORMAT = "<4sHiiQ16s"  # docs/ipc-handles.md


def test_peer_maps_the_same_memory(children):
    shared = SharedFile(b"TEST", 4096)
    try:
        done = children.ctx.Queue()
        children.start(_workers.write_shared_file, shared.handle, b"TEST", done)
        assert done.get(timeout=TIMEOUT) == "ok"
        children.join_ok()
        assert shared.buffer.bytes(0, 5) == b"HELLO"
    finally:
        shared.close()


def test_close_is_idempotent_and_releases_the_fd():
    before = open_fds()
    shared = SharedFile(b"TEST", 4096)
    assert open_fds() == before + 1
    shared.close()
    shared.close()
    assert open_fds() == before
    assert "closed" in repr(shared)


_NOISE = random.Random(7).randbytes(HANDLE_SIZE)  # the same in every run (and xdist worker)


@pytest.mark.parametrize(
    "bad", [b"", b"x" * (HANDLE_SIZE - 1), _NOISE, "text"], ids=["empty", "short", "noise", "str"]
)
def test_malformed_handles_are_refused(bad):
    with pytest.raises(InvalidHandleError):
        open_shared_file(bad, b"TEST")


def test_wrong_token_or_kind_is_refused():
    shared = SharedFile(b"TEST", 4096)
    try:
        magic, version, pid, fd, size, token = struct.unpack(_FORMAT, shared.handle)
        forged = struct.pack(_FORMAT, magic, version, pid, fd, size, bytes(16))
        with pytest.raises(InvalidHandleError, match="stale or forged"):
            open_shared_file(forged, b"TEST")
        with pytest.raises(InvalidHandleError, match="not a devipc"):
            open_shared_file(shared.handle, b"RCNT")
    finally:
        shared.close()


def test_handle_of_an_exited_process_says_peer_gone():
    shared = SharedFile(b"TEST", 4096)
    try:
        magic, version, _pid, fd, size, token = struct.unpack(_FORMAT, shared.handle)
        dead = _exited_pid()
        handle = struct.pack(_FORMAT, magic, version, dead, fd, size, token)
        with pytest.raises(PeerGoneError, match="has exited"):
            open_shared_file(handle, b"TEST")
    finally:
        shared.close()


def _exited_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_handle_of_an_exited_but_unreaped_producer_says_peer_gone():
    # A zombie still answers kill(pid, 0), but its fds are closed: it is gone, not "another user".
    code = (
        "from devipc._core._memfd import SharedFile; print(SharedFile(b'TEST', 4096).handle.hex())"
    )
    with zombie_child(code) as (pid, out):
        handle = bytes.fromhex(out.split()[-1])
        assert struct.unpack(_FORMAT, handle)[2] == pid
        with pytest.raises(PeerGoneError, match=f"process {pid} .* has exited"):
            open_shared_file(handle, b"TEST")


# (what the forged handle's fd is, its name); {hex} is the token of the forged handle.
DECOYS = [
    ("file", "{hex}"),
    ("file", "devipc-TEST-{hex}"),
    ("file", "memfd:devipc-TEST-{hex} (deleted)"),  # its link name ends like a memfd's
    ("deleted file", "devipc-TEST-{hex}"),
    ("memfd", "devipc-RCNT-{hex}"),  # the right token as another kind of file
    ("memfd", "devipc-TEST-{hex}-x"),
    ("memfd", "x-devipc-TEST-{hex}"),
]


@pytest.mark.parametrize("what, name", DECOYS)
def test_only_the_exact_memfd_name_is_opened(tmp_path, what, name):
    token = reach_tag() + os.urandom(8)
    name = name.format(hex=token.hex())
    if what == "memfd":
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, 4096)
    else:
        path = tmp_path / name
        path.write_bytes(bytes(4096))
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        if what == "deleted file":
            path.unlink()
    try:
        forged = struct.pack(_FORMAT, b"TEST", VERSION, os.getpid(), fd, 4096, token)
        before = open_fds()
        with pytest.raises(InvalidHandleError, match="stale or forged"):
            open_shared_file(forged, b"TEST")
        assert open_fds() == before
        with open("/proc/self/maps") as maps:
            assert name not in maps.read()  # never mapped, not even for a moment that leaked
    finally:
        os.close(fd)


def test_the_exact_memfd_name_is_opened():
    """The control for the decoys above: the same forging with the right name maps."""
    token = reach_tag() + os.urandom(8)
    fd = os.memfd_create(f"devipc-TEST-{token.hex()}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4096)
        handle = struct.pack(_FORMAT, b"TEST", VERSION, os.getpid(), fd, 4096, token)
        mapping = open_shared_file(handle, b"TEST")
        mapping.write(0, b"abc")
        assert os.pread(fd, 3, 0) == b"abc"
        mapping.close()
    finally:
        os.close(fd)


def test_an_fd_that_is_no_file_is_an_invalid_handle():
    a, b = socket.socketpair()
    with a, b:
        forged = struct.pack(
            _FORMAT, b"TEST", VERSION, os.getpid(), a.fileno(), 4096, reach_tag() + os.urandom(8)
        )
        with pytest.raises(InvalidHandleError, match="forged or stale"):
            open_shared_file(forged, b"TEST")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a consumer as another user")
def test_a_consumer_of_another_user_is_told_the_rules():
    shared = SharedFile(b"TEST", 4096)
    try:
        out = run_python(f"""
import os
import random
from devipc import InvalidHandleError
from devipc._core._memfd import open_shared_file
os.setgid(65534)
os.setuid(65534)
try:
    open_shared_file(bytes.fromhex("{shared.handle.hex()}"), b"TEST")
except InvalidHandleError as error:
    print(error)
""").stdout
        assert "permission denied" in out and "same user" in out and "dumpable" in out
    finally:
        shared.close()


def test_a_word_table_lays_records_after_its_header():
    shared = SharedFile(b"TEST", WordTable.size(3, 2))
    try:
        table = WordTable(shared.buffer, 2)
        assert shared.buffer.size == 64 + 3 * 16
        table.store_header(0, -1)
        table.store(2, 1, 7)
        assert shared.buffer.int64(0).value == -1 and shared.buffer.int64(8 + 5).value == 7
        assert table.load_header(0) == -1 and table.load(2, 1) == 7
        assert table.lock_range(2) == (64 + 32, 16)
    finally:
        shared.close()
    with pytest.raises(ValueError):
        table.load(2, 1)  # never a load from unmapped memory


@pytest.mark.parametrize("flip, where", [(0, "another host"), (4, "another PID namespace")])
def test_a_handle_made_out_of_reach_says_where_and_how_to_fix_it(flip, where):
    shared = SharedFile(b"TEST", 4096)
    try:
        magic, version, pid, fd, size, token = struct.unpack(_FORMAT, shared.handle)
        assert token[:8] == reach_tag() and any(token[:8])
        moved = bytearray(token)
        moved[flip] ^= 0xFF
        handle = struct.pack(_FORMAT, magic, version, pid, fd, size, bytes(moved))
        before = open_fds()
        with pytest.raises(InvalidHandleError, match=f"{where}.*Endpoint\\(transport='nixl'\\)"):
            open_shared_file(handle, b"TEST")
        assert open_fds() == before
    finally:
        shared.close()
