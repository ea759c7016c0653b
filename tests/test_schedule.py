"""Tests for the schedule IR, the generators and the validator."""

from __future__ import annotations

import json
import random
from collections import Counter, namedtuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    Edge,
    Schedule,
    ScheduleError,
    ScheduleKind,
    StageGraph,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    peak_in_flight,
    stage_graph_from_transfers,
    with_allreduce,
    zb_h1,
)
from partitioner.recompute import peak_recomputing
from partitioner.simulate import StageCosts, simulate
from partitioner.walk import format_program, format_table, peak_held, peak_held_bytes, validate, walk

K = ActionKind


def skip_graph() -> StageGraph:
    """4 stages: a chain plus skips 0->2, 0->3, 1->3, two tensors on 1->2."""
    return StageGraph(4, (
        Edge(0, 1, "h0", 100), Edge(1, 2, "h1", 100), Edge(1, 2, "h1b", 10), Edge(2, 3, "h2", 100),
        Edge(0, 2, "skip02", 50), Edge(0, 3, "emb", 50), Edge(1, 3, "skip13", 50),
    ))


def no_neighbour_graph() -> StageGraph:
    """A DAG cut without some neighbour edges: 1 gets nothing from 0, 3 only from 0 and 1."""
    return StageGraph(4, (Edge(0, 2, "a", 1), Edge(1, 2, "b", 1), Edge(0, 3, "c", 1), Edge(1, 3, "d", 1)))


def random_graph(S: int, seed: int) -> StageGraph:
    rng = random.Random(seed)
    es = []
    for a in range(S):
        for b in range(a + 1, S):
            if rng.random() < (0.7 if b == a + 1 else 0.3):
                for k in range(rng.choice([1, 1, 2])):
                    es.append(Edge(a, b, f"t{a}_{b}_{k}", 8))
    return StageGraph(S, tuple(es))


def all_schedules(g: StageGraph, m: int) -> list[Schedule]:
    out = [gpipe(g, m), one_f_one_b(g, m), zb_h1(g, m), gpipe(g, m, split_backward=True),
           one_f_one_b(g, m, split_backward=True)]
    for p in range(1, g.num_stages + 1):
        if g.num_stages % p == 0:
            out.append(interleaved_1f1b(g, m, p))
            out.append(interleaved_1f1b(g, m, p, split_backward=True))
    return out


# ----------------------------------------------------------------------------- actions


def test_action_string_roundtrip_and_json() -> None:
    acts = [
        Action(K.F, 3, 2), Action(K.B, 0, 11), Action(K.W, 7, 0),
        Action(K.SEND_F, 3, 2, 5, "add_7"), Action(K.RECV_F, 5, 2, 3, "add_7"),
        Action(K.SEND_B, 5, 2, 3, "add_7"), Action(K.RECV_B, 3, 2, 5, "add_7"),
    ]
    assert [str(a) for a in acts[:4]] == ["F3.2", "B0.11", "W7.0", "SEND_F[3->5 t=add_7 mb=2]"]
    assert str(acts[5]) == "SEND_B[5->3 t=add_7 mb=2]"
    assert str(acts[6]) == "RECV_B[5->3 t=add_7 mb=2]"
    for a in acts:
        assert Action.parse(str(a)) == a
        assert Action.from_dict(json.loads(json.dumps(a.to_dict()))) == a
        assert hash(a) == hash(Action.parse(str(a)))
    assert acts[3].matching() == acts[4] and acts[4].matching() == acts[3]
    assert acts[5].matching() == acts[6]
    assert all(a.edge == (3, 5, "add_7") for a in acts[3:])
    with pytest.raises(AttributeError):
        acts[0].mb = 3  # type: ignore[misc]


@pytest.mark.parametrize("text", ["X1.2", "F1", "SEND_F[3->5 mb=2]", "SEND_F[5->3 t=x mb=2]", "F-1.2"])
def test_action_parse_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        Action.parse(text)


