"""Activation recomputation as a planner choice: priced as hand-computed, chosen only where memory binds, exact."""

import json

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner import synthetic
from partitioner.cluster import Cluster
from partitioner.compile import plan_from_graph
from partitioner.cost import evaluate
from partitioner.errors import MemoryLimitError, PlanningError
from partitioner.graph import OpGraph
from partitioner.plan import Plan, schedule_for
from partitioner.problem import graph_order
from partitioner.recompute import peak_recomputing
from partitioner.simulate import simulate, stage_costs_from
from partitioner.solve import solve


def four_ops() -> OpGraph:
    """a (matmul) -> b -> c (matmul) -> d with the profiler's saved-bytes figures, chosen by hand.

    b saves a's output (charged to a), c saves b's output (charged to b) plus 30 bytes of its
    own, d saves its own output; c's 50-byte output is saved by nobody.
    """
    g = nx.DiGraph()
    rows = {  # fwd, bwd, params, flops, out_bytes, saved, saved_output, storage
        "a": (1.0, 2.0, 10, 100, 100, 100, 100, 100),
        "b": (0.5, 1.0, 0, 0, 100, 100, 100, 100),
        "c": (1.0, 2.0, 10, 100, 50, 30, 0, 50),
        "d": (0.2, 0.4, 0, 0, 20, 20, 20, 20),
    }
    for i, (name, (fwd, bwd, params, flops, out, saved, saved_out, storage)) in enumerate(rows.items()):
        g.add_node(name, fwd=fwd, bwd=bwd, params=params, flops=flops, out_bytes=out, saved_bytes=saved,
                   saved_output_bytes=saved_out, storage_bytes=storage, index=i, op="op")
    g.add_edges_from([("a", "b"), ("b", "c"), ("c", "d")])
    return OpGraph(g, {"activations": "saved_bytes"})


# By hand, gpipe with 4 microbatches (4 in flight on every stage), state factor 4 (40 bytes per
# 10-byte parameter op), free links, one stage per choice:
#   one stage:   none kept 250 -> 80 + 4*250 = 1080, time 8.1
#                selective keeps a (100) and c (50 output + 30 own) = 180, re-creates b and d (120),
#                recomputes b, d (0.7 s): 80 + 720 + 120 = 920, time 8.8
#                full keeps nothing, re-creates 250, recomputes 2.7 s: 80 + 250 = 330, time 10.8
ONE_STAGE = {"none": (1080.0, 8.1, 0.0), "selective": (920.0, 8.8, 0.7), "full": (330.0, 10.8, 2.7)}
#   {a, b} | {c, d}: stage 0 sends b's output (100 bytes), stage 1 receives it.
#     stage 0: none keeps 200 (b's output is saved whole: nothing more) -> 840, time 4.5
#              selective keeps a 100 + the sent b 100, re-creates 100 -> 40 + 800 + 100 = 940, time 5.0
#              full keeps the sent b 100, re-creates 200 -> 40 + 400 + 200 = 640, time 6.0
#     stage 1: none keeps 30 + 20 + received 100 -> 40 + 600 = 640, time 3.6
#              selective keeps c 80 + received 100, re-creates d 20 -> 40 + 720 + 20 = 780, time 3.8
#              full keeps the received 100, re-creates 50 -> 40 + 400 + 50 = 490, time 4.8
TWO_STAGES = {"none": ((840.0, 4.5), (640.0, 3.6)), "selective": ((940.0, 5.0), (780.0, 3.8)),
              "full": ((640.0, 6.0), (490.0, 4.8))}
CUT = {"a": 0, "b": 0, "c": 1, "d": 1}
OPTS = dict(microbatches=4, schedule="gpipe")


@pytest.mark.parametrize("choice", ["none", "selective", "full"])
def test_each_choice_is_priced_as_computed_by_hand(choice):
    one = evaluate(four_ops(), dict.fromkeys("abcd", 0), recompute=choice, **OPTS)
    memory, time, recompute = ONE_STAGE[choice]
    st0 = one.stages[0]
    assert (st0.memory, st0.time, st0.recompute_time) == pytest.approx((memory, time, recompute))
    assert st0.recompute == choice
    two = evaluate(four_ops(), CUT, recompute=choice, **OPTS)
    for stage, (memory, time) in zip(two.stages, TWO_STAGES[choice]):
        assert (stage.memory, stage.time) == pytest.approx((memory, time))
    assert two.recompute == [choice, choice]


