"""What the tests share: bounded timeouts, spawned children that are always reaped, fresh
interpreters, and the counts leak checks compare (descriptors, /dev/shm entries).

Fixtures built on these live in conftest.py; test modules import this module, never each other.
"""
import json
import multiprocessing
import os
import subprocess
import sys
import time

TIMEOUT = 60  # seconds; every join, get and wait is bounded by it
FRESH_TIMEOUT = 120  # seconds for a fresh interpreter that imports torch


class Children:
    """Spawned processes that are joined with a timeout and killed if still alive, even when
    the test fails."""

    def __init__(self):
        self.ctx = multiprocessing.get_context("spawn")
        self.procs = []

    def start(self, target, *args):
        proc = self.ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def join_ok(self, timeout=TIMEOUT):
        for proc in self.procs:
            proc.join(timeout)
            assert not proc.is_alive(), f"{proc.name} did not finish within {timeout} s"
            assert proc.exitcode == 0, f"{proc.name} exited with {proc.exitcode}"

    def reap(self):
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def fresh_env(**env) -> dict:
    """This process's environment less OPENREG_*, DEVIPC_* and the autoload switch, plus `env`."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("OPENREG_", "DEVIPC_"))
            and k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    full.update(env)
    return full


def run_python(code, **env) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter whose OPENREG_*/DEVIPC_* variables are exactly `env`;
    fails the test on a non-zero exit."""
    proc = subprocess.run([sys.executable, "-c", code], env=fresh_env(**env), capture_output=True,
                          text=True, timeout=FRESH_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    return proc


def json_of(code, **env):
    """The JSON object `code` prints last, run as in `run_python`."""
    return json.loads(run_python(code, **env).stdout.strip().splitlines()[-1])


def wait_until(condition, what: str, timeout: float = TIMEOUT, poll: float = 0.01):
    """Polls `condition()` until it is truthy, for effects that happen in the background (the
    collector thread, a killed process's locks); fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(poll)
    return value
