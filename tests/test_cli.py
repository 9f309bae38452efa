"""The `devipc` command: doctor (here, and against a peer in another PID namespace), info on a
live process's stats page, bench with its table, progress and PNG."""
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time

import pytest
from _support import FRESH_TIMEOUT, fresh_env, wait_until

from devipc import _cli
from devipc._statspage import StatsPageError, read_page

DEVIPC = [sys.executable, "-m", "devipc"]
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def run(args, timeout=FRESH_TIMEOUT, prefix=()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, *DEVIPC, *args], env=fresh_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_doctor_exits_0_here():
    proc = run(["doctor"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("ok    openreg: 2 device(s)", "ok    memfd:", "ok    round trip openreg:0",
                 "ok    round trip cpu", "ok    p2p:", "sharing works here"):
        assert line in proc.stdout, proc.stdout


def _serving():
    """A `devipc doctor --serve` and the token it printed."""
    proc = subprocess.Popen([*DEVIPC, "doctor", "--serve", "--timeout", "100"], env=fresh_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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


def test_doctor_rejects_a_malformed_token():
    assert _cli.main(["doctor", "--peer", "devipc-doctor-1:bm90IGpzb24="]) == 2


SENDER = """
import sys, torch, devipc
handles = [devipc.share(torch.ones(4, device="openreg")) for _ in range(3)]
print("ready", flush=True)
sys.stdin.read()  # until the test lets go
"""


def test_info_shows_a_live_process_unopened_sends():
    proc = subprocess.Popen([sys.executable, "-c", SENDER], env=fresh_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "ready\n"
        page = wait_until(lambda: (p := read_page(proc.pid))["stats"]
                          and p["stats"]["unopened"] == 3 and p, "the page shows the sends")
        assert page["pid"] == proc.pid and page["stats"]["sent"] == 3
        info = run(["info", "--pid", str(proc.pid)])
        assert info.returncode == 0, info.stderr
        assert re.search(r"unopened sends +3 +sent, never opened, the oldest sent [\d.]+ s ago",
                         info.stdout), info.stdout
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


def test_bench_ipc_writes_a_table_a_png_and_shows_progress(tmp_path):
    png = tmp_path / "out.png"
    proc = run(["bench", "ipc", "--max-mib", "1", "--plot", str(png)])
    assert proc.returncode == 0, proc.stderr
    for row in ("| 4 KiB |", "| 64 KiB |", "| 1 MiB |"):
        assert row in proc.stdout, proc.stdout
    assert "| size | small message (us) | devipc openreg (us) | devipc / message | torch CPU " \
        "shared (us) | copy via CPU (us)" in proc.stdout
    assert "ipc: 100%" in proc.stderr and "9/9" in proc.stderr  # tqdm's bar
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_plot_without_matplotlib_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails: as if not installed
    assert _cli.main(["bench", "ipc", "--plot", "x.png"]) == 2
    assert "pip install 'devipc[plot]'" in capsys.readouterr().err


def test_progress_without_tqdm_prints_one_line_a_step(monkeypatch, capsys):
    from devipc._bench.common import Progress

    monkeypatch.setitem(sys.modules, "tqdm", None)
    progress = Progress("ipc")
    progress.start(2)
    progress.step("4 KiB devipc 300 us")
    progress.close()
    assert capsys.readouterr().err == "[1/2] ipc: 4 KiB devipc 300 us\n"