def test_choices_per_stage_and_auto_take_the_fastest_that_fits():
    mixed = evaluate(four_ops(), CUT, recompute=["full", "none"], **OPTS)
    assert [s.memory for s in mixed.stages] == pytest.approx([640.0, 640.0])
    assert mixed.bottleneck == pytest.approx(6.0) and mixed.recompute_mode == "given"
    # 700 bytes: stage 0 fits only under full (640); stage 1 fits without recomputation (640)
    auto = evaluate(four_ops(), CUT, recompute="auto", memory_limit=700, **OPTS)
    assert auto.recompute == ["full", "none"] and auto.memory_ok
    assert auto.bottleneck == pytest.approx(6.0)
    # 900 bytes: both fit without; 850: stage 0 needs it, and full (640) is the only choice under 850
    assert evaluate(four_ops(), CUT, recompute="auto", memory_limit=900, **OPTS).recompute == ["none", "none"]
    # a limit nothing meets: auto reports the least-memory choice and the violation, evaluate never raises
    tight = evaluate(four_ops(), CUT, recompute="auto", memory_limit=100, **OPTS)
    assert tight.recompute == ["full", "full"] and not tight.memory_ok


def test_auto_recomputes_only_when_the_limit_binds():
    unlimited = solve(four_ops(), 2, **OPTS)
    assert unlimited.recompute == ["none", "none"] and unlimited.recompute_mode == "auto"
    loose = solve(four_ops(), 2, memory_limit=2000, **OPTS)
    assert loose.recompute == ["none", "none"]
    assert loose.bottleneck == pytest.approx(solve(four_ops(), 2, memory_limit=2000, recompute="none", **OPTS).bottleneck)
    tight = solve(four_ops(), 2, memory_limit=700, **OPTS)
    assert "full" in tight.recompute and tight.memory_ok
    best = synthetic.brute_force(four_ops(), 2, memory_limit=700, **OPTS)
    assert tight.bottleneck == pytest.approx(best.bottleneck) and tight.optimal


def test_none_under_a_binding_limit_is_refused_with_the_least_memory_that_works():
    # contiguous cuts without recomputation: {a}|{bcd} needs 1040, {ab}|{cd} 840, {abc}|{d} 1200
    with pytest.raises(MemoryLimitError) as err:
        solve(four_ops(), 2, memory_limit=700, recompute="none", **OPTS)
    assert err.value.works == pytest.approx(840.0)
    assert err.value.recompute_fits is True
    message = str(err.value)
    assert "840 B" in message and "with recomputation it fits" in message and "'full'" in message
    # the figure works: at 840 bytes a plan without recomputation exists
    ok = solve(four_ops(), 2, memory_limit=err.value.works, recompute="none", **OPTS)
    assert ok.memory_ok and max(s.memory for s in ok.stages) == pytest.approx(840.0)


def test_a_limit_nothing_meets_says_recomputation_does_not_help_either():
    with pytest.raises(MemoryLimitError) as err:
        solve(four_ops(), 2, memory_limit=300, recompute="none", **OPTS)
    assert err.value.recompute_fits is False
    assert "does not fit either" in str(err.value)
    with pytest.raises(MemoryLimitError) as auto:
        solve(four_ops(), 2, memory_limit=300, **OPTS)
    assert auto.value.recompute_fits is None  # recomputation was allowed: nothing to suggest


def test_forced_recomputation_is_refused_for_inference():
    with pytest.raises(PlanningError, match="training only"):
        solve(four_ops(), 2, training=False, recompute="full")
    assert solve(four_ops(), 2, training=False, memory_limit=1e9).recompute == ["none", "none"]
    with pytest.raises(PlanningError, match="unknown recompute"):
        solve(four_ops(), 2, recompute="some")


def test_zero_bubble_keeps_recomputed_activations_until_w():
    # ZB-H1 defers W, so a stage holds several microbatches' recomputed activations at once
    assert peak_recomputing("1f1b", 4, 8) == [1, 1, 1, 1]
    zb = peak_recomputing("zb-h1", 4, 8)
    assert max(zb) > 1
    part = evaluate(four_ops(), CUT, recompute="full", microbatches=8, schedule="zb-h1")
    for s in part.stages:
        assert s.recomputing == zb[s.index]
        assert s.memory == pytest.approx(s.params * 4 + s.in_flight * s.activations + zb[s.index] * s.recompute_bytes)


