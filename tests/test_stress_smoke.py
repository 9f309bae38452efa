"""A bounded run of benchmarks/stress.py: 2 consumers x 300 small tensors, memory and fds back."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import stress


def test_many_small_tensors_to_two_consumers_come_back(ipc_mode):
    result = stress.run(consumers=2, tensors=300, nbytes=4096, window=16)
    assert result["exit_codes"] == [0, 0]
    assert result["checksums_ok"] and result["memory_back"] and result["fds_back"], result
