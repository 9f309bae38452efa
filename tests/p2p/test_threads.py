"""Threads on one Connection while the owner ends registrations under them: a bounded run of
benchmarks/p2p_stress.py (in a subprocess: a crash is a failed test, not a dead run); and while
the owner dies: every thread hears it."""

import json
import os
import subprocess
import sys
import threading
import time

import _p2p_workers
import pytest
import torch
from _support import FRESH_TIMEOUT, TIMEOUT, recv

import devipc.p2p as p2p

SCRIPT = os.path.join(
    os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "p2p_stress.py"
)


@pytest.mark.slow
def test_threads_on_one_connection_under_deregistrations_never_crash():
    done = subprocess.run(
        [sys.executable, SCRIPT, "--threads", "4", "--transfers", "600"],
        capture_output=True,
        text=True,
        timeout=FRESH_TIMEOUT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout[done.stdout.index("{") :])
    assert result["transfers"] == 2400 and result["ok"] > 0 and result["wrong_bytes"] == 0
    assert result["other_errors"] == 0, result["first_errors"]  # each failure: freed
    assert result["registrations_replaced"] > 0 and result["mapped_after"] == 0


OPS = ("read cpu", "read openreg", "read_async", "readv", "prepared", "write")


@pytest.mark.usefixtures("ipc_mode")
def test_every_thread_of_a_connection_learns_that_the_owner_died(children):
    """Threads transferring on one connection when its owner is SIGKILLed: each one's next
    failure is PeerGoneError, also in the threads that find the connection already closed by
    the first (before: "this connection is closed" or RemoteTensorFreedError)."""
    proc, conn = children.start_piped(_p2p_workers.owner)
    _, _, metadata = recv(conn)

    def call(*command):
        conn.send(command)
        return recv(conn)

    _, on_cpu = call("create", torch.arange(256, dtype=torch.float32), "cpu")
    _, on_openreg = call("create", torch.arange(256, dtype=torch.float32), "openreg")
    endpoint = p2p.Endpoint()
    connection = endpoint.connect(metadata)
    started = {op: threading.Event() for op in OPS}
    failures: dict[str, BaseException] = {}
    deadline = time.monotonic() + TIMEOUT

    def transfer(op):
        local = torch.zeros(256, device="openreg" if op.endswith("openreg") else "cpu")
        if op == "prepared":
            prepared = connection.prepare("read", [local], [on_openreg])
        try:
            while time.monotonic() < deadline:
                if op.startswith("read "):
                    connection.read(local, on_cpu if op == "read cpu" else on_openreg)
                elif op == "read_async":
                    connection.read_async(local, on_cpu).wait(TIMEOUT)
                elif op == "readv":
                    connection.readv([local, local.clone()], [on_cpu, on_openreg])
                elif op == "prepared":
                    prepared.post().wait(TIMEOUT)
                else:
                    connection.write(local, on_openreg)
                started[op].set()
        except BaseException as error:  # noqa: BLE001 - what the test checks
            failures[op] = error

    threads = [threading.Thread(target=transfer, args=(op,)) for op in OPS]
    try:
        for thread in threads:
            thread.start()
        for op in OPS:
            assert started[op].wait(TIMEOUT), f"{op} never transferred"
        proc.kill()
        for thread in threads:
            thread.join(TIMEOUT)
        assert not any(thread.is_alive() for thread in threads)
        found = {op: type(error).__name__ for op, error in failures.items()}
        assert found == dict.fromkeys(OPS, "PeerGoneError"), failures
    finally:
        deadline = 0  # every thread stops at its next check
        for thread in threads:
            thread.join(TIMEOUT)
        endpoint.close()