def test_action_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="peer"):
        Action(K.SEND_F, 1, 0)
    with pytest.raises(ValueError, match="whitespace"):
        Action(K.SEND_F, 1, 0, 2, "a b")
    with pytest.raises(ValueError, match="no peer"):
        Action(K.F, 1, 0, 2, "x")


# ----------------------------------------------------------------------------- graphs


def test_stage_graph_checks_and_converter() -> None:
    with pytest.raises(ValueError, match="src < dst"):
        StageGraph(3, (Edge(2, 1, "x"),))
    with pytest.raises(ValueError, match="duplicate"):
        StageGraph(3, (Edge(0, 1, "x"), Edge(0, 1, "x")))
    Transfer = namedtuple("Transfer", "src_stage dst_stage node bytes seconds")
    Node = namedtuple("Node", "name")
    g = stage_graph_from_transfers(3, [
        Transfer(0, 1, "relu", 64, 1e-3), Transfer(0, 2, Node("relu"), 64, 1e-3),
        Transfer(1, 2, "fc", 32, 1e-4), Transfer(1, 2, "fc", 32, 1e-4),
    ])
    assert [e.key for e in g.edges] == [(0, 1, "relu"), (0, 2, "relu"), (1, 2, "fc")]
    assert g.in_edges(2)[0].bytes == 64
    one_f_one_b(g, 4)


# ----------------------------------------------------------------------------- generators


