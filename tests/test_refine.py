"""Step-time refinement: never worse than the bottleneck answer, valid, within memory; wins on skips."""

import pytest

from partitioner import Cluster, PlanningError, solve, synthetic
from partitioner.refine import simulated_step_time
from partitioner.synthetic import assert_valid


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_refinement_shortens_the_step_on_a_unet(schedule):
    graph = synthetic.unet(3, seed=1)
    cluster = Cluster.uniform(8, bandwidth=2e9, latency=2e-5)
    plain = solve(graph, 8, cluster=cluster, microbatches=8, schedule=schedule)
    refined = solve(graph, 8, cluster=cluster, microbatches=8, schedule=schedule, objective="step_time")
    assert_valid(graph, refined)
    assert refined.memory_ok
    before, after = simulated_step_time(plain), simulated_step_time(refined)
    assert after <= before * (1 + 1e-9)
    if schedule in ("1f1b", "gpipe"):  # here the bottleneck's answer leaves 2-9% on the table
        assert after < before * 0.98
    assert any("step-time refinement" in note for note in refined.notes)


def test_refinement_respects_memory_limits():
    graph = synthetic.transformer(6, seed=0)
    plain = solve(graph, 4, microbatches=4)
    limit = max(s.memory for s in plain.stages) * 1.01
    refined = solve(graph, 4, microbatches=4, memory_limit=limit, objective="step_time")
    assert all(s.memory <= limit * (1 + 1e-9) for s in refined.stages)
    assert simulated_step_time(refined) <= simulated_step_time(plain) * (1 + 1e-9)


def test_refinement_on_interleaved_needs_ranks():
    graph = synthetic.chain(24, seed=3)
    part = solve(graph, 4, microbatches=4, schedule="interleaved", objective="step_time", ranks=2)
    assert part.num_stages == 4
    assert simulated_step_time(part, ranks=2) > 0


def test_unknown_objective_is_refused():
    with pytest.raises(PlanningError, match="objective"):
        solve(synthetic.chain(6), 2, objective="speed")


def test_step_time_plan_is_never_slower_than_a_baseline_and_says_what_is_proven():
    # Here the bottleneck-optimal plan simulates 15% slower than the peers' balanced cuts.
    graph = synthetic.generate("encdec", 40, seed=1)
    cluster = Cluster.uniform(4, bandwidth=2e9, latency=2e-5)
    options = dict(cluster=cluster, microbatches=4, time_limit=1)
    plain = solve(graph, 4, **options)
    assert plain.objective == "bottleneck" and plain.bound_on == "bottleneck" and plain.optimal
    assert plain.simulated_step is None  # the bottleneck solve simulates nothing; a Plan does
    baselines = [solve(graph, 4, method=m, **options) for m in ("uniform", "params", "blocks")]
    fastest_peer = min(simulated_step_time(b) for b in baselines if b.memory_ok)
    assert fastest_peer < simulated_step_time(plain) * 0.9
    picked = solve(graph, 4, objective="step_time", **options)
    assert_valid(graph, picked)
    assert picked.simulated_step == pytest.approx(simulated_step_time(picked))
    assert picked.simulated_step <= fastest_peer * (1 + 1e-9)
    # Its bottleneck is above the proven optimum: the report must not call it optimal.
    assert picked.bottleneck > plain.bottleneck * 1.01 and not picked.optimal
    assert picked.lower_bound == pytest.approx(plain.lower_bound) and picked.gap > 0
    assert picked.bottleneck_plan == {"method": plain.method, "bottleneck": pytest.approx(plain.bottleneck),
                                      "simulated_step": pytest.approx(simulated_step_time(plain)), "optimal": True}
    data = picked.to_dict()
    assert data["objective"] == "step_time" and data["bound_on"] == "bottleneck"


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_many_microbatches_are_ranked_on_a_shorter_step_and_reported_in_full(schedule, monkeypatch):
    """Above RANKING_MICROBATCHES candidates are simulated shorter and extended by their bottleneck; the plan's
    own step is simulated in full and is never slower than the one the climb started from."""
    import partitioner.refine as refine

    graph = synthetic.unet(3, seed=1)
    cluster = Cluster.uniform(8, bandwidth=2e9, latency=2e-5)
    seen = []
    simulate = refine.simulated_step_time

    def counting(part, *args, **kw):
        seen.append(kw.get("microbatches") or part.microbatches)
        return simulate(part, *args, **kw)

    monkeypatch.setattr(refine, "simulated_step_time", counting)
    plain = solve(graph, 8, cluster=cluster, microbatches=96, schedule=schedule)
    refined = solve(graph, 8, cluster=cluster, microbatches=96, schedule=schedule, objective="step_time")
    assert_valid(graph, refined)
    assert refine.RANKING_MICROBATCHES in seen and 96 in seen  # estimates, and the ends in full
    assert refined.simulated_step == pytest.approx(simulate(refined))
    assert refined.simulated_step <= simulate(plain) * (1 + 1e-9)


def test_a_long_pipeline_simulates_fewer_candidates_for_the_same_work(monkeypatch):
    """Each simulation's work grows with stages x microbatches: beyond REFINE_STAGE_MICROBATCHES the climb
    simulates fewer candidates, so a 32-stage plan of a 70B model refines in seconds, not minutes."""
    import partitioner.refine as refine

    assert refine.refine_simulations(8, 32) == refine.REFINE_SIMULATIONS  # every plan docs/ shows: as before
    assert refine.refine_simulations(16, 64) == refine.REFINE_SIMULATIONS
    assert refine.refine_simulations(32, 64) == refine.REFINE_SIMULATIONS // 2
    assert refine.refine_simulations(128, 256) == refine.REFINE_MIN_SIMULATIONS
    graph = synthetic.chain(400, seed=2)
    calls = []
    simulate = refine.simulated_step_time

    def counting(part, *args, **kw):
        calls.append(part.num_stages)
        return simulate(part, *args, **kw)

    monkeypatch.setattr(refine, "simulated_step_time", counting)
    common = dict(cluster=Cluster.uniform(16, bandwidth=2e9, latency=2e-5), microbatches=32, objective="step_time",
                  method="dp")
    solve(graph, 16, **common)
    uncapped, calls[:] = len(calls), []
    # a small graph standing in for a large one: its work counted as if each simulation were 16 times longer
    monkeypatch.setattr(refine, "REFINE_STAGE_MICROBATCHES", 16 * 32 // 16)
    monkeypatch.setattr(refine, "REFINE_MIN_SIMULATIONS", 5)
    solve(graph, 16, **common)
    assert refine.refine_simulations(16, 32) == refine.REFINE_SIMULATIONS // 16 and uncapped > 30
    # the climb's own candidates, and its end simulated in full
    assert len(calls) <= refine.REFINE_SIMULATIONS // 16 + 1 < uncapped
