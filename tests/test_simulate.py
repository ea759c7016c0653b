"""Tests for the discrete-event simulator, against pipeline theory."""

from __future__ import annotations

import json
from collections import namedtuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.schedule import Edge, stage_graph_from_transfers, StageGraph, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from partitioner.simulate import SimResult, StageCosts, comm_from_transfers, simulate, stage_costs_from
from partitioner.timeline import Timeline


def equal(S: int, f: float = 1.0, b: float = 2.0, w: float = 0.0, act: float | None = None) -> StageCosts:
    return StageCosts([f] * S, [b] * S, [w] * S, act_bytes=[act] * S if act is not None else None)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 3), (4, 8), (4, 2), (8, 32), (5, 7)])
def test_gpipe_and_1f1b_step_match_theory(p: int, m: int) -> None:
    f, b = 0.5, 1.0
    for sch in (gpipe(p, m), one_f_one_b(p, m)):
        r = simulate(sch, equal(p, f, b))
        assert r.step_time == pytest.approx((m + p - 1) * (f + b))
        assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert r.throughput == pytest.approx(m / r.step_time)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (8, 32), (3, 1)])
def test_peak_inflight(p: int, m: int) -> None:
    one = simulate(one_f_one_b(p, m), equal(p, act=10.0))
    assert one.peak_inflight == [min(m, p - i) for i in range(p)]
    assert one.peak_activation_bytes == [10.0 * min(m, p - i) for i in range(p)]
    gp = simulate(gpipe(p, m), equal(p))
    assert gp.peak_inflight == [m] * p and gp.peak_activation_bytes is None


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 16), (2, 8)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaving_cuts_bubble_v_fold(p: int, m: int, v: int) -> None:
    f, b = 1.0, 2.0  # per-rank work per microbatch; each virtual stage does 1/v of it
    base = simulate(one_f_one_b(p, m), equal(p, f, b))
    inter = simulate(interleaved_1f1b(p * v, m, p), equal(p * v, f / v, b / v))
    if m % p == 0:  # Megatron's exact figure
        assert inter.step_time == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)
        assert inter.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    bubble_base = base.step_time - m * (f + b)
    bubble_inter = inter.step_time - m * (f + b)
    assert bubble_inter == pytest.approx(bubble_base / v, rel=0.35)


def test_interleaved_with_uneven_rounds_is_close_to_theory() -> None:
    p, v, m = 4, 2, 10
    r = simulate(interleaved_1f1b(p * v, m, p), equal(p * v, 0.5, 1.0))
    ideal = m * 3.0 + (p - 1) * 3.0 / v
    assert ideal <= r.step_time <= ideal * 1.1


@pytest.mark.parametrize("p,m", [(4, 8), (8, 32), (4, 24), (2, 3)])
def test_zb_h1_bubble_is_a_third_of_1f1b(p: int, m: int) -> None:
    F = B = W = 1.0
    one = simulate(one_f_one_b(p, m), equal(p, F, B + W))
    zb = simulate(zb_h1(p, m), equal(p, F, B + W, W))
    assert one.step_time == pytest.approx(m * 3 + 3 * (p - 1))
    assert zb.step_time == pytest.approx(m * 3 + (p - 1))  # (p - 1)(F + B - W) bubble
    assert (zb.step_time - 3 * m) == pytest.approx((one.step_time - 3 * m) / 3)
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert max(zb.peak_inflight) == max(one.peak_inflight) == min(m, p)


def test_split_backward_with_zero_w_equals_full_backward() -> None:
    c = equal(4, 1.0, 2.0, 0.0)
    a = simulate(one_f_one_b(4, 6), c)
    b = simulate(one_f_one_b(4, 6, split_backward=True), c)
    assert a.step_time == pytest.approx(b.step_time)
    w = simulate(one_f_one_b(4, 6, split_backward=True), equal(4, 1.0, 2.0, 1.0))
    # even with W right after B, only B (input gradient) is on the backward critical path
    assert w.step_time < a.step_time


def test_comm_delays_and_skip_edges() -> None:
    g = StageGraph(3, (Edge(0, 1, "h", 8), Edge(1, 2, "h1", 8), Edge(0, 2, "skip", 8)))
    sch = gpipe(g, 1)
    f, b = 1.0, 2.0
    free = simulate(sch, equal(3, f, b))
    assert free.step_time == pytest.approx(3 * (f + b))
    comm = {(0, 1, "h"): 0.1, (1, 2, "h1"): 0.1, (0, 2, "skip"): 5.0}
    slow = simulate(sch, StageCosts([f] * 3, [b] * 3, comm=comm))
    # the skip's 5 s dominates: stage 2 waits for it both ways
    assert slow.step_time == pytest.approx(f + 5.0 + f + b + 5.0 + b)
    ev = {(e.stage, e.kind): e for e in slow.timeline.events}  # type: ignore[union-attr]
    assert ev[(2, "F")].start == pytest.approx(f + 5.0)
    assert ev[(1, "F")].start == pytest.approx(f + 0.1)


