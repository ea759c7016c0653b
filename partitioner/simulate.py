"""Discrete-event simulation of a pipeline Schedule: step time, bubble, throughput, peak memory."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from partitioner.schedule import ActionKind, Schedule, _compile_orders, _Compiled, _times
from partitioner.timeline import Timeline, TimelineEvent

__all__ = ["StageCosts", "SimResult", "simulate", "comm_from_transfers", "stage_costs_from"]

EdgeKey = tuple[int, int, str]


@dataclass
class StageCosts:
    """Per-stage costs in seconds, independent of how they were obtained.

    ``fwd[s]``, ``bwd[s]`` (the full backward) and ``bwd_w[s]`` (its weight-gradient
    part; a split schedule runs B for ``bwd - bwd_w`` and W for ``bwd_w``).
    ``comm[(src, dst, tensor)]`` is the time to move that cut tensor for one
    microbatch (the gradient going back takes the same); an empty mapping means
    free communication, a non-empty one must cover every cross-rank edge.
    ``act_bytes[s]`` is the activation memory stage s keeps per microbatch in
    flight (optional).
    """

    fwd: Sequence[float]
    bwd: Sequence[float]
    bwd_w: Sequence[float] | None = None
    comm: Mapping[EdgeKey, float] = field(default_factory=dict)
    act_bytes: Sequence[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.fwd)
        if self.bwd_w is None:
            self.bwd_w = [0.0] * n
        for name in ("bwd", "bwd_w", "act_bytes"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise ValueError(f"StageCosts.{name} has {len(v)} entries, fwd has {n}")
        for s in range(n):
            if min(self.fwd[s], self.bwd[s], self.bwd_w[s]) < 0:  # type: ignore[index]
                raise ValueError(f"stage {s}: negative time")
            if self.bwd_w[s] > self.bwd[s] + 1e-15:  # type: ignore[index]
                raise ValueError(f"stage {s}: bwd_w ({self.bwd_w[s]}) exceeds bwd ({self.bwd[s]}); "  # type: ignore[index]
                                 "bwd is the full backward, bwd_w its weight-gradient part")

    @property
    def num_stages(self) -> int:
        return len(self.fwd)


def comm_from_transfers(transfers: Iterable[Any]) -> dict[EdgeKey, float]:
    """``{(src, dst, tensor): seconds}`` from objects with .src_stage .dst_stage .node .seconds."""
    out: dict[EdgeKey, float] = {}
    for t in transfers:
        node = getattr(t.node, "name", t.node)
        key = (int(t.src_stage), int(t.dst_stage), str(node))
        out[key] = max(out.get(key, 0.0), float(t.seconds))
    return out


def stage_costs_from(stages: Sequence[Any], transfers: Iterable[Any] = (),
                     act_bytes: Sequence[float] | None = None) -> StageCosts:
    """StageCosts from the optimizer's per-stage objects (duck typed: .fwd, .bwd, optional .bwd_w)."""
    return StageCosts(
        fwd=[float(s.fwd) for s in stages],
        bwd=[float(s.bwd) for s in stages],
        bwd_w=[float(getattr(s, "bwd_w", 0.0) or 0.0) for s in stages],
        comm=comm_from_transfers(transfers),
        act_bytes=act_bytes,
    )


@dataclass
class SimResult:
    """Outcome of one simulated step.

    ``bubble_fraction`` = 1 - (compute time summed over ranks) / (ranks x step time).
    ``peak_inflight[s]``: most microbatches stage s holds at once (F done, B not —
    or W not, when the backward is split). ``peak_activation_bytes`` (per stage) and
    ``peak_activation_bytes_per_rank`` are filled when the costs give ``act_bytes``.
    ``throughput`` is microbatches per second (``samples_per_second`` when the
    microbatch size was given).
    """

    timeline: Timeline | None
    step_time: float
    bubble_fraction: float
    throughput: float
    busy_time: list[float]
    peak_inflight: list[int]
    peak_activation_bytes: list[float] | None
    peak_activation_bytes_per_rank: list[float] | None
    samples_per_second: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time": self.step_time,
            "bubble_fraction": self.bubble_fraction,
            "throughput": self.throughput,
            "samples_per_second": self.samples_per_second,
            "busy_time": list(self.busy_time),
            "peak_inflight": list(self.peak_inflight),
            "peak_activation_bytes": self.peak_activation_bytes,
            "peak_activation_bytes_per_rank": self.peak_activation_bytes_per_rank,
            "timeline": self.timeline.to_dict() if self.timeline is not None else None,
        }


@dataclass
class _SimPlan:
    c: _Compiled
    rank: list[int]
    stage: list[int]
    kind: list[int]  # 0 F, 1 B, 2 W
    cross_keys: set[EdgeKey]
    peak_inflight: list[int]
    rank_orders: list[list[int]]  # node ids per rank, program order


