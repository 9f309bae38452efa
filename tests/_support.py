"""What the tests share: bounded timeouts, spawned children that are always reaped, fresh
interpreters, exited-but-unreaped children, and the counts leak checks compare (descriptors,
/dev/shm entries).

The machine may be busy (a second suite beside this one): bounds grow with its load, and leak
checks count only what this run's processes made.

Fixtures built on these live in conftest.py; test modules import this module, never each other.
"""

import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time


def _slowdown() -> float:
    """How many times an idle machine's bounds to allow: DEVIPC_TESTS_SLOWDOWN when set, else 2,
    or the runnable processes per core when the machine is busier still. Bounds only turn a hang
    into a failure: a generous one costs nothing when the test passes."""
    if value := os.environ.get("DEVIPC_TESTS_SLOWDOWN"):
        slowdown = float(value)
        if not slowdown > 0:
            raise ValueError(f"DEVIPC_TESTS_SLOWDOWN must be a positive number, not {value!r}")
        return slowdown
    return max(2.0, os.getloadavg()[0] / (os.cpu_count() or 1))


SLOWDOWN = _slowdown()


def slowdown_now() -> float:
    """SLOWDOWN, or the load's factor now if the machine got busier since this module was
    imported (xdist workers import it before the suite loads the machine)."""
    return max(SLOWDOWN, _slowdown())


TIMEOUT = round(60 * SLOWDOWN)  # seconds; every join, get and wait is bounded by it
UCX_LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}  # NIXL tests talk to this host only
FRESH_TIMEOUT = round(120 * SLOWDOWN)  # seconds for a fresh interpreter that imports torch
_started: set[int] = set()  # the processes this one started, for `shm_entries`


class Children:
    """Spawned processes that are joined with a timeout and killed if still alive, even when
    the test fails."""

    def __init__(self):
        self.ctx = multiprocessing.get_context("spawn")
        self.procs = []
        self.conns = []

    def start(self, target, *args, daemon=True):
        """`daemon=False` for a child that starts processes of its own (vLLM's engine core)."""
        proc = self.ctx.Process(target=target, args=args, daemon=daemon)
        proc.start()
        _started.add(proc.pid)
        self.procs.append(proc)
        return proc

    def start_piped(self, target, *args, daemon=True):
        """Starts target(conn, *args); returns the process and our end of the Pipe to it."""
        ours, theirs = self.ctx.Pipe()
        proc = self.start(target, theirs, *args, daemon=daemon)
        theirs.close()
        self.conns.append(ours)
        return proc, ours

    def answer(self, target, *args):
        """Runs target(conn, *args) in a child and returns what it sent, or None when it died
        first; a failed test unless the child then exits with 0 (a crash is its exit code)."""
        proc, conn = self.start_piped(target, *args)
        try:
            got = recv(conn, 2 * TIMEOUT)
        except EOFError:  # it crashed before it could answer
            got = None
        proc.join(TIMEOUT)
        assert proc.exitcode == 0, f"the child exited with {proc.exitcode}"
        return got

    def join_ok(self, timeout=TIMEOUT):
        for proc in self.procs:
            proc.join(timeout)
            assert not proc.is_alive(), f"{proc.name} did not finish within {timeout} s"
            assert proc.exitcode == 0, f"{proc.name} exited with {proc.exitcode}"

    def reap(self):
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(TIMEOUT)
        for conn in self.conns:
            conn.close()


def recv(conn, timeout=TIMEOUT):
    """The next object from a Pipe, or a failed test if none comes in time."""
    assert conn.poll(timeout), f"nothing came through the pipe within {timeout} s"
    return conn.recv()


def nixl_missing() -> str | None:
    """Why NIXL cannot be loaded here (the skip reason of the tests that need it), or None."""
    try:
        from devipc.p2p._nixl import load_nixl

        load_nixl()
    except ImportError as error:
        return str(error)
    return None


def use_ucx_loopback(monkeypatch) -> None:
    """UCX over TCP on the loopback device only (children inherit it), as between two hosts."""
    for name, value in UCX_LOOPBACK.items():
        monkeypatch.setenv(name, value)


def keyboard_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt in this child even when the suite was started as a
    background job: a shell starts those with SIGINT ignored, children inherit that, and Python
    then installs no handler of its own."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def after_large_posts(nbytes: int, then):
    """Inside it, `then(state)` runs after NIXL posted a request of at least `nbytes` local
    bytes, with the state the post returned: a transfer large enough to be in flight then."""
    from devipc.p2p import _nixl

    request, post, big = _nixl.NixlTransport._request, _nixl.NixlTransport.post_handle, set()

    def spied_request(self, op, agent, local, *rest):
        handle = request(self, op, agent, local, *rest)
        if sum(size for _, size, _ in local) >= nbytes:
            big.add(id(handle))
        return handle

    def spied_post(self, handle, agent):
        state = post(self, handle, agent)
        if id(handle) in big:
            then(state)
        return state

    _nixl.NixlTransport._request, _nixl.NixlTransport.post_handle = spied_request, spied_post
    try:
        yield
    finally:
        _nixl.NixlTransport._request, _nixl.NixlTransport.post_handle = request, post