@pytest.mark.parametrize("graph", [StageGraph.chain(4, 10), skip_graph(), no_neighbour_graph()],
                         ids=["chain", "skips", "no-neighbours"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_every_generator_validates(graph: StageGraph, m: int) -> None:
    for sch in all_schedules(graph, m):
        validate(sch)
        kinds = Counter((a.kind, a.stage) for prog in sch.actions for a in prog if a.is_compute)
        for s in range(graph.num_stages):
            assert kinds[(K.F, s)] == m and kinds[(K.B, s)] == m
            assert kinds[(K.W, s)] == (m if sch.split_backward else 0)
        # one SEND and one RECV per cross-rank edge, direction and microbatch
        comm = Counter(a.kind for prog in sch.actions for a in prog if not a.is_compute)
        cross = sum(1 for e in graph.edges if sch.stage_to_rank[e.src] != sch.stage_to_rank[e.dst])
        for kind in (K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B):
            assert comm[kind] == cross * m


@settings(max_examples=25, deadline=None)
@given(S=st.integers(1, 6), m=st.integers(1, 7), seed=st.integers(0, 10_000))
def test_generators_on_random_dag_cuts(S: int, m: int, seed: int) -> None:
    for sch in all_schedules(random_graph(S, seed), m):
        validate(sch)


def test_sends_follow_their_producer() -> None:
    sch = one_f_one_b(skip_graph(), 4)
    for prog in sch.actions:
        last_compute = None
        for a in prog:
            if a.is_compute:
                last_compute = a
            elif a.kind is K.SEND_F:
                assert last_compute == Action(K.F, a.stage, a.mb)
            elif a.kind is K.SEND_B:
                assert last_compute == Action(K.B, a.stage, a.mb)


def test_one_f_one_b_order_and_inflight() -> None:
    p, m = 4, 8
    sch = one_f_one_b(p, m)
    assert [str(a) for a in sch.compute_actions(3)][:4] == ["F3.0", "B3.0", "F3.1", "B3.1"]
    assert [str(a) for a in sch.compute_actions(0)][:5] == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0"]
    assert peak_held(sch.actions, p, sch.split_backward) == [min(m, p - i) for i in range(p)]


def test_gpipe_runs_all_forwards_first() -> None:
    sch = gpipe(3, 5)
    for r in range(3):
        kinds = [a.kind for a in sch.compute_actions(r)]
        assert kinds == [K.F] * 5 + [K.B] * 5


def test_interleaved_layout_and_local_handoff() -> None:
    sch = interleaved_1f1b(8, 8, 4)
    assert sch.stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    assert sch.stages_of(1) == [1, 5]
    assert sch.meta["virtual_stages"] == 2
    assert sch.local_edges() == []
    single = interleaved_1f1b(3, 4, 1)  # p = 1: every edge is a local hand-off
    assert single.num_ranks == 1
    assert all(a.is_compute for a in single.actions[0])
    assert len(single.local_edges(0)) == 2
    with pytest.raises(ValueError, match="multiple"):
        interleaved_1f1b(6, 4, 4)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_any_microbatch_count(p: int, v: int) -> None:
    for m in (1, p - 1, p, p + 1, 2 * p + 1, 3 * p):
        if m >= 1:
            validate(interleaved_1f1b(p * v, m, p, split_backward=(m % 2 == 0)))


def test_zb_h1_defers_w_by_rank() -> None:
    p, m = 4, 8
    sch = zb_h1(p, m)
    assert sch.split_backward
    for i in range(p):
        acts = sch.compute_actions(i)
        # W(k - i) follows B(k) once k >= i; the last i + 1 actions are W's
        assert all(a.kind is K.W for a in acts[-(i + 1):])
        assert acts[-(i + 2)].kind is K.B
    assert peak_held(sch.actions, p, sch.split_backward) == [p] * p  # F to W: each rank holds p at its peak


def test_json_roundtrip_of_schedule() -> None:
    for sch in all_schedules(skip_graph(), 3):
        d = json.loads(json.dumps(sch.to_dict()))
        back = Schedule.from_dict(d)
        assert back.actions == sch.actions
        assert back.stage_to_rank == sch.stage_to_rank and back.graph == sch.graph
        assert back.split_backward == sch.split_backward and back.name == sch.name
        validate(back)


def test_make_schedule_by_name() -> None:
    # one table of schedule kinds: every kind has a generator, and every spelling maps to its kind
    assert set(SCHEDULES) == set(ScheduleKind)
    assert {k.value for k in ScheduleKind} == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    for spelling, kind in (("interleaved_1f1b", "interleaved"), ("Interleaved", "interleaved"), ("zb_h1", "zb-h1"),
                           ("ZB-H1", "zb-h1"), ("1F1B", "1f1b"), ("gpipe", "gpipe")):
        assert ScheduleKind.parse(spelling).value == kind
        assert make_schedule(spelling, 4, 4, num_ranks=2).name == kind
    assert make_schedule("interleaved_1f1b", 4, 4, num_ranks=2).num_ranks == 2
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("pipedream", 4, 4)
    with pytest.raises(ValueError, match="microbatch"):
        gpipe(2, 0)


# ----------------------------------------------------------------------------- printing


def test_format_table_1f1b() -> None:
    text = format_table(one_f_one_b(4, 8))
    lines = text.splitlines()
    assert len(lines) == 5
    assert lines[4].split()[2:6] == [".", ".", ".", "F0"]
    assert lines[4].split()[5:9] == ["F0", "B0", "F1", "B1"]
    assert "B7" in lines[1]
    wide = format_table(one_f_one_b(2, 2), durations=(1, 2, 1))
    assert "-" in wide
    inter = format_table(interleaved_1f1b(4, 2, 2))
    assert "F2.0" in inter  # stage.mb labels with virtual stages
    prog = format_program(one_f_one_b(2, 1))
    assert "SEND_F[0->1 t=s0_out mb=0]" in prog and "RECV_B[1->0 t=s0_out mb=0]" in prog


# ----------------------------------------------------------------------------- validator errors


def edit(sch: Schedule, rank: int, new: list[Action]) -> Schedule:
    actions = list(sch.actions)
    actions[rank] = tuple(new)
    return Schedule(sch.name, sch.graph, sch.num_microbatches, sch.stage_to_rank, tuple(actions),
                    sch.split_backward)


def P(*texts: str) -> list[Action]:
    return [Action.parse(t) for t in texts]


def test_error_missing_action() -> None:
    sch = one_f_one_b(3, 4)
    prog = [a for a in sch.actions[1] if a != Action(K.B, 1, 2)]
    with pytest.raises(ScheduleError, match=r"missing B1\.2") as ei:
        validate(edit(sch, 1, prog))
    assert ei.value.rank == 1 and ei.value.action == Action(K.B, 1, 2)


def test_error_duplicate() -> None:
    sch = gpipe(2, 2)
    prog = list(sch.actions[0]) + [Action(K.F, 0, 1)]
    with pytest.raises(ScheduleError, match=r"duplicate.*rank 0 step") as ei:
        validate(edit(sch, 0, prog))
    assert ei.value.index == len(prog) - 1 and str(ei.value).startswith("rank 0 step")


def test_error_send_without_receive() -> None:
    sch = one_f_one_b(2, 2)
    gone = Action.parse("RECV_F[0->1 t=s0_out mb=1]")
    prog = [a for a in sch.actions[1] if a != gone]
    with pytest.raises(ScheduleError, match="send without a matching receive") as ei:
        validate(edit(sch, 1, prog))
    assert ei.value.action == Action.parse("SEND_F[0->1 t=s0_out mb=1]") and ei.value.rank == 0


def test_error_receive_without_send() -> None:
    sch = one_f_one_b(2, 1)
    gone = Action.parse("SEND_B[1->0 t=s0_out mb=0]")
    prog = [a for a in sch.actions[1] if a != gone]
    with pytest.raises(ScheduleError, match="receive without a matching send"):
        validate(edit(sch, 1, prog))


def test_error_deadlock_classic_1f1b_blocking_sends() -> None:
    # Rank 0 sends F1 while rank 1 sends B0: with rendezvous sends both wait forever.
    g = StageGraph.chain(2)
    rank0 = P("F0.0", "SEND_F[0->1 t=s0_out mb=0]", "F0.1", "SEND_F[0->1 t=s0_out mb=1]",
              "RECV_B[1->0 t=s0_out mb=0]", "B0.0", "RECV_B[1->0 t=s0_out mb=1]", "B0.1")
    rank1 = P("RECV_F[0->1 t=s0_out mb=0]", "F1.0", "B1.0", "SEND_B[1->0 t=s0_out mb=0]",
              "RECV_F[0->1 t=s0_out mb=1]", "F1.1", "B1.1", "SEND_B[1->0 t=s0_out mb=1]")
    sch = Schedule("bad", g, 2, (0, 1), (tuple(rank0), tuple(rank1)))
    with pytest.raises(ScheduleError, match="deadlock") as ei:
        validate(sch)
    assert ei.value.rank == 0 and ei.value.action == Action.parse("SEND_F[0->1 t=s0_out mb=1]")
    assert "rank 1 at SEND_B[1->0 t=s0_out mb=0]" in str(ei.value)
    # the fix: receive the gradient before sending the next activation
    fixed = P("F0.0", "SEND_F[0->1 t=s0_out mb=0]", "F0.1", "RECV_B[1->0 t=s0_out mb=0]",
              "SEND_F[0->1 t=s0_out mb=1]", "B0.0", "RECV_B[1->0 t=s0_out mb=1]", "B0.1")
    validate(Schedule("ok", g, 2, (0, 1), (tuple(fixed), tuple(rank1))))


def test_error_dependency_before_receive() -> None:
    g = StageGraph.chain(2)
    rank0 = P("F0.0", "SEND_F[0->1 t=s0_out mb=0]", "RECV_B[1->0 t=s0_out mb=0]", "B0.0")
    rank1 = P("F1.0", "RECV_F[0->1 t=s0_out mb=0]", "B1.0", "SEND_B[1->0 t=s0_out mb=0]")
    with pytest.raises(ScheduleError, match="before it is available") as ei:
        validate(Schedule("bad", g, 1, (0, 1), (tuple(rank0), tuple(rank1))))
    assert (ei.value.rank, ei.value.index) == (1, 0)


def test_walk_leaves_the_garbage_collector_as_it_found_it() -> None:
    # The walk pauses Python's cyclic collector (partitioner.walk.gc_paused); a schedule that
    # fails mid-walk must not leave it off for the rest of the user's process.
    import gc

    g = StageGraph.chain(2)
    bad = Schedule("bad", g, 1, (0, 1), (tuple(P("F0.0", "SEND_F[0->1 t=s0_out mb=0]", "RECV_B[1->0 t=s0_out mb=0]",
                                                  "B0.0")),
                                         tuple(P("F1.0", "RECV_F[0->1 t=s0_out mb=0]", "B1.0",
                                                 "SEND_B[1->0 t=s0_out mb=0]"))))
    assert gc.isenabled()
    with pytest.raises(ScheduleError):
        validate(bad)
    assert gc.isenabled()
    one_f_one_b(StageGraph.chain(3), 4)
    assert gc.isenabled()
    gc.disable()
    try:
        one_f_one_b(StageGraph.chain(3), 4)
        assert not gc.isenabled()  # off stays off
    finally:
        gc.enable()


def test_error_backward_before_forward_local() -> None:
    g = StageGraph.chain(2)
    sch = Schedule("bad", g, 1, (0, 0), (tuple(P("B1.0", "F0.0", "F1.0", "B0.0")),))
    with pytest.raises(ScheduleError, match=r"F1\.0 before it is available"):
        validate(sch)


def test_error_structural() -> None:
    g = StageGraph.chain(2)
    with pytest.raises(ScheduleError, match="lives on rank 1"):
        validate(Schedule("x", g, 1, (0, 1), (tuple(P("F1.0")), ())))
    with pytest.raises(ScheduleError, match="not split"):
        validate(Schedule("x", g, 1, (0, 1), (tuple(P("W0.0")), ())))
    with pytest.raises(ScheduleError, match="no such cut edge"):
        validate(Schedule("x", g, 1, (0, 1), (tuple(P("SEND_F[0->1 t=nope mb=0]")), ())))
    with pytest.raises(ScheduleError, match="local hand-off"):
        validate(Schedule("x", g, 1, (0, 0), (tuple(P("SEND_F[0->1 t=s0_out mb=0]")),)))
    with pytest.raises(ScheduleError, match="microbatch out of range"):
        validate(Schedule("x", g, 1, (0, 1), (tuple(P("F0.3")), ())))
    with pytest.raises(ScheduleError, match="never sent"):
        # compute complete, but the cross-rank edge is never moved
        validate(Schedule("x", g, 1, (0, 1), (tuple(P("F0.0", "B0.0")), tuple(P("F1.0", "B1.0")))))


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["gpipe", "1f1b"]), S=st.integers(1, 6), m=st.integers(1, 9), cap=st.integers(1, 8),
       seed=st.integers(0, 10_000))
