"""Scripts that end with devipc objects alive exit quickly: arenas, readers, endpoints,
connections, sends nobody opened, sent and received storages, an idle collector at shutdown
(a bounded run of benchmarks/exit_soak.py; `make stress` runs 100)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import exit_soak
from _support import wait_until

import devipc


@pytest.mark.slow
def test_scripts_ending_with_live_devipc_objects_exit_within_5_seconds():
    before = devipc.stats()["sent"]  # what earlier tests of this process still have out
    result = exit_soak.run(runs=len(exit_soak.MODES), limit=5.0)
    assert result["passed"] == result["runs"], result["failures"]
    wait_until(
        lambda: devipc.stats()["sent"] <= before,
        "the arena's sends to the exited readers ended",
        collect=True,
    )