def until_the_test_ends() -> None:
    """For a child that holds something until the test kills it: waits as long as the test
    process lives, however slow the test is, and no longer (no orphan stays)."""
    multiprocessing.parent_process().join()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


_TORCH_SHM = re.compile(r"torch_(\d+)_")  # torch's CPU shared memory: torch_<maker's pid>_...


def shm_entries() -> set[str]:
    """The /dev/shm entries this run's processes made: the directory is the machine's, others
    add and remove theirs meanwhile. torch names its files after the process that made them;
    devipc and openreg make none (memfds), so an entry naming either is counted whoever made it;
    multiprocessing's semaphores (sem.mp-<random>) name nobody and are left out."""
    found = set()
    for name in os.listdir("/dev/shm"):
        if match := _TORCH_SHM.match(name):
            if _ours(int(match[1])):
                found.add(name)
        elif "openreg" in name or "devipc" in name:
            found.add(name)
    return found


def _ours(pid: int) -> bool:
    """Whether `pid` is this process or one it started: a live process by its parents (a
    number reused by another process is not ours), an exited one by the record of starts."""
    me, walked = os.getpid(), pid
    while walked > 1:
        if walked == me:
            return True
        try:
            with open(f"/proc/{walked}/stat", "rb") as stat:
                line = stat.read()
        except (FileNotFoundError, ProcessLookupError):
            return pid in _started  # it (or a parent on the way) exited
        walked = int(line[line.rfind(b")") + 2 :].split()[1])
    return False


def fresh_env(**env) -> dict:
    """This process's environment less OPENREG_*, DEVIPC_* and the autoload switch, plus `env`."""
    full = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OPENREG_", "DEVIPC_")) and k != "TORCH_DEVICE_BACKEND_AUTOLOAD"
    }
    full.update(env)
    return full


def run_python(code, **env) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter whose OPENREG_*/DEVIPC_* variables are exactly `env`;
    fails the test on a non-zero exit."""
    proc = start_python(code, **env)
    try:
        out, err = proc.communicate(timeout=FRESH_TIMEOUT)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start_python(code, **env) -> subprocess.Popen:
    """Starts `code` as `run_python` does, without waiting: several can run at once."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=fresh_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _started.add(proc.pid)
    return proc


def json_from(proc: subprocess.Popen):
    """The JSON object a process from `start_python` prints last; fails the test on a non-zero
    exit, and kills the process if it does not end in time."""
    try:
        out, err = proc.communicate(timeout=FRESH_TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def json_of(code, **env):
    """The JSON object `code` prints last, run as in `run_python`."""
    return json_from(start_python(code, **env))


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat ("Z" for a zombie), "" once the process is reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            line = stat.read()
    except FileNotFoundError:
        return ""
    return line[line.rfind(b")") + 2 :][:1].decode()


@contextlib.contextmanager
def zombie_child(code, **env):
    """Runs `code` in a fresh interpreter (env as in `run_python`) and yields (pid, its stdout) once
    it has exited but is not reaped yet, a zombie; reaps it on exit, whatever happened."""
    proc = start_python(code, **env)
    try:
        deadline = time.monotonic() + FRESH_TIMEOUT
        while process_state(proc.pid) != "Z":  # polling: waiting would reap it
            assert time.monotonic() < deadline, f"child {proc.pid} did not exit in time"
            time.sleep(0.01)
        out, err = proc.stdout.read(), proc.stderr.read()  # it has exited: EOF, no blocking
        assert out.strip(), f"child printed nothing; stderr: {err}"
        yield proc.pid, out
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
        proc.stdout.close()
        proc.stderr.close()


def wait_until(
    condition, what, timeout: float = TIMEOUT, poll: float = 0.01, collect: bool = False
):
    """Polls `condition()` until it is truthy, for effects that happen in the background (the
    collector thread, a killed process's locks); fails the test after `timeout` seconds, saying
    `what` (text, or a function that says what was seen last). With `collect`, each poll runs
    `devipc.ipc_collect()` first."""
    deadline = time.monotonic() + timeout
    while True:
        if collect:
            import devipc

            devipc.ipc_collect()
        if value := condition():
            return value
        assert time.monotonic() < deadline, (
            f"not within {timeout} s: {what() if callable(what) else what}"
        )
        time.sleep(poll)


def keep_collector_out(monkeypatch) -> None:
    """devipc's collector thread's rounds do nothing from here on: once a round already under
    way (a busy machine's may be long) has ended, only the test's own calls release or close."""
    import threading

    from devipc._core import _sharing

    idle = threading.Event()
    monkeypatch.setattr(_sharing._background, "_round", lambda: idle.set() or True)
    _sharing._background.wake()
    assert idle.wait(TIMEOUT), "the collector thread never came round"


def foreign_memfd_maps() -> set[str]:
    """Mappings of devipc or openreg memfds that this process has no fd of: other processes'
    memory, counter files or event pages that it mapped."""
    own = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            own.add(os.readlink(f"/proc/self/fd/{fd}"))
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.rstrip("\n").split(maxsplit=5)
            path = fields[5] if len(fields) == 6 else ""
            if path.startswith(("/memfd:devipc", "/memfd:openreg")) and path not in own:
                found.add(path)
    return found