def test_active_microbatches_caps_what_every_stage_holds(kind: str, S: int, m: int, cap: int, seed: int) -> None:
    """SMP v1's active_microbatches: no stage holds more than the cap, the first stage holds all it may, later
    stages no more than earlier ones (else a forward waits for a backward's round trip), every F and B runs
    once, the programs walk (make_schedule validates them), the memory rule agrees, and a cap that does not
    bind changes nothing; below m and at most S, capped gpipe is capped 1f1b."""
    graph = random_graph(S, seed)
    free = make_schedule(kind, graph, m)
    capped = make_schedule(kind, graph, m, active_microbatches=cap)
    held = peak_held(capped.actions, S, capped.split_backward)  # counted on the generated programs themselves
    held_free = peak_held(free.actions, S, free.split_backward)
    assert held == peak_in_flight(kind, S, m, active_microbatches=cap)
    assert held[0] == min(cap, held_free[0]) and all(a >= b for a, b in zip(held, held[1:]))
    assert all(h <= min(cap, f) for h, f in zip(held, held_free))
    for s in range(S):
        runs = Counter((a.kind, a.mb) for a in capped.compute_actions(capped.stage_to_rank[s]) if a.stage == s)
        assert runs == Counter({(k, mb): 1 for k in (K.F, K.B) for mb in range(m)})
    if cap >= max(held_free):
        assert capped.actions == free.actions
    if kind == "gpipe" and cap <= S and cap < m:
        assert capped.actions == make_schedule("1f1b", graph, m, active_microbatches=cap).actions
    assert capped.meta["active_microbatches"] == cap