# ---------------------------------------------------------------- simulator and plan


def test_simulator_adds_the_recomputation_to_each_b_and_marks_it():
    none = evaluate(four_ops(), CUT, recompute="none", **OPTS)
    full = evaluate(four_ops(), CUT, recompute="full", **OPTS)
    sched = schedule_for("gpipe", none, 4, 2)
    a = simulate(sched, stage_costs_from(none.stages, none.transfers))
    b = simulate(sched, stage_costs_from(full.stages, full.transfers))
    r = [e for e in b.timeline.events if e.kind == "R"]
    assert len(r) == 8  # one per B: 4 microbatches x 2 stages
    for e in r:  # the recomputed forward opens its B, which then takes the backward's own time
        stage = full.stages[e.stage]
        assert e.duration == pytest.approx(stage.recompute_time)
        follow = [x for x in b.timeline.events if x.kind == "B" and x.stage == e.stage and x.mb == e.mb]
        assert follow[0].start == pytest.approx(e.end)
        assert follow[0].duration == pytest.approx(stage.bwd)
    assert not [e for e in a.timeline.events if e.kind == "R"]
    for s in range(2):
        assert b.busy_time[s] - a.busy_time[s] == pytest.approx(4 * full.stages[s].recompute_time)
    # By hand, free links: stage 0's four F (1.5 each), stage 1's last F (1.2), stage 1's first B
    # (2.4 + 1.2 recomputed), then stage 0's four B back to back (3.0 + 1.5 recomputed each, longer
    # than stage 1's): 6 + 1.2 + 3.6 + 18 = 28.8, against 6 + 1.2 + 2.4 + 12 = 21.6 without
    assert b.step_time == pytest.approx(28.8)
    assert a.step_time == pytest.approx(21.6)


def test_simulated_peak_memory_counts_the_recomputed_microbatch():
    part = evaluate(four_ops(), CUT, recompute="full", **OPTS)
    p = plan_from_graph(four_ops(), stages=2, microbatches=4, schedule="gpipe", recompute="full")
    res = simulate(p.schedule, stage_costs_from(part.stages, part.transfers,
                                                act_bytes=[s.activations for s in part.stages]))
    for s in part.stages:  # gpipe: all 4 kept, plus one microbatch re-created during its B
        assert res.peak_activation_bytes[s.index] == pytest.approx(4 * s.activations + s.recompute_bytes)
    assert p.rank_memory == pytest.approx(p.stage_memory)


def test_plan_carries_the_choice_and_old_plans_load_as_none(tmp_path):
    p = plan_from_graph(four_ops(), stages=2, microbatches=4, schedule="gpipe", memory_limit=700)
    assert p.recompute == [s.recompute for s in p.partition.stages] and "full" in p.recompute
    assert p.stage_memory == [s.memory for s in p.partition.stages] and max(p.stage_memory) <= 700
    loaded = Plan.load(p.save(tmp_path / "plan.json"))
    assert loaded.recompute == p.recompute and loaded.stage_memory == pytest.approx(p.stage_memory)
    data = json.loads((tmp_path / "plan.json").read_text())
    for stage in data["partition"]["stages"]:  # a plan written before recomputation existed
        for key in ("recompute", "recompute_time", "recompute_bytes", "recomputing"):
            del stage[key]
    del data["partition"]["recompute_mode"]
    old = Plan.from_dict(data)
    assert old.recompute == ["none", "none"]
    data["partition"]["stages"][0]["recompute"] = "sometimes"
    with pytest.raises(PlanningError, match="recompute 'sometimes'"):
        Plan.from_dict(data)


def test_resimulate_keeps_each_stage_choice():
    p = plan_from_graph(four_ops(), stages=2, microbatches=4, schedule="gpipe", memory_limit=700)
    again = p.resimulate(schedule="1f1b")
    assert again.recompute == p.recompute


# ---------------------------------------------------------------- exact against the oracle


