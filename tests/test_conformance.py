"""The conformance kit (`python -m devipc.conformance`): openreg passes it in both IPC modes, and
deliberately broken hooks (`_broken_hooks.py`, installed in every process of the kit through
--hooks-module) fail it, the failing check named."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
from _support import SLOWDOWN, fresh_env, process_state, wait_until

KIT_TIMEOUT = round(75 * SLOWDOWN)  # seconds for one whole run of the kit (about 10 here)
TESTS = pathlib.Path(__file__).parent


def kit(*args, **env) -> subprocess.CompletedProcess:
    """Runs the kit against openreg in a fresh interpreter; `_broken_hooks` importable."""
    path = ":".join(filter(None, [str(TESTS), fresh_env().get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "devipc.conformance", "--device", "openreg", *args],
        env=fresh_env(PYTHONPATH=path, **env),
        capture_output=True,
        text=True,
        timeout=KIT_TIMEOUT,
    )


def table(out: str) -> dict[str, str]:
    """{check: result} from the kit's table."""
    rows = [line.split() for line in out.splitlines()]
    return {
        row[1]: row[0] for row in rows if len(row) > 1 and row[0] in ("passed", "failed", "skipped")
    }


def listed() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "devipc.conformance", "--list"],
        env=fresh_env(),
        capture_output=True,
        text=True,
        timeout=KIT_TIMEOUT,
    )
    assert out.returncode == 0, out.stderr
    return [line.split()[0] for line in out.stdout.splitlines()]


@pytest.mark.parametrize("events", ["0", "1"])
def test_openreg_passes_in_both_ipc_modes(events):
    run = kit(OPENREG_IPC_EVENTS=events)
    assert run.returncode == 0, run.stdout + run.stderr
    results = table(run.stdout)
    assert sorted(results) == sorted(listed())
    mode, other = ("sync.events", "sync.producer_synchronizes")[:: 1 if events == "1" else -1]
    assert results[mode] == "passed" and results[other] == "skipped"
    assert [name for name, result in results.items() if result != "passed"] == [other]
    assert "0 failed" in run.stdout


