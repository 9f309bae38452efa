"""A bounded run of the handle fuzzer (benchmarks/fuzz_handles.py), through the same code, in both
openreg IPC modes: no crash, no hang, no wrong error type, no forged handle accepted."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import fuzz_handles

MUTATIONS = 500


@pytest.mark.parametrize("mode", ["sync", "events"])
def test_fuzzed_handles_are_refused_cleanly(mode, monkeypatch):
    monkeypatch.setenv("OPENREG_IPC_EVENTS", "0")  # restored afterwards; fuzz() sets its own
    report = fuzz_handles.fuzz(mode, MUTATIONS, seed=11)
    assert sum(report.counts.values()) == MUTATIONS
    assert report.still_held == 0
    assert not report.failures, report.failures  # no wrong outcome, no crash, no hang


@pytest.mark.parametrize("mode", ["sync", "events"])
def test_fuzzed_wire_messages_of_every_kind_are_refused_cleanly(mode):
    """benchmarks/fuzz_wire.py, bounded: typed handles, buckets, arena attachments and chunks,
    weight subscription tokens, p2p descriptors and metadata."""
    import fuzz_wire

    report = fuzz_wire.fuzz(mode, 700, seed=5)
    assert sum(report.counts.values()) == 700
    assert {kind for kind, _ in report.by_kind} == set(fuzz_wire.KINDS)
    assert not report.failures, report.failures  # no wrong error type, no crash, no hang