@st.composite
def saved_graphs(draw):
    """A random DAG of 2-7 ops with the profiler's activation figures (views, matmuls, unsaved outputs)."""
    n = draw(st.integers(2, 7))
    g = nx.DiGraph()
    for i in range(n):
        storage = draw(st.integers(0, 6)) * 1000
        saved_out = draw(st.integers(0, storage // 1000)) * 1000
        view_of = ""
        if i and draw(st.integers(0, 4)) == 0:
            view_of, storage, saved_out = f"v{draw(st.integers(0, i - 1))}", 0, 0
        g.add_node(f"v{i}", fwd=draw(st.integers(1, 20)) * 1e-3, bwd=draw(st.integers(0, 40)) * 1e-3,
                   params=draw(st.integers(0, 3)) * 500, flops=draw(st.sampled_from([0, 0, 1000])),
                   out_bytes=max(storage, draw(st.integers(0, 4)) * 1000),
                   saved_bytes=saved_out + draw(st.integers(0, 3)) * 1000, saved_output_bytes=saved_out,
                   storage_bytes=storage, view_of=view_of, index=i, op="op")
        for j in range(i):
            if draw(st.booleans()) or f"v{j}" == view_of:
                g.add_edge(f"v{j}", f"v{i}")
    graph = OpGraph(g, {"activations": "saved_bytes"})
    p = draw(st.integers(2, min(3, n)))
    cluster = draw(st.sampled_from([None, Cluster.uniform(p, bandwidth=1e6, latency=1e-4)]))
    opts = dict(cluster=cluster, microbatches=draw(st.integers(1, 4)),
                schedule=draw(st.sampled_from(["1f1b", "gpipe", "zb-h1"])))
    whole = evaluate(graph, {v: 0 for v in graph.nx}, recompute="none", **opts).stages[0].memory
    opts["memory_limit"] = draw(st.sampled_from([0.4, 0.6, 0.8, 1.0])) * whole + 1
    opts["recompute"] = draw(st.sampled_from(["auto", "auto", "none", "selective", "full"]))
    return graph, p, opts


@settings(max_examples=int(__import__("os").environ.get("RECOMPUTE_EXAMPLES", 150)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(saved_graphs())
def test_solvers_choose_partition_and_recomputation_as_the_oracle(case):
    """dp, cpsat and auto against brute force over every assignment and every combination of choices."""
    graph, p, opts = case
    try:
        best = synthetic.brute_force(graph, p, **opts)
    except MemoryLimitError:
        best = None
    order = graph_order(graph)[1]
    try:
        best_in_order = synthetic.brute_force(graph, p, order=order, **opts)
    except MemoryLimitError:
        best_in_order = None
    for method in ("dp", "cpsat", "auto"):
        try:
            part = solve(graph, p, method=method, **opts)
        except MemoryLimitError:
            assert (best_in_order if method == "dp" else best) is None, method
            continue
        synthetic.assert_valid(graph, part)
        assert part.lower_bound <= best.bottleneck * (1 + 1e-6)
        if method == "dp":
            assert part.bottleneck == pytest.approx(best_in_order.bottleneck, rel=1e-9)
        else:
            assert part.bottleneck == pytest.approx(best.bottleneck, rel=1e-6)
            assert part.optimal
        if opts["recompute"] != "auto":
            assert part.recompute == [opts["recompute"]] * p


def test_dp_whose_relaxed_cuts_do_not_fit_reports_no_cut_instead_of_an_infinite_bound():
    """Found by the oracle test: the lower DP misses the storage a sent view keeps, so its cuts fitted only in
    its relaxed memory; dp returned an infinite "order bound" for a single-order graph, and CP-SAT, handed
    it as the bound to beat, failed on NaN."""
    g = nx.DiGraph()
    rows = {"v0": (1000, 0, 1000, ""), "v1": (0, 1000, 0, ""), "v2": (1000, 0, 0, "v0"), "v3": (0, 0, 0, "")}
    for i, (name, (out, saved, storage, view_of)) in enumerate(rows.items()):
        g.add_node(name, fwd=1e-3, bwd=0.0, params=0, flops=0, out_bytes=out, saved_bytes=saved,
                   saved_output_bytes=0, storage_bytes=storage, view_of=view_of, index=i, op="op")
    g.add_edges_from([("v0", "v1"), ("v0", "v2"), ("v1", "v2"), ("v2", "v3")])
    graph = OpGraph(g, {"activations": "saved_bytes"})
    opts = dict(microbatches=1, schedule="1f1b", memory_limit=1001.0)
    with pytest.raises(MemoryLimitError):  # nothing fits: the oracle says so ...
        synthetic.brute_force(graph, 2, **opts)
    for method in ("dp", "auto", "cpsat"):  # ... and so does every solver, with the least memory that works
        with pytest.raises(MemoryLimitError, match="fits in 1.95 KiB"):
            solve(graph, 2, method=method, **opts)
