"""Threads on one Connection while the owner ends registrations under them: a bounded run of
benchmarks/p2p_stress.py (in a subprocess: a crash is a failed test, not a dead run)."""
import json
import os
import subprocess
import sys

import pytest
from _support import FRESH_TIMEOUT

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks",
                      "p2p_stress.py")


@pytest.mark.slow
def test_threads_on_one_connection_under_deregistrations_never_crash():
    done = subprocess.run([sys.executable, SCRIPT, "--threads", "4", "--transfers", "600"],
                          capture_output=True, text=True, timeout=FRESH_TIMEOUT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout[done.stdout.index("{"):])
    assert result["transfers"] == 2400 and result["ok"] > 0 and result["wrong_bytes"] == 0
    assert result["other_errors"] == 0, result["first_errors"]  # each failure: freed
    assert result["registrations_replaced"] > 0 and result["mapped_after"] == 0
