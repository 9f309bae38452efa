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
        children, loopback):
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
