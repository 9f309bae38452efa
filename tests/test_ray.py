"""devipc.ray with a real Ray: a local cluster of this machine's CPUs, actors that send openreg and
CPU tensors through the DEVIPC transport; the same-host path (zero-copy, writes seen both ways),
the path between hosts forced over NIXL on one machine, more receivers than an object's handles,
killed senders and receivers, and nothing left behind. Runs where Ray is installed (the README's
test command installs it)."""

import os

import pytest
from _support import TIMEOUT, use_ucx_loopback, wait_until

ray = pytest.importorskip("ray")

import devipc.ray  # noqa: E402
from devipc.ray import READERS  # noqa: E402

# one Ray cluster for the module, in one xdist worker
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def cluster():
    import devipc_openreg  # noqa: F401 - its hooks: "openreg" is among the transport's devices

    here = os.path.dirname(os.path.abspath(__file__))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
        )  # the actors' module, for Ray's workers
        use_ucx_loopback(patch)  # NIXL to this host only
        patch.setenv("RAY_AUTH_MODE", "disabled")  # a cluster of this test alone
        # Ray's own bound on an object's transfer (60 s) assumes an idle machine: a receiver's
        # first NIXL read (its agent, UCX, the connection) took longer in a loaded suite
        patch.setenv("RAY_rdt_fetch_fail_timeout_milliseconds", str(TIMEOUT * 1000))
        # Ray runs its workers at niceness 15: beside the suite's other workers (niceness 0) an
        # actor starved, its start-up alone past every bound. The tests' cluster runs at 0.
        patch.setenv("RAY_worker_niceness", "0")
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            import _ray_workers  # registers both transports, before any actor is made

            assert devipc.ray.register_transport() == "DEVIPC"  # again: nothing happens
            yield _ray_workers
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def actors(cluster):
    """A sender of openreg tensors, one of CPU tensors, and READERS + 1 receivers, for the
    module: actor processes cost an import of torch each."""
    sender, cpu_sender = cluster.Sender.remote("openreg"), cluster.Sender.remote("cpu")
    receivers = [cluster.Receiver.remote() for _ in range(READERS + 1)]
    ray.get([a.pid.remote() for a in (sender, cpu_sender, *receivers)], timeout=TIMEOUT)
    return sender, cpu_sender, receivers


def _get(ref):
    return ray.get(ref, timeout=TIMEOUT)


@pytest.mark.parametrize("device", ["openreg", "cpu"])
def test_an_actor_reads_another_actors_tensors_without_a_copy(cluster, actors, device):
    sender = actors[0] if device == "openreg" else actors[1]
    receiver = actors[2][0]
    ref = sender.make.remote(f"zero-copy-{device}", 1.0)
    seen = _get(receiver.take.remote(ref, write=True))
    expected = cluster.described(cluster.sample("cpu", 1.0))
    assert seen["tensors"] == expected  # views, dtypes and an empty tensor, exactly
    assert seen["devices"] == [f"{device}:0" if device != "cpu" else "cpu"]
    if device != "cpu":
        assert all(seen["received_via_ipc"])  # mapped through devipc's handles
    kept = _get(sender.kept_values.remote(f"zero-copy-{device}"))
    assert kept[0][2][0] == -1  # the receiver's write is in the sender's memory
    assert kept[1][2][0][0] == expected[1][2][0][0]  # (a view of the same storage, untouched)
    sender.forget.remote(f"zero-copy-{device}")


def test_the_path_between_hosts_reads_a_copy_over_nixl(cluster, actors):
    sender, _, receivers = actors
    ref = sender.make_over_network.remote("network", 2.0)
    seen = _get(receivers[1].take.remote(ref, write=True))
    assert seen["tensors"] == cluster.described(cluster.sample("cpu", 2.0))
    assert seen["devices"] == ["openreg:0"]
    assert not any(seen["received_via_ipc"])  # the receiver's own memory
    assert _get(sender.kept_values.remote("network"))[0][2][0] == 2.0  # not the sender's
    sender.forget.remote("network")


