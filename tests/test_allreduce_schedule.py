"""The gradient all-reduce in the schedule IR: where with_allreduce puts it, how the link and the simulator price it."""

from __future__ import annotations

import pytest

from partitioner.cluster import Link
from partitioner.ir import ActionKind
from partitioner.schedule import make_schedule, with_allreduce
from partitioner.simulate import StageCosts, simulate
from partitioner.walk import validate

KINDS = ["gpipe", "1f1b", "interleaved", "zb-h1"]


def _schedule(kind: str, overlap: bool = True):
    stages = 4 if kind == "interleaved" else 2
    base = make_schedule(kind, stages, 4, num_ranks=2)
    return with_allreduce(base, 2, overlap=overlap)


@pytest.mark.parametrize("kind", KINDS)
def test_each_stage_reduces_once_right_after_its_last_weight_gradients(kind: str) -> None:
    sched = _schedule(kind)
    validate(sched)
    last = ActionKind.W if sched.split_backward else ActionKind.B
    for prog in sched.actions:
        reduced = [a.stage for a in prog if a.kind is ActionKind.ALLREDUCE]
        held = sorted({a.stage for a in prog if a.is_compute})
        assert sorted(reduced) == held
        for s in held:
            at = next(i for i, a in enumerate(prog) if a.kind is ActionKind.ALLREDUCE and a.stage == s)
            final = max(i for i, a in enumerate(prog) if a.kind is last and a.stage == s)
            # nothing but the transfers posted with the final action sits between them
            assert at > final and all(a.is_transfer for a in prog[final + 1:at])


@pytest.mark.parametrize("kind", KINDS)
def test_after_the_step_puts_every_all_reduce_at_the_end(kind: str) -> None:
    sched = _schedule(kind, overlap=False)
    validate(sched)
    for prog in sched.actions:
        n = sum(a.kind is ActionKind.ALLREDUCE for a in prog)
        assert n and all(a.kind is ActionKind.ALLREDUCE for a in prog[-n:])


def test_ring_all_reduce_time() -> None:
    link = Link(bandwidth=1e9, latency=1e-5)
    # 4 ranks: each sends 2 x 3/4 of 8 MB in 6 steps
    assert link.allreduce_seconds(8e6, 4) == pytest.approx(2 * 3 / 4 * 8e6 / 1e9 + 6 * 1e-5)
    assert link.allreduce_seconds(8e6, 1) == 0.0


def _costs(stages: int, reduce: float) -> StageCosts:
    return StageCosts(fwd=[1.0] * stages, bwd=[2.0] * stages, allreduce=[reduce] * stages)


@pytest.mark.parametrize("kind", KINDS)
def test_all_reduces_after_the_step_run_one_after_another_past_the_last_compute(kind: str) -> None:
    reduce = 3.0
    after = _schedule(kind, overlap=False)
    stages = after.num_stages
    bare = simulate(make_schedule(kind, stages, 4, num_ranks=2), StageCosts(fwd=[1.0] * stages, bwd=[2.0] * stages))
    ends = {r: max(e.end for e in bare.timeline.events if e.rank == r) for r in range(2)}
    held = {r: len({a.stage for a in after.actions[r] if a.is_compute}) for r in range(2)}
    # a rank's all-reduces share its data-parallel group: they queue behind each other
    want = max(ends[r] + held[r] * reduce for r in range(2))
    assert simulate(after, _costs(stages, reduce)).step_time == pytest.approx(want)


@pytest.mark.parametrize("kind", KINDS)
def test_overlapping_the_all_reduce_never_costs_and_hides_it_when_a_rank_holds_two_stages(kind: str) -> None:
    stages = 4 if kind == "interleaved" else 2
    costs = _costs(stages, 3.0)
    early = simulate(_schedule(kind), costs)
    late = simulate(_schedule(kind, overlap=False), costs)
    assert early.step_time <= late.step_time + 1e-12
    if kind == "interleaved":
        assert early.step_time < late.step_time
    assert {e.kind for e in early.timeline.events} >= {"AR"}