def _held_step_by_step(sch: Schedule, act: list[int], remade: list[int]
                       ) -> tuple[list[int], list[int], list[int], list[int]]:
    """The memory rule counted afresh, step by step: at each step of a rank's program, a microbatch is held on a
    stage from its F (recomputed activations: from its B) to its last backward action there (B, or W when split),
    both steps included. Returns the peak microbatches and recomputed microbatches per stage, and the peak bytes
    per stage and per rank."""
    last = K.W if sch.split_backward else K.B
    counts, recomputed, per_stage = [0] * sch.num_stages, [0] * sch.num_stages, [0] * sch.num_stages
    per_rank = [0] * sch.num_ranks
    for r, prog in enumerate(sch.actions):
        step = {(a.kind, a.stage, a.mb): t for t, a in enumerate(prog) if a.is_compute}
        never = len(prog)
        for t in range(len(prog)):
            on_rank = 0
            for s in sch.stages_of(r):
                def held(kind: ActionKind) -> int:
                    return sum(step.get((kind, s, k), never) <= t <= step.get((last, s, k), never)
                               for k in range(sch.num_microbatches))
                f, b = held(K.F), held(K.B)
                counts[s], recomputed[s] = max(counts[s], f), max(recomputed[s], b)
                per_stage[s] = max(per_stage[s], f * act[s] + b * remade[s])
                on_rank += f * act[s] + b * remade[s]
            per_rank[r] = max(per_rank[r], on_rank)
    return counts, recomputed, per_stage, per_rank


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(list(ScheduleKind)), S=st.integers(1, 6), m=st.integers(1, 8),
       seed=st.integers(0, 10_000), split=st.booleans(), cap=st.none() | st.integers(1, 6),
       data_parallel=st.sampled_from([1, 2]), forward_only=st.booleans(), data=st.data())
