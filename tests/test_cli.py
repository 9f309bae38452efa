"""The `devipc` command: doctor (here, and against a peer in another PID namespace), info on a
live process's stats page, bench with its table, progress and PNG."""

import contextlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from _support import FRESH_TIMEOUT, fresh_env, wait_until

from devipc._core._statspage import StatsPageError, read_page
from devipc._tools import _cli

DEVIPC = [sys.executable, "-m", "devipc"]
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def run(args, timeout=FRESH_TIMEOUT, prefix=()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*prefix, *DEVIPC, *args], env=fresh_env(), capture_output=True, text=True, timeout=timeout
    )


def test_doctor_exits_0_here():
    proc = run(["doctor"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in (
        "ok    openreg: 2 device(s)",
        "ok    memfd:",
        "ok    round trip openreg:0",
        "ok    round trip cpu",
        "ok    p2p:",
        "sharing works here",
    ):
        assert line in proc.stdout, proc.stdout


def _serving():
    """A `devipc doctor --serve` and the token it printed."""
    proc = subprocess.Popen(
        [*DEVIPC, "doctor", "--serve", "--timeout", "100"],
        env=fresh_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, deadline = b"", time.monotonic() + FRESH_TIMEOUT
    while not (found := re.search(rb"devipc-doctor-1:\S+", out)):
        assert time.monotonic() < deadline and proc.poll() is None, out.decode()
        if select.select([proc.stdout], [], [], 1.0)[0]:
            out += os.read(proc.stdout.fileno(), 65536)
    return proc, found.group().decode()


def _stop(proc) -> str:
    proc.kill()
    out = proc.communicate(timeout=30)[0]
    return out.decode()


def _unshare_works() -> str:
    """Why a PID namespace cannot be made here, or ""."""
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    try:
        probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "unshare did not finish"
    return "" if probe.returncode == 0 else f"unshare --pid is not permitted: {probe.stderr}"


def test_doctor_against_a_peer_in_another_pid_namespace_fails_naming_the_fix():
    """Two containers sharing a GPU: the peer cannot open /proc/<pid>/fd of the server."""
    if why := _unshare_works():
        pytest.skip(why)
    server, token = _serving()
    try:
        proc = run(["doctor", "--peer", token], prefix=UNSHARE)
    finally:
        served = _stop(server)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "ok    round trip openreg:0" in out  # sharing inside that namespace works
    assert "FAIL  peer: the peer" in out and "another PID namespace" in out, out
    for fix in ("docker run --pid=host", "shareProcessNamespace: true", "transport='nixl'"):
        assert fix in out, out
    assert "a peer opened" not in served


def test_doctor_peer_in_the_same_namespace_passes_and_the_server_sees_it():
    server, token = _serving()
    try:
        proc = run(["doctor", "--peer", token])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "ok    peer: opened the memfd" in proc.stdout
        assert server.wait(30) == 0  # it saw the peer's write
    finally:
        served = _stop(server)
    assert "a peer opened this process's memfd" in served


def test_doctor_warns_when_the_devipc_processes_here_ask_for_more_threads_than_cores(
    children, capsys
):
    """Issue 31: three processes with torch's default threads (one per core each)
    oversubscribe any machine; the warning names them (others may be counted too)."""
    import _workers
    from _support import recv

    from devipc._core._statspage import find_pages
    from devipc._tools import _doctor

    started = [children.start_piped(_workers.devipc_process)[1] for _ in range(3)]
    seen = [recv(conn) for conn in started]
    assert all(threads == len(os.sched_getaffinity(0)) for _, threads in seen)
    report = _doctor.Report()
    _doctor.threads(report, find_pages()[0])
    out = capsys.readouterr().out
    assert report.warnings == 1 and out.startswith("WARN  "), out
    assert all(str(pid) in out for pid, _ in seen), out
    assert "torch.set_num_threads(" in out and "OMP_NUM_THREADS=" in out


def test_doctor_finds_no_oversubscription_when_each_process_has_its_share(capsys):
    """The doctor's own threads do not count (it is not an engine), nor pages without a count
    or with a count no process has."""
    from devipc._tools import _doctor

    report = _doctor.Report()
    _doctor.threads(
        report,
        {
            1: {"stats": {"torch_threads": 1}},
            2: {"stats": {"sent": 0}},
            3: {"stats": [1]},
            4: {"stats": {"torch_threads": 10**9}},
        },
    )
    assert report.warnings == 0
    assert capsys.readouterr().out.startswith("ok    torch CPU threads: 1 for ")


def test_doctor_reports_a_device_setting_its_hooks_refuse_as_a_failure_with_the_fix():
    """openreg's hooks refuse OPENREG_IPC_EVENTS=yes: the doctor (which never names a device)
    shows the package's message as the fix, and goes on without the device."""
    proc = subprocess.run(
        [*DEVIPC, "doctor"],
        env=fresh_env(OPENREG_IPC_EVENTS="yes"),
        capture_output=True,
        text=True,
        timeout=FRESH_TIMEOUT,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    failure, fix = re.search(r"FAIL  openreg: (.*)\n +fix: (.*)", proc.stdout).groups()
    assert "its IPC hooks raise ValueError" in failure, proc.stdout
    assert "OPENREG_IPC_EVENTS='yes' is not understood: set it to 1" in fix, proc.stdout
    assert "round trip openreg" not in proc.stdout and "ok    round trip cpu" in proc.stdout
    assert "1 problem(s)" in proc.stdout


@pytest.mark.parametrize(
    "hard, fix",
    [
        (
            64,
            "the hard limit is 64 too, and only a privileged process raises it: `ulimit -n 65536` "
            "as root",
        ),
        (4096, "ulimit -n 4096 in the shell"),
        (1 << 20, "ulimit -n 65536 in the shell"),
    ],
)
def test_doctor_advises_an_fd_limit_that_raises_a_low_one(hard, fix, monkeypatch, capsys):
    """`ulimit -n 64` sets the hard limit too: advising `ulimit -n <hard>` changed nothing."""
    from devipc._tools import _doctor

    monkeypatch.setattr(_doctor.resource, "getrlimit", lambda which: (64, hard))
    _doctor.environment(_doctor.Report())
    out = capsys.readouterr().out
    assert "WARN  ulimit -n is 64: each counter file" in out, out
    assert re.search(r"ulimit -n is 64: .*\n +fix: (.*)", out).group(1).startswith(fix), out


def test_doctor_rejects_a_malformed_token():
    assert _cli.main(["doctor", "--peer", "devipc-doctor-1:bm90IGpzb24="]) == 2


SENDER = """
import sys, torch, devipc
handles = [devipc.share(torch.ones(4, device="openreg")) for _ in range(3)]
print("ready", flush=True)
sys.stdin.read()  # until the test lets go
"""


def test_info_shows_a_live_process_unopened_sends():
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER],
        env=fresh_env(),
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        page = wait_until(
            lambda: (p := read_page(proc.pid))["stats"] and p["stats"]["unopened"] == 3 and p,
            "the page shows the sends",
        )
        assert page["pid"] == proc.pid and page["stats"]["sent"] == 3
        info = run(["info", "--pid", str(proc.pid)])
        assert info.returncode == 0, info.stderr
        assert re.search(
            r"unopened sends +3 +sent, never opened, the oldest sent [\d.]+ s ago", info.stdout
        ), info.stdout
        assert re.search(r"sends held +3", info.stdout), info.stdout
        pages = json.loads(run(["info", "--json"]).stdout)  # every visible devipc process
        assert pages[str(proc.pid)]["stats"]["unopened"] == 3
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_info_says_why_a_page_cannot_be_read():
    other = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(StatsPageError, match="has no devipc stats page"):
            read_page(other.pid)
    finally:
        other.kill()
        other.wait(30)
    with pytest.raises(StatsPageError, match="no process .* another PID namespace"):
        read_page(other.pid)  # reaped: gone
    assert _cli.main(["info", "--pid", str(other.pid)]) == 1


FORGED_PAGE = """
import os, sys
fd = os.memfd_create("devipc-STAT-" + "ab" * 16, os.MFD_CLOEXEC)
os.write(fd, bytes.fromhex(sys.argv[1]))
print("ready", flush=True)
sys.stdin.read()  # until the test lets go
"""


def _page_bytes(body: bytes, length: int | None = None, size: int = 4096) -> bytes:
    """A stats page as devipc lays it out: an even sequence number, the body's length, the body."""
    length = len(body) if length is None else length
    page = (2).to_bytes(8, "little") + length.to_bytes(8, "little") + body
    return page.ljust(size, b"\0")[:size]


FORGED = {
    "not JSON": _page_bytes(b"not json {"),
    "a list": _page_bytes(b"[1, 2, 3]"),
    "missing keys": _page_bytes(b'{"pid": 7}'),
    "a 20-byte file": _page_bytes(b'{"pid": 7, "started"', length=100, size=20),
    "bad UTF-8": _page_bytes(b'{"pid": "\xff\xfe", "started": 0, "updated": 0, "stats": null}'),
    "a number of the wrong type": _page_bytes(
        b'{"pid": 7, "started": 0, "updated": 0, "stats": {"unopened": 1, '
        b'"oldest_unopened_s": "old"}}'
    ),
    "a zero length": _page_bytes(b"", length=0),
}


@contextlib.contextmanager
def _holding(command: list[str], **popen):
    """A process started by `command` that prints "ready" once it holds what the test needs, and
    holds it until the test ends."""
    proc = subprocess.Popen(
        command, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, **popen
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=30)


@pytest.mark.parametrize("kind", FORGED)
def test_info_refuses_a_forged_page_in_one_line(kind, capsys):
    """A process of any user can hold a memfd named like a stats page, with any bytes in it."""
    with _holding([sys.executable, "-c", FORGED_PAGE, FORGED[kind].hex()]) as forger:
        with pytest.raises(StatsPageError, match=f"process {forger.pid} holds a file named like"):
            read_page(forger.pid)
        assert _cli.main(["info", "--pid", str(forger.pid)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"process {forger.pid}" in err, err


REWRITTEN_PAGE = """
import os, sys
fd = os.memfd_create("devipc-STAT-" + "ab" * 16, os.MFD_CLOEXEC)
os.ftruncate(fd, 4096)
print("ready", flush=True)
for line in sys.stdin:  # each a page's bytes in hex, written over the last
    os.pwrite(fd, bytes.fromhex(line), 0)
    print("written", flush=True)
"""
_WRONG_TYPES = (None, "3", [3], {"n": 3}, True, 1.5, 10**400, float("nan"))


def _page_mutations(page: dict):
    """(what, mutated page, whether devipc could have written it) for each key of `page` and of
    its stats: the key dropped, or its value of each other type."""
    paths = [(key,) for key in page] + [("stats", key) for key in page["stats"] or {}]
    for path in paths:
        *parents, key = path
        mutated = json.loads(json.dumps(page))
        del (mutated[parents[0]] if parents else mutated)[key]
        yield f"{'.'.join(path)} dropped", mutated, False
        for value in _WRONG_TYPES:
            mutated = json.loads(json.dumps(page))
            parent = mutated[parents[0]] if parents else mutated
            original, parent[key] = parent[key], value
            valid = (
                path == ("stats",)
                and value is None  # no numbers yet
                or path[-1] == "error"
                and isinstance(value, str)
                or type(original) is float
                and value == 1.5
            )
            yield f"{'.'.join(path)} = {repr(value)[:12]}", mutated, valid


def test_info_fuzzed_page_keys_give_one_line_never_a_traceback(capsys):
    """Issue 53, item 3: every key of a page (and of its stats) is untrusted: dropped, or of
    another type, it gives one line and exit 1 (a traceback, say a KeyError of an `unopened`
    count without `oldest_unopened_s`, fails the test); what devipc could have written is shown."""
    from devipc._core import _sharing, _statspage

    now = time.time()
    numbers = {key: 3 for key in _sharing._page_numbers()} | {"oldest_unopened_s": 1.5}
    assert set(numbers) == {*_statspage._COUNTS, *_statspage._SECONDS}  # what a page is read as
    pages = [
        {"pid": 7, "started": now - 60.0, "updated": now - 1.0, "stats": stats}
        for stats in (numbers, {"error": "5000 bytes do not fit"}, None)
    ]
    with _holding([sys.executable, "-c", REWRITTEN_PAGE]) as forger:
        for page in pages:
            for what, mutated, valid in _page_mutations(page):
                forger.stdin.write(_page_bytes(json.dumps(mutated).encode()).hex() + "\n")
                forger.stdin.flush()
                assert forger.stdout.readline() == "written\n"
                code = _cli.main(["info", "--pid", str(forger.pid)])
                out, err = capsys.readouterr()
                if valid:
                    assert code == 0 and f"pid {forger.pid}: " in out and not err, (what, err)
                else:
                    assert code == 1 and not out, (what, out)
                    assert err.count("\n") == 1 and f"process {forger.pid} holds" in err, (
                        what,
                        err,
                    )


def test_plain_info_reports_the_others_beside_a_forged_page(capsys):
    with (
        _holding([sys.executable, "-c", FORGED_PAGE, FORGED["a list"].hex()]) as forger,
        _holding([sys.executable, "-c", SENDER], env=fresh_env()) as sender,
    ):
        wait_until(
            lambda: (read_page(sender.pid)["stats"] or {}).get("unopened") == 3,
            "the sender's page shows its sends",
        )
        assert _cli.main(["info"]) == 1
    out, err = capsys.readouterr()
    assert f"pid {sender.pid}: " in out, out
    bad = [line for line in err.splitlines() if f"process {forger.pid} " in line]
    assert len(bad) == 1, err


FIFO_HOLDER = """
mount -t tmpfs none "$1" && cd "$1" && mkdir old && mkfifo 'memfd:devipc-STAT-00 (deleted)' &&
exec 4<>'memfd:devipc-STAT-00 (deleted)' 3<'memfd:devipc-STAT-00 (deleted)' 4>&- &&
pivot_root . old && echo ready && read _
"""


def test_info_never_blocks_on_a_fifo_named_like_a_page():
    """An unprivileged user (another user and a mount namespace rooted in a tmpfs) holds a FIFO,
    with no writer, whose /proc/<pid>/fd link reads as a stats page: opening it would block."""
    if shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.skip("setpriv(1) and unshare(1) are needed")
    mount_point = tempfile.mkdtemp(prefix="devipc-fifo-")
    os.chmod(mount_point, 0o755)  # reachable by nobody
    command = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "sh",
        "-c",
        FIFO_HOLDER,
        "sh",
        mount_point,
    ]
    holder = subprocess.Popen(
        command, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        if holder.stdout.readline() != "ready\n":
            pytest.skip(f"no mount namespace for an unprivileged user here: {holder.stderr.read()}")
        link = os.readlink(f"/proc/{holder.pid}/fd/3")
        assert link == "/memfd:devipc-STAT-00 (deleted)", link
        one = run(["info", "--pid", str(holder.pid)])
        every = run(["info"])
    finally:
        holder.kill()
        holder.communicate(timeout=30)
        os.rmdir(mount_point)
    assert one.returncode == 1 and "Traceback" not in one.stderr, one.stderr
    assert one.stderr.count("\n") == 1 and f"process {holder.pid} " in one.stderr, one.stderr
    assert f"process {holder.pid} " in every.stderr and "Traceback" not in every.stderr, (
        every.stderr
    )


def test_bench_ipc_writes_a_table_a_png_and_shows_progress(tmp_path):
    png = tmp_path / "out.png"
    proc = run(["bench", "ipc", "--max-mib", "1", "--plot", str(png)])
    assert proc.returncode == 0, proc.stderr
    for row in ("| 4 KiB |", "| 64 KiB |", "| 1 MiB |"):
        assert row in proc.stdout, proc.stdout
    assert (
        "| size | small message (us) | devipc openreg, re-sent (us) | re-sent / message | "
        "devipc openreg, new each send (us) | new / its message | torch CPU shared (us) | "
        "copy via CPU (us)" in proc.stdout
    )
    assert "ipc: 100%" in proc.stderr and "12/12" in proc.stderr  # tqdm's bar
    assert re.search(
        r"DataLoader, 2 spawned workers: batches of \(64, 3, 32, 32\) float32 made "
        r"on openreg \d+/s, small Python objects \d+/s \(\d+%\)",
        proc.stdout,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_plot_without_matplotlib_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails: as if not installed
    assert _cli.main(["bench", "ipc", "--plot", "x.png"]) == 2
    assert "pip install 'devipc[plot]'" in capsys.readouterr().err


def test_progress_without_tqdm_prints_one_line_a_step(monkeypatch, capsys):
    from devipc._tools._bench.common import Progress

    monkeypatch.setitem(sys.modules, "tqdm", None)
    progress = Progress("ipc")
    progress.start(2)
    progress.step("4 KiB devipc 300 us")
    progress.close()
    assert capsys.readouterr().err == "[1/2] ipc: 4 KiB devipc 300 us\n"


BAD_BENCH = {
    "an unknown device": (["--device", "foo"], "--device foo"),
    "a device without hooks": (["--device", "meta"], "--device meta"),
    "a device index that is not here": (["--device", "openreg:5"], "--device openreg:5"),
    "a size of 0": (["--max-mib", "0"], "--max-mib"),
    "a negative size": (["p2p", "--max-mib", "-3"], "--max-mib"),
    "a weight-sync size of 0": (["weight-sync", "--max-mib", "0"], "--max-mib"),
    "an ipc size beyond its largest": (["ipc", "--max-mib", "1024"], "256 MiB"),
    "more memory than this host has": (["p2p", "--max-mib", str(1 << 30)], "host memory"),
    "not a number": (["--max-mib", "lots"], "--max-mib"),
    "a plot in a missing directory": (["--plot", "/no-such-dir/out.png"], "--plot"),
    "a plot onto a directory": (["--plot", "/tmp"], "--plot"),
}


@pytest.mark.parametrize("case", BAD_BENCH)
def test_bench_refuses_bad_arguments_before_measuring(case, monkeypatch, capsys):
    from devipc._tools._bench import ipc, p2p, weight_sync

    def measured(*args, **kwargs):
        raise AssertionError("a bad argument was measured")

    for module in (ipc, p2p, weight_sync):
        monkeypatch.setattr(module, "measure", measured)
    argv, named = BAD_BENCH[case]
    with pytest.raises(SystemExit) as refused:
        _cli.main(["bench", *argv])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    error = err.splitlines()[-1]
    assert error.startswith("devipc bench: error: ") and named in error, err
