import os
import struct

import _workers
import pytest
from _support import TIMEOUT, open_fds

from devipc import InvalidHandleError, PeerGoneError
from devipc._memfd import HANDLE_SIZE, SharedFile, open_shared_file


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


@pytest.mark.parametrize("bad", [b"", b"x" * (HANDLE_SIZE - 1), os.urandom(HANDLE_SIZE), "text"])
def test_malformed_handles_are_refused(bad):
    with pytest.raises(InvalidHandleError):
        open_shared_file(bad, b"TEST")


def test_wrong_token_or_kind_is_refused():
    shared = SharedFile(b"TEST", 4096)
    try:
        magic, version, pid, fd, size, token = struct.unpack("<4sHiiQ16s", shared.handle)
        forged = struct.pack("<4sHiiQ16s", magic, version, pid, fd, size, bytes(16))
        with pytest.raises(InvalidHandleError, match="stale or forged"):
            open_shared_file(forged, b"TEST")
        with pytest.raises(InvalidHandleError, match="not a devipc"):
            open_shared_file(shared.handle, b"RCNT")
    finally:
        shared.close()


def test_handle_of_an_exited_process_says_peer_gone():
    shared = SharedFile(b"TEST", 4096)
    try:
        magic, version, _pid, fd, size, token = struct.unpack("<4sHiiQ16s", shared.handle)
        dead = _exited_pid()
        handle = struct.pack("<4sHiiQ16s", magic, version, dead, fd, size, token)
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
