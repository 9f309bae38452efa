"""NIXL transfers let go of in flight (issue 27, defect 4): whatever the caller drops, a transfer's
memory lives until NIXL is done with its request, and then goes. Each case runs in a spawned child
(a crash is its exit code), with transfers large enough to be in flight when dropped."""
import _nixl_inflight_workers as workers
import pytest
from _support import TIMEOUT, recv

try:
    from devipc.p2p._nixl import load_nixl

    load_nixl()
    NIXL = None
except ImportError as error:
    NIXL = str(error)

pytestmark = pytest.mark.skipif(NIXL is not None, reason=f"NIXL is not installed ({NIXL})")


@pytest.fixture
def loopback(monkeypatch):
    """UCX over TCP on the loopback device only (children inherit it), as between two hosts."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


def _outcome(children, target, rounds, nbytes):
    proc, conn = children.start_piped(target, rounds, nbytes)
    try:
        got = recv(conn, 2 * TIMEOUT)
    except EOFError:  # it crashed before it could answer
        got = None
    proc.join(TIMEOUT)
    assert proc.exitcode == 0, f"the child exited with {proc.exitcode}"
    return got


def test_a_transfer_dropped_after_its_wait_timed_out_keeps_its_memory_until_done(
        children, loopback):
    got = _outcome(children, workers.dropped_after_a_timeout, 4, 64 << 20)
    assert got["timed_out"] >= 1  # at least one was dropped in flight
    assert got["markers_intact"], "a dropped transfer wrote into memory reused since"
    assert got["settled"], "the dropped transfers' memory was not let go of once done"
    assert got["read_again"]


def test_ctrl_c_during_a_synchronous_read_keeps_its_memory_until_done(children, loopback):
    got = _outcome(children, workers.interrupted_read, 6, 128 << 20)
    assert got["interrupted"] >= 1  # at least one Ctrl-C came while the read was in flight
    assert got["latency"] < TIMEOUT / 120, "Ctrl-C waited for the transfer"
    assert got["markers_intact"], "an interrupted read wrote into memory reused since"
    assert got["settled"], "the interrupted reads' memory was not let go of once done"
    assert got["read_again"]