def test_more_receivers_than_handles_read_the_rest_over_nixl(cluster, actors):
    sender, _, receivers = actors
    ref = sender.make.remote("many", 3.0)
    seen = _get([receiver.take.remote(ref) for receiver in receivers])
    expected = cluster.described(cluster.sample("cpu", 3.0))
    assert all(s["tensors"] == expected for s in seen)
    mapped = sorted(all(s["received_via_ipc"]) for s in seen)
    assert mapped == [False] + [True] * READERS, seen  # READERS map it, one more reads it
    sender.forget.remote("many")


def test_the_driver_gets_the_tensors_too(cluster, actors):
    import torch

    ref = actors[0].make.remote("driver", 4.0)
    tensors = _get(ref)
    assert cluster.described(tensors) == cluster.described(cluster.sample("cpu", 4.0))
    assert tensors[0].device == torch.device("openreg", 0)
    actors[0].forget.remote("driver")


def test_a_sender_killed_before_the_read_is_a_clear_error(cluster, actors):
    from devipc._core._memfd import pid_alive

    sender = cluster.Sender.remote("openreg")
    pid = _get(sender.pid.remote())
    ref = sender.make.remote("gone")
    ray.wait([ref], timeout=TIMEOUT)
    ray.kill(sender)
    wait_until(lambda: not pid_alive(pid), "the sender's process is gone")
    with pytest.raises(Exception) as failed:  # Ray wraps what the receiver raised
        _get(actors[2][0].take.remote(ref))
    assert "the actor that made this Ray object has exited" in str(failed.value), failed.value


def test_killed_receivers_and_freed_objects_leave_nothing_behind(cluster, actors):
    sender, _, receivers = actors
    doomed = cluster.Receiver.remote()
    for step in range(20):
        ref = sender.make.remote("loop", float(step))
        assert _get(receivers[0].take.remote(ref))["tensors"][0][2][0] == step
        del ref
    ref = sender.make.remote("kept by a receiver that is killed")
    _get(doomed.take.remote(ref, keep=True))
    ray.kill(doomed)
    del ref
    sender.forget.remote("loop")
    sender.forget.remote("kept by a receiver that is killed")
    held: dict = {}

    def nothing_held():
        held.update(_get(sender.held.remote()))
        return held == {"objects": 0, "sent": 0}

    wait_until(
        nothing_held, lambda: f"the sender holds no object and no send: {held}", timeout=TIMEOUT
    )
    assert _get(receivers[0].drop.remote())["mapped"] == 0


@pytest.mark.parametrize("method", ["make", "make_over_network"])
def test_an_object_freed_while_a_receiver_reads_it_stays_whole_until_it_lets_go(
    cluster, actors, method
):
    sender, _, receivers = actors
    key = f"freed while read {method}"
    ref = getattr(sender, method).remote(key, 5.0)
    expected = cluster.described(cluster.sample("cpu", 5.0))
    assert _get(receivers[2].take.remote(ref, keep=True))["tensors"] == expected
    del ref  # Ray frees the object, and the sender its tensors, while the receiver holds them
    sender.forget.remote(key)
    if method == "make":  # the sender's memory: it stays until the receiver lets go
        wait_until(
            lambda: _get(sender.held.remote())["objects"] == 0,
            "Ray freed the object",
            timeout=TIMEOUT,
        )
    else:  # a copy of the receiver's own, read over NIXL
        wait_until(
            lambda: _get(sender.held.remote()) == {"objects": 0, "sent": 0},
            "the sender holds nothing",
            timeout=TIMEOUT,
        )
    sender.make.remote("overwrites freed memory", 6.0)  # its allocator may reuse the blocks
    assert _get(receivers[2].kept_described.remote()) == expected
    _get(receivers[2].drop.remote())
    wait_until(
        lambda: _get(receivers[2].drop.remote())["mapped"] == 0,
        "the receiver maps nothing",
        timeout=TIMEOUT,
    )
    sender.forget.remote("overwrites freed memory")
    wait_until(
        lambda: _get(sender.held.remote())["sent"] == 0,
        "every send of the freed object ended",
        timeout=TIMEOUT,
    )
