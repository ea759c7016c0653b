"""The gradient all-reduce in the schedule IR: where with_allreduce puts it, how the link and the simulator price it."""

from __future__ import annotations

import pytest

from partitioner.buckets import gradient_buckets
from partitioner.cluster import Link
from partitioner.ir import ActionKind
from partitioner.schedule import make_schedule, with_allreduce
from partitioner.simulate import StageCosts, simulate
from partitioner.walk import validate, walk

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


def test_gradient_buckets_close_at_the_limit_and_at_a_dtype_change() -> None:
    mib = 1 << 20
    assert gradient_buckets([10 * mib, 10 * mib, 10 * mib, 40 * mib, 1 * mib]) == [[0, 1], [2], [3], [4]]
    assert gradient_buckets([1, 1, 1], kinds=["f32", "bf16", "bf16"]) == [[0], [1, 2]]
    assert gradient_buckets([]) == []


def test_the_last_stage_reduces_during_its_final_backward_and_only_its_last_bucket_waits() -> None:
    # 1F1B, 2 ranks, 2 microbatches, F = 1, B = 2, free links. Rank 1: F0 0-1... B1 5-7; rank 0: B1 7-9.
    base = make_schedule("1f1b", 2, 2)
    costs = StageCosts(fwd=[1.0, 1.0], bwd=[2.0, 2.0], allreduce=[3.0, 3.0], allreduce_tail=[1.0, 1.0])
    assert simulate(base, StageCosts(fwd=[1.0, 1.0], bwd=[2.0, 2.0])).step_time == pytest.approx(9.0)
    early = with_allreduce(base, 2)
    # rank 1 reduces from 5 (its final B starts) to max(5 + 3, 7 + 1) = 8; rank 0 from 7 to max(10, 9 + 1) = 10
    assert simulate(early, costs).step_time == pytest.approx(10.0)
    assert len(walk(early).overlapped) == 2
    late = with_allreduce(base, 2, overlap=False)  # after each backward: rank 0 from 9 to 12
    assert walk(late).overlapped == {}
    assert simulate(late, costs).step_time == pytest.approx(12.0)
    assert walk(with_allreduce(make_schedule("zb-h1", 2, 2), 2)).overlapped == {}  # W accumulates at its end
