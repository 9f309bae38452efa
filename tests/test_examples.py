"""The examples run as a user runs them: a fresh interpreter, a clean exit, the last line."""
import subprocess
import sys
from pathlib import Path

from _support import FRESH_TIMEOUT, fresh_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_rl_weight_sync_example_matches_every_step():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "rl_weight_sync.py")],
                          env=fresh_env(), capture_output=True, text=True,
                          timeout=FRESH_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("step ") for line in lines) == 5, proc.stdout
    assert lines[-1] == "all engines matched the trainer at every step"
