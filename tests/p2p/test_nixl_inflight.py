"""NIXL transfers let go of in flight (issue 27, defect 4): whatever the caller drops, a transfer's
memory lives until NIXL is done with its request, and then goes. Each case runs in a spawned child
(a crash is its exit code), with transfers large enough to be in flight when dropped."""

import _nixl_inflight_workers as workers
import pytest
from _support import nixl_missing, slowdown_now, use_ucx_loopback

NIXL = nixl_missing()
pytestmark = pytest.mark.skipif(NIXL is not None, reason=f"NIXL is not installed ({NIXL})")


@pytest.fixture
def loopback(monkeypatch):
    use_ucx_loopback(monkeypatch)


def test_a_transfer_dropped_after_its_wait_timed_out_keeps_its_memory_until_done(
    children, loopback
):
    got = children.answer(workers.dropped_after_a_timeout, 4, 64 << 20)
    assert got["timed_out"] >= 1  # at least one was dropped in flight
    assert got["markers_intact"], "a dropped transfer wrote into memory reused since"
    assert got["settled"], "the dropped transfers' memory was not let go of once done"
    assert got["read_again"]


def test_ctrl_c_during_a_synchronous_read_keeps_its_memory_until_done(children, loopback):
    got = children.answer(workers.interrupted_read, 6, 128 << 20)
    assert got["interrupted"] >= 1  # at least one Ctrl-C came while the read was in flight
    assert got["latency"] < slowdown_now() / 2, "Ctrl-C waited for the transfer"
    assert got["markers_intact"], "an interrupted read wrote into memory reused since"
    assert got["settled"], "the interrupted reads' memory was not let go of once done"
    assert got["read_again"]


def test_ctrl_c_lands_at_once_while_a_nixl_poll_sits_in_c(children, loopback):
    """Issue 53, item 1: a NIXL poll returns only once UCX handled what arrived (seconds, over
    TCP, for a large transfer): the waiting thread must not sit in one. Here the first poll of
    a 16 MiB read sits ~3 s in C, the signal comes 50 ms into it: KeyboardInterrupt within 0.5 s
    (on main's code, once the poll returned: seconds)."""
    got = children.answer(workers.ctrl_c_in_a_long_poll, 16 << 20)
    assert got["sat"] >= 1.0, got  # the poll sat long enough for the bound to tell
    assert got["latency"] is not None, "the read ended before the interrupt"
    assert got["latency"] < 0.5, f"KeyboardInterrupt {got['latency']:.2f} s after SIGINT: {got}"
    assert not got["main thread"], "the waiting thread polled the large transfer itself"
    assert got["settled"], "the interrupted read's memory was not let go of once done"
    assert got["read_again"]