def test_local_handoff_costs_nothing() -> None:
    sch = interleaved_1f1b(4, 2, 1)  # one rank: all edges local
    comm = {(s, s + 1, f"s{s}_out"): 100.0 for s in range(3)}
    r = simulate(sch, StageCosts([1.0] * 4, [2.0] * 4, comm=comm))
    assert r.step_time == pytest.approx(2 * 4 * 3.0)
    assert r.bubble_fraction == pytest.approx(0.0)


def test_interleaved_per_rank_memory() -> None:
    r = simulate(interleaved_1f1b(8, 8, 4), equal(8, act=1.0))
    assert r.peak_activation_bytes_per_rank is not None
    assert len(r.peak_activation_bytes_per_rank) == 4
    for rank in range(4):
        stages = [rank, rank + 4]
        assert r.peak_activation_bytes_per_rank[rank] <= sum(r.peak_inflight[s] for s in stages)
        assert r.peak_activation_bytes_per_rank[rank] >= max(r.peak_inflight[s] for s in stages)


def test_errors() -> None:
    sch = one_f_one_b(3, 2)
    with pytest.raises(ValueError, match="schedule has 3"):
        simulate(sch, equal(2))
    with pytest.raises(KeyError, match="no time for cut edge 1->2"):
        simulate(sch, StageCosts([1.0] * 3, [1.0] * 3, comm={(0, 1, "s0_out"): 0.1}))
    with pytest.raises(ValueError, match="exceeds bwd"):
        StageCosts([1.0], [1.0], [2.0])
    with pytest.raises(ValueError, match="bwd has 2"):
        StageCosts([1.0], [1.0, 1.0])


def test_duck_typed_costs_from_partition() -> None:
    Stage = namedtuple("Stage", "fwd bwd bwd_w")
    Transfer = namedtuple("Transfer", "src_stage dst_stage node bytes seconds")
    stages = [Stage(1.0, 2.0, 1.0), Stage(1.0, 2.0, 0.5)]
    transfers = [Transfer(0, 1, "x", 16, 0.25)]
    c = stage_costs_from(stages, transfers, act_bytes=[4.0, 4.0])
    assert c.comm == comm_from_transfers(transfers) == {(0, 1, "x"): 0.25}
    r = simulate(zb_h1(stage_graph_from_transfers(2, transfers), 1), c)
    # F0, comm, F1, B1 (2 - 0.5), comm, B0 (2 - 1), W0 after: 1 + .25 + 1 + 1.5 + .25 + 1 + 1
    assert r.step_time == pytest.approx(6.0)


def test_result_and_timeline_serialise() -> None:
    r = simulate(zb_h1(4, 4), equal(4, 1.0, 2.0, 1.0, act=2.0), samples_per_microbatch=8)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["step_time"] == r.step_time and r.samples_per_second == pytest.approx(8 * r.throughput)
    tl = Timeline.from_dict(d["timeline"])
    assert tl.events == r.timeline.events  # type: ignore[union-attr]
    assert tl.label == "predicted" and tl.num_ranks == 4
    assert tl.bubble_fraction == pytest.approx(r.bubble_fraction)
    assert isinstance(r, SimResult)


@settings(max_examples=30, deadline=None)
@given(S=st.integers(1, 6), m=st.integers(1, 6), which=st.integers(0, 3), seed=st.integers(0, 999),
       data=st.data())
def test_timeline_respects_ranks_and_dependencies(S: int, m: int, which: int, seed: int,
                                                  data: st.DataObject) -> None:
    import random

    rng = random.Random(seed)
    edges = [Edge(a, b, f"t{a}_{b}", 4) for a in range(S) for b in range(a + 1, S)
             if b == a + 1 or rng.random() < 0.3]
    g = StageGraph(S, tuple(edges))
    sch = [gpipe, one_f_one_b, zb_h1][which](g, m) if which < 3 else interleaved_1f1b(g, m, 1)
    fwd = [rng.uniform(0.1, 2) for _ in range(S)]
    bwd = [rng.uniform(0.2, 4) for _ in range(S)]
    bw = [x * rng.uniform(0, 1) for x in bwd]
    comm = {e.key: rng.uniform(0, 1) for e in edges}
    r = simulate(sch, StageCosts(fwd, bwd, bw, comm))
    ev = {(e.kind, e.stage, e.mb): e for e in r.timeline.events}  # type: ignore[union-attr]
    assert len(ev) == S * m * (3 if sch.split_backward else 2)
    cross = lambda a, b: sch.stage_to_rank[a] != sch.stage_to_rank[b]  # noqa: E731
    for e in edges:
        for k in range(m):
            c = comm[e.key] if cross(e.src, e.dst) else 0.0
            assert ev[("F", e.dst, k)].start >= ev[("F", e.src, k)].end + c - 1e-9
            assert ev[("B", e.src, k)].start >= ev[("B", e.dst, k)].end + c - 1e-9
    for rank in range(sch.num_ranks):
        spans = sorted((e.start, e.end) for e in r.timeline.events if e.rank == rank)  # type: ignore[union-attr]
        for (s0, e0), (s1, _) in zip(spans, spans[1:]):
            assert s1 >= e0 - 1e-9
    assert r.step_time == pytest.approx(max(e.end for e in ev.values()))
    assert r.step_time >= max(r.busy_time) - 1e-9