_KCODE = {ActionKind.F: 0, ActionKind.B: 1, ActionKind.W: 2}


def _plan(schedule: Schedule) -> _SimPlan:
    cached = getattr(schedule, "_compiled", None)
    if isinstance(cached, _SimPlan):
        return cached
    orders = [schedule.compute_actions(r) for r in range(schedule.num_ranks)]
    c = _compile_orders(schedule.graph, schedule.stage_to_rank, orders, schedule.split_backward)
    ranks = [n[0] for n in c.nodes]
    stages = [n[2] for n in c.nodes]
    kinds = [_KCODE[n[1]] for n in c.nodes]
    cross = {key for d in c.deps for _, key in d if key is not None}
    release = 2 if schedule.split_backward else 1
    peak = [0] * schedule.num_stages
    cur = [0] * schedule.num_stages
    rank_orders: list[list[int]] = [[] for _ in range(schedule.num_ranks)]
    for n in range(len(c.nodes)):
        rank_orders[ranks[n]].append(n)  # nodes were numbered rank by rank, in program order
    for r in range(schedule.num_ranks):
        for n in rank_orders[r]:
            s = stages[n]
            if kinds[n] == 0:
                cur[s] += 1
                peak[s] = max(peak[s], cur[s])
            elif kinds[n] == release:
                cur[s] -= 1
    plan = _SimPlan(c, ranks, stages, kinds, cross, peak, rank_orders)
    schedule._compiled = plan
    return plan


def simulate(schedule: Schedule, costs: StageCosts, *, timeline: bool = True, label: str = "predicted",
             samples_per_microbatch: int | None = None) -> SimResult:
    """Time one training step of ``schedule`` with ``costs``.

    Semantics (see docs/schedules.md): a compute action occupies its rank from start
    to end; it starts when its rank has finished the previous compute action of its
    program and all its inputs are there. Communication is asynchronous: it uses no
    compute time; a cut tensor leaves when its producer ends and arrives
    ``comm[edge]`` seconds later (gradients the same, backwards); tensors handed over
    within one rank arrive at once; transfers do not contend for links. SEND/RECV
    actions therefore cost nothing here: a runtime posts receives early and waits
    only where the data is used. The compiled dependency graph is cached on the
    schedule (treat a Schedule as immutable once simulated), so repeated calls with
    different costs are cheap.
    """
    if costs.num_stages != schedule.num_stages:
        raise ValueError(f"costs are for {costs.num_stages} stages, schedule has {schedule.num_stages}")
    plan = _plan(schedule)
    comm = costs.comm
    if comm:
        missing = plan.cross_keys - comm.keys()
        if missing:
            a, b, t = sorted(missing)[0]
            raise KeyError(f"StageCosts.comm has no time for cut edge {a}->{b} t={t} "
                           f"({len(missing)} cross-rank edges missing)")
    split = schedule.split_backward
    fwd, bwd, bwd_w = costs.fwd, costs.bwd, costs.bwd_w
    assert bwd_w is not None
    per_stage = [
        (float(fwd[s]), float(bwd[s] - bwd_w[s]) if split else float(bwd[s]), float(bwd_w[s]))
        for s in range(schedule.num_stages)
    ]
    dur = [per_stage[s][k] for s, k in zip(plan.stage, plan.kind)]
    start, end = _times(plan.c, dur, comm)
    step = max(end) if end else 0.0
    R = schedule.num_ranks
    busy = [0.0] * R
    for r, d in zip(plan.rank, dur):
        busy[r] += d
    bubble = 1.0 - sum(busy) / (R * step) if step > 0 else 0.0
    m = schedule.num_microbatches
    thr = m / step if step > 0 else float("inf")
    peak_bytes = per_rank = None
    if costs.act_bytes is not None:
        ab = costs.act_bytes
        peak_bytes = [plan.peak_inflight[s] * float(ab[s]) for s in range(schedule.num_stages)]
        release = 2 if split else 1
        per_rank = []
        for r in range(R):
            cur = best = 0.0
            for n in plan.rank_orders[r]:
                k = plan.kind[n]
                if k == 0:
                    cur += ab[plan.stage[n]]
                    best = max(best, cur)
                elif k == release:
                    cur -= ab[plan.stage[n]]
            per_rank.append(best)
    tl = None
    if timeline:
        kinds = ("F", "B", "W")
        events = [TimelineEvent(r, s, kinds[k], node[3], st, en)
                  for r, s, k, node, st, en in zip(plan.rank, plan.stage, plan.kind, plan.c.nodes, start, end)]
        tl = Timeline(events, step, label, R, {"schedule": schedule.name,
                                               "num_microbatches": m})
    return SimResult(tl, step, bubble, thr, busy, list(plan.peak_inflight), peak_bytes, per_rank,
                     thr * samples_per_microbatch if samples_per_microbatch else None)