def test_the_memory_fold_agrees_with_a_count_step_by_step(kind: ScheduleKind, S: int, m: int, seed: int,
                                                          split: bool, cap: int | None, data_parallel: int,
                                                          forward_only: bool, data: st.DataObject) -> None:
    """peak_held and peak_held_bytes (the one fold over the programs) give the independent step-by-step count on
    random valid schedules, and so do the memory rule on the bare compute orders (peak_in_flight,
    peak_recomputing) and the simulator, which all call the fold."""
    graph = random_graph(S, seed)
    if kind is ScheduleKind.INTERLEAVED:
        ranks = data.draw(st.sampled_from([p for p in range(1, S + 1) if S % p == 0]))
        sch = interleaved_1f1b(graph, m, ranks, split_backward=split)
    elif kind is ScheduleKind.ZB_H1:
        ranks, split = S, True
        sch = zb_h1(graph, m)
    else:
        ranks = S
        generate = gpipe if kind is ScheduleKind.GPIPE else one_f_one_b
        sch = generate(graph, m, split_backward=split, active_microbatches=cap)
    sch = with_allreduce(sch, data_parallel)
    if forward_only:
        sch = sch.forward()
    validate(sch)
    act = data.draw(st.lists(st.integers(0, 10**6), min_size=S, max_size=S))
    remade = data.draw(st.lists(st.integers(0, 10**6), min_size=S, max_size=S))
    counts, recomputed, per_stage, per_rank = _held_step_by_step(sch, act, remade)
    assert peak_held(sch.actions, S, sch.split_backward) == counts
    assert peak_held(sch.actions, S, sch.split_backward, taken_at=K.B) == recomputed
    assert peak_held_bytes(sch.actions, sch.split_backward, act, remade) == per_stage
    assert peak_held_bytes(sch.actions, sch.split_backward, act, remade, per_rank=True) == per_rank
    result = simulate(sch, StageCosts([1.0] * S, [2.0] * S, act_bytes=act, recompute_bytes=remade), timeline=False)
    assert (result.peak_inflight, result.peak_activation_bytes, result.peak_activation_bytes_per_rank) == (
        counts, per_stage, per_rank)
    if not forward_only and split == kind.split_backward:  # what the cost model reads off the bare orders
        capped = cap if kind in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B) else None
        assert peak_in_flight(kind, S, m, num_ranks=ranks, active_microbatches=capped) == counts
        assert peak_recomputing(kind, S, m, num_ranks=ranks) == recomputed


