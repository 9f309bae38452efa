"""benchmarks/fleet_sim.py, the relay's discrete-event model: its basic truths, small."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import fleet_sim

MIB = 1 << 20
CHUNK = 64 << 10  # 4 MiB in 64 chunks: a short generation, quick to simulate
COSTS = fleet_sim.Costs(goodput=25e6, hop_latency=0.01, chunk_overhead=0.0002, notice=0.002)
FROZEN = fleet_sim.Stragglers(frozen_at=0.2, frozen_for=5.0)


def test_one_engine_takes_one_copy_at_the_link_goodput():
    result = fleet_sim.simulate(1, 4 * MIB, CHUNK, COSTS)
    assert result.seconds == pytest.approx(COSTS.notice + 4 * MIB / COSTS.goodput, rel=1e-9)
    assert result.trainer_copies == 1.0


@pytest.mark.parametrize("topology", ["chain", "tree", "striped"])
@pytest.mark.parametrize("policy", ["trainer", "ahead"])
def test_without_stragglers_the_trainer_link_carries_one_copy(topology, policy):
    result = fleet_sim.simulate(8, 4 * MIB, CHUNK, COSTS, topology, 2, fleet_sim.Rules(policy))
    assert result.trainer_copies == 1.0
    assert result.seconds > fleet_sim.simulate(1, 4 * MIB, CHUNK, COSTS).seconds


def test_a_frozen_engine_costs_trainer_fallback_more_copies_than_nearest_ahead():
    def copies(policy):
        rules = fleet_sim.Rules(policy)
        return fleet_sim.simulate(8, 4 * MIB, CHUNK, COSTS, rules=rules, stragglers=FROZEN)

    fallback, ahead = copies("trainer"), copies("ahead")
    assert fallback.trainer_copies > 1.5  # its downstream, and theirs in turn, to the trainer
    assert ahead.trainer_copies == 1.0
    assert ahead.on_time < fallback.on_time


def test_a_chain_longer_than_the_stall_stampedes_under_trainer_fallback():
    """Main's stall is counted from the pull's start: an engine more than RELAY_STALL of hops
    down the chain leaves its upstream before the first chunk comes."""
    slow_hops = fleet_sim.Costs(goodput=25e6, hop_latency=0.2, chunk_overhead=0.0002)
    rules = fleet_sim.Rules("trainer", stall=1.0)
    assert fleet_sim.simulate(4, MIB, CHUNK, slow_hops, rules=rules).trainer_copies == 1.0
    assert fleet_sim.simulate(12, MIB, CHUNK, slow_hops, rules=rules).trainer_copies > 1.0
    judged = fleet_sim.Rules("ahead", stall=1.0)
    assert fleet_sim.simulate(12, MIB, CHUNK, slow_hops, rules=judged).trainer_copies == 1.0


def test_striped_trees_use_each_engine_uplink_in_one_stripe_only():
    parents = fleet_sim.layout("striped", 16, 4)
    assert len(parents) == 4
    serving = [{p for p in stripe[1:] if p != fleet_sim.TRAINER} for stripe in parents]
    assert all(not a & b for i, a in enumerate(serving) for b in serving[i + 1 :])
    assert [stripe[1:].count(fleet_sim.TRAINER) for stripe in parents] == [1, 1, 1, 1]
    assert fleet_sim.layout("chain", 4, 2) == [[0, 0, 1, 2, 3]]


def test_calibration_reproduces_its_points_and_predicts_eight_engines_within_15_percent():
    chunk = 512 << 10  # the relay's chunk for 64 MiB
    costs = fleet_sim.calibrate(fleet_sim.MEASURED, chunk)
    nbytes = fleet_sim.MEASURED["mib"] * MIB
    for k, measured in fleet_sim.MEASURED["seconds"].items():
        model = fleet_sim.simulate(k, nbytes, chunk, costs).seconds
        tolerance = 0.01 if k in fleet_sim.FIT else 0.15
        assert model == pytest.approx(measured, rel=tolerance), k


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="topology"):
        fleet_sim.layout("ring", 4, 2)
    with pytest.raises(ValueError, match="policy"):
        fleet_sim.simulate(2, MIB, CHUNK, COSTS, rules=fleet_sim.Rules("random"))