def test_an_offset_off_by_one_fails_the_round_trips_in_every_process():
    run = kit(
        "--hooks-module",
        "_broken_hooks",
        "-k",
        "contract.registered",
        "-k",
        "roundtrip.",
        "-k",
        "writes.",
        "-k",
        "handles.share_open",
        "-k",
        "mp.dataloader",
        DEVIPC_BROKEN_HOOKS="offset",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    results = table(run.stdout)
    assert results["contract.registered"] == "passed"  # the broken hooks are the ones tested
    assert "_broken_hooks.OffsetOffByOne" in run.stdout
    for name in (
        "roundtrip.views",
        "writes.both_ways",
        "handles.share_open",
        "mp.dataloader",
    ):  # produced in a DataLoader worker: broken there too
        assert results[name] == "failed", name
    assert "from the peer" in run.stdout or "values differ" in run.stdout


def test_a_consumer_that_does_not_wait_for_the_event_fails_sync_events():
    run = kit(
        "--hooks-module",
        "_broken_hooks",
        "-k",
        "sync.",
        "--json",
        OPENREG_IPC_EVENTS="1",
        DEVIPC_BROKEN_HOOKS="no_event_wait",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    results = {result["name"]: result for result in json.loads(run.stdout)}
    assert results["sync.events"]["status"] == "failed"
    assert "not all 1: it read before the" in results["sync.events"]["detail"]


def test_a_check_that_hangs_fails_by_timeout_and_the_kit_ends():
    run = kit(
        "--hooks-module",
        "_broken_hooks",
        "-k",
        "contract.mem_handle",
        "-k",
        "contract.registered",
        "--timeout",
        "5",
        DEVIPC_BROKEN_HOOKS="open_hangs",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert table(run.stdout) == {"contract.registered": "passed", "contract.mem_handle": "failed"}
    assert "did not finish within 5 s" in run.stdout


def test_as_pytest_each_check_is_a_test_and_a_failure_names_it():
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "devipc.conformance.pytest_plugin",
            "--pyargs",
            "devipc.conformance",
            "--device",
            "openreg",
            "--hooks-module",
            "_broken_hooks",
            "-k",
            "contract.registered or roundtrip.views",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        env=fresh_env(
            PYTHONPATH=":".join(filter(None, [str(TESTS), fresh_env().get("PYTHONPATH")])),
            DEVIPC_BROKEN_HOOKS="offset",
        ),
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=KIT_TIMEOUT,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED" in run.stdout and "test_check[roundtrip.views]" in run.stdout
    assert "1 failed, 1 passed" in run.stdout


def test_a_device_torch_does_not_know_is_refused_before_any_check():
    run = subprocess.run(
        [sys.executable, "-m", "devipc.conformance", "--device", "nodevice"],
        env=fresh_env(),
        capture_output=True,
        text=True,
        timeout=KIT_TIMEOUT,
    )
    assert run.returncode == 2 and "cannot test nodevice:0" in run.stderr


def test_a_check_that_hangs_in_a_dataloader_worker_ends_with_the_worker_killed(tmp_path):
    """The kit's output is captured (as CI does): the worker it started must not keep it open."""
    pids = tmp_path / "workers"
    try:
        # long enough for the worker to start and reach the hooks (a spawned worker imports torch:
        # ~8 s for a CUDA build of torch on an idle 2-core machine)
        run = kit(
            "--hooks-module",
            "_broken_hooks",
            "-k",
            "mp.dataloader",
            "--timeout",
            str(round(10 * SLOWDOWN)),
            DEVIPC_BROKEN_HOOKS="worker_share_hangs",
            DEVIPC_BROKEN_HOOKS_PIDS=str(pids),
        )
        assert run.returncode == 1, run.stdout + run.stderr
        assert table(run.stdout) == {"mp.dataloader": "failed"}
        workers = [int(pid) for pid in pids.read_text().split()]
        assert workers
        wait_until(
            lambda: all(process_state(pid) in ("", "Z") for pid in workers),
            "the hung DataLoader worker is gone",
        )
    finally:
        for pid in (int(pid) for pid in pids.read_text().split()) if pids.exists() else ():
            if process_state(pid) not in ("", "Z"):
                os.kill(pid, signal.SIGKILL)  # an orphan of the kit under test: ours to end


@pytest.mark.parametrize(
    "broken, check, says",
    [
        ("close_keeps_mapping", "lifetime.release", "still maps"),
        ("handles_repeat", "optional.reusable_mappings", "old allocation's handle"),
    ],
)
def test_hooks_broken_in_one_way_fail_the_one_check_that_looks(broken, check, says):
    """A consumer whose close never unmaps; hooks that let mappings be kept, yet give every
    allocation the same handle."""
    run = kit("--hooks-module", "_broken_hooks", "-k", check, DEVIPC_BROKEN_HOOKS=broken)
    assert run.returncode == 1, run.stdout + run.stderr
    assert table(run.stdout) == {check: "failed"}
    assert says in run.stdout, run.stdout


def test_hooks_that_always_say_device_0_fail_on_index_1():
    run = kit(
        "--hooks-module",
        "_broken_hooks",
        "--index",
        "1",
        "-k",
        "roundtrip.views",
        "-k",
        "mp.dataloader",
        DEVIPC_BROKEN_HOOKS="always_device_zero",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert table(run.stdout)["roundtrip.views"] == "failed"
    assert "arrived on openreg:0, sent from openreg:1" in run.stdout, run.stdout


def test_supports_ipc_that_raises_ends_the_run_at_once_naming_the_exception():
    run = kit("--hooks-module", "_broken_hooks", DEVIPC_BROKEN_HOOKS="supports_ipc_raises")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "supports_ipc() raised RuntimeError: the driver is not loaded" in run.stderr, run.stderr
    assert "no IPC hooks able to share" not in run.stdout + run.stderr
    assert table(run.stdout) == {}  # no check ran


@pytest.mark.parametrize(
    "broken, missing",
    [
        ("only_supports_ipc", "get_ipc_mem_handle, open_ipc_mem_handle: "),
        ("events_without_event_hooks", "get_ipc_event_handle, wait_ipc_event (requires_event_sync"),
    ],
)
def test_hooks_left_to_the_base_class_end_the_run_at_once_naming_them(broken, missing):
    """A vendor's first try: every check would wait out its peer's 30 s on a send that raised
    in the producer's queue feeder thread, a traceback each."""
    run = kit("--hooks-module", "_broken_hooks", DEVIPC_BROKEN_HOOKS=broken)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"do not implement {missing}" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert table(run.stdout) == {}  # no check ran