@pytest.mark.parametrize(("kind", "cap", "match"), [
    ("zb-h1", 2, "zb-h1 fixes its own.*1f1b or gpipe"),
    ("interleaved", 2, "interleaved fixes its own"),
    ("1f1b", 0, "whole number >= 1"),
    ("gpipe", 1.5, "whole number >= 1"),
])
def test_a_cap_a_schedule_cannot_take_is_refused(kind: str, cap: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_schedule(kind, 4, 8, num_ranks=2 if kind == "interleaved" else None, active_microbatches=cap)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]), stages=st.integers(2, 6),
       m=st.integers(1, 6), data_parallel=st.sampled_from([1, 2]), seed=st.integers(0, 10**6))
def test_a_schedule_made_from_a_template_equals_one_built_afresh(kind: str, stages: int, m: int,
                                                                 data_parallel: int, seed: int) -> None:
    # make_schedule reuses the programs of a schedule with the same stage pairs crossed in the
    # same order, renaming the tensors (partitioner.schedule._relabelled): the result, and its
    # walk, must be what building from scratch gives.
    import partitioner.schedule as schedule_module

    if kind == "interleaved" and stages % 2:
        stages += 1
    rng = random.Random(seed)
    pairs = [(s, s + 1) for s in range(stages - 1)]
    pairs += [tuple(sorted(rng.sample(range(stages), 2))) for _ in range(rng.randint(0, 3))]  # skips, repeats

    def graph(prefix: str) -> StageGraph:
        names = [f"{prefix}{i:02d}_{rng.randint(0, 99)}" for i in range(len(pairs))]  # same order in both
        return StageGraph(stages, tuple(Edge(a, b, t, rng.randint(1, 1000)) for (a, b), t in zip(pairs, names)))

    ranks = {"num_ranks": stages // 2} if kind == "interleaved" else {}
    first, second = graph("a"), graph("b")
    schedule_module._templates.clear()
    make_schedule(kind, first, m, data_parallel=data_parallel, check=False, **ranks)
    reused = make_schedule(kind, second, m, data_parallel=data_parallel, **ranks)  # checked: validates it
    schedule_module._templates.clear()
    fresh = make_schedule(kind, second, m, data_parallel=data_parallel, **ranks)
    assert reused.actions == fresh.actions
    assert reused.graph == fresh.graph and reused.meta == fresh.meta
    a, b = walk(reused), walk(fresh)
    assert (a.actions, a.rank, a.after, a.needs, a.mate, a.sequence) == \
        (b.actions, b.rank, b.after, b.needs, b.mate, b.sequence)


def test_interleaved_stages_share_their_rank_s_device_memory() -> None:
    """Each virtual stage had the whole device's memory, so a rank's two stages could plan for twice it (a 70B
    model's interleaved plan "fit" at 98.5 GiB on an 80 GB GPU); now they share it, as they share a memory_limit."""
    from partitioner.cluster import Cluster
    from partitioner.compile import plan
    from partitioner.errors import MemoryLimitError
    from smp.models import build

    b = build("gpt:size=tiny,layers=4,batch=8", seed=0)
    common = dict(stages=2, schedule="interleaved", virtual_stages=2, microbatches=4, device_profile="h100-sxm",
                  timing="analytic", recompute="none")
    roomy = plan(b.model, b.example_args, cluster=Cluster.uniform(2, bandwidth=1e11, memory=1e12), **common)
    device = 0.8 * max(roomy.rank_memory)  # each stage alone fits in it, the rank's two together do not
    assert all(s.memory <= device for s in roomy.partition.stages)
    with pytest.raises(MemoryLimitError, match="2 interleaved stages share each rank"):
        plan(b.model, b.example_args, cluster=Cluster.uniform(2, bandwidth=1e11, memory=device), **common)
    fits = plan(b.model, b.example_args, cluster=Cluster.uniform(2, bandwidth=1e11, memory=1.2 * device), **common)
    assert max(fits.rank_memory) <= 1.2 * device


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_each_sharding_mode_gets_its_own_collectives_on_one_replica_s_programs(kind: str) -> None:
    # make_schedule builds a replicated schedule on one replica's (a template too, shared by every mode and
    # replica count): each mode's programs must be the generator's with that mode's collectives, whatever
    # mode or count came before it from the cache (zb-h1 splits the backward: unsharded only).
    import partitioner.schedule as schedule_module

    ranks = {"num_ranks": 2} if kind == "interleaved" else {}
    graph = StageGraph.chain(4)
    schedule_module._templates.clear()
    made = [(mode, dp, make_schedule(kind, graph, 6, data_parallel=dp, sharding=mode, **ranks))
            for dp in (2, 3) for mode in (("none",) if kind == "zb-h1" else ("none", "shard_grad_op", "full_shard"))]
    for mode, dp, sched in made:
        own = SCHEDULES[ScheduleKind.parse(kind)](graph, 6, *ranks.values())
        assert sched.actions == with_allreduce(own, dp, sharding=mode).actions
        assert (sched.data_parallel, sched.sharding) == (dp, mode)
    assert make_schedule(kind, graph, 6, **ranks).actions == SCHEDULES[ScheduleKind.parse(kind)](graph, 6,
                                                                                                 *ranks.values()).actions


def test_the_collector_runs_less_often_inside_a_spaced_block_and_as_before_after_it() -> None:
    # gc_spaced (the shape search runs under it) raises the young generation's threshold for its block only,
    # collects cycles still, and gives the thresholds back, also when the block raises.
    import gc

    from partitioner.walk import gc_spaced

    before = gc.get_threshold()
    with pytest.raises(RuntimeError):
        with gc_spaced(1_000_000):
            assert gc.get_threshold() == (1_000_000, *before[1:])
            raise RuntimeError
    assert gc.get_threshold() == before


def test_spaced_blocks_overlapping_in_threads_give_the_thresholds_back_and_a_disabled_collector_stays_off() -> None:
    # Two searches at once in threads: A enters, B enters, A leaves, B leaves. Each block restored what it saw on
    # entry, so B put back A's raised threshold for good (review). A threshold of 0 (collector off) stays 0.
    import gc
    import threading

    from partitioner.walk import gc_spaced

    before = gc.get_threshold()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with gc_spaced(1_000_000):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second() -> None:
        a_in.wait(10)
        with gc_spaced(1_000_000):
            b_in.set()
            a_out.wait(10)
            assert gc.get_threshold()[0] == 1_000_000  # still spaced while a block is open

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert gc.get_threshold() == before
    try:
        gc.set_threshold(0, *before[1:])
        with gc_spaced(1_000_000):
            assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)
