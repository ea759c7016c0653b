"""Simulate one step of a pipeline Schedule by walking its action lists: step time, bubble, peak memory."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from partitioner.ir import Action, ActionKind, Schedule
from partitioner.timeline import Timeline, TimelineEvent
from partitioner.walk import peak_held, peak_held_bytes, walk

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
    flight (optional). ``allreduce[s]`` is the time of stage s's gradient all-reduce over
    its data-parallel replicas (a schedule with ALLREDUCE actions), ``allreduce_tail[s]``
    that of its last bucket (what is left once an overlapped backward ends; default: all
    of it). ``allgather[s]`` and ``reduce_scatter[s]``: one all-gather of stage s's parameters
    and the reduce-scatter of its gradients over its replicas (a sharded schedule's ALLGATHER,
    ALLGATHER_B and REDUCE_SCATTER actions). ``recompute[s]``: seconds
    of forward that stage s runs again at the start of each B (activation recomputation),
    added to B's duration; ``recompute_bytes[s]``: the activations that recomputation
    re-creates, held from the start of B until the microbatch's backward ends (its W when split).
    """

    fwd: Sequence[float]
    bwd: Sequence[float]
    bwd_w: Sequence[float] | None = None
    comm: Mapping[EdgeKey, float] = field(default_factory=dict)
    act_bytes: Sequence[float] | None = None
    allreduce: Sequence[float] | None = None
    allreduce_tail: Sequence[float] | None = None
    allgather: Sequence[float] | None = None
    reduce_scatter: Sequence[float] | None = None
    recompute: Sequence[float] | None = None
    recompute_bytes: Sequence[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.fwd)
        if self.bwd_w is None:
            self.bwd_w = [0.0] * n
        if self.allreduce is None:
            self.allreduce = [0.0] * n
        if self.allreduce_tail is None:
            self.allreduce_tail = list(self.allreduce)
        if self.allgather is None:
            self.allgather = [0.0] * n
        if self.reduce_scatter is None:
            self.reduce_scatter = [0.0] * n
        if self.recompute is None:
            self.recompute = [0.0] * n
        if self.recompute_bytes is None:
            self.recompute_bytes = [0.0] * n
        for name in ("bwd", "bwd_w", "act_bytes", "allreduce", "allreduce_tail", "allgather", "reduce_scatter",
                     "recompute", "recompute_bytes"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise ValueError(f"StageCosts.{name} has {len(v)} entries, fwd has {n}")
        for s in range(n):
            if min(self.fwd[s], self.bwd[s], self.bwd_w[s], self.recompute[s]) < 0:  # type: ignore[index]
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
    """StageCosts from the optimizer's per-stage objects (duck typed: .fwd, .bwd, optional .bwd_w,
    .recompute_time and .recompute_bytes, as on :class:`~partitioner.cost.StageStats`)."""
    return StageCosts(
        fwd=[float(s.fwd) for s in stages],
        bwd=[float(s.bwd) for s in stages],
        bwd_w=[float(getattr(s, "bwd_w", 0.0) or 0.0) for s in stages],
        comm=comm_from_transfers(transfers),
        act_bytes=act_bytes,
        recompute=[float(getattr(s, "recompute_time", 0.0) or 0.0) for s in stages],
        recompute_bytes=[float(getattr(s, "recompute_bytes", 0.0) or 0.0) for s in stages],
    )


@dataclass
class SimResult:
    """Outcome of one simulated step.

    ``bubble_fraction`` = 1 - (compute time summed over ranks) / (ranks x step time).
    ``peak_inflight[s]``: most microbatches stage s holds at once (F done, B not —
    or W not, when the backward is split). ``peak_activation_bytes`` (per stage) and
    ``peak_activation_bytes_per_rank`` are filled when the costs give ``act_bytes``.
    ``throughput`` is microbatches per second (``samples_per_second`` when the
    microbatch size was given). ``timeline`` is built on first use (a search simulates
    hundreds of steps and draws one).
    """

    _timeline: Timeline | Callable[[], Timeline] | None
    step_time: float
    bubble_fraction: float
    throughput: float
    busy_time: list[float]
    peak_inflight: list[int]
    peak_activation_bytes: list[float] | None
    peak_activation_bytes_per_rank: list[float] | None
    samples_per_second: float | None = None

    @property
    def timeline(self) -> Timeline | None:
        if callable(self._timeline):
            self._timeline = self._timeline()
        return self._timeline

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

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> SimResult:
        tl = d.get("timeline")
        return SimResult(
            _timeline=Timeline.from_dict(tl) if tl else None,
            step_time=float(d["step_time"]),
            bubble_fraction=float(d["bubble_fraction"]),
            throughput=float(d["throughput"]),
            busy_time=[float(x) for x in d.get("busy_time", [])],
            peak_inflight=[int(x) for x in d.get("peak_inflight", [])],
            peak_activation_bytes=d.get("peak_activation_bytes"),
            peak_activation_bytes_per_rank=d.get("peak_activation_bytes_per_rank"),
            samples_per_second=d.get("samples_per_second"),
        )


def _durations(schedule: Schedule, costs: StageCosts) -> Callable[[Action], float]:
    """What each action costs: compute on its stage's device, a SEND the link time of its tensor."""
    split = schedule.split_backward
    fwd, bwd, bwd_w, rec = costs.fwd, costs.bwd, costs.bwd_w, costs.recompute
    assert bwd_w is not None and rec is not None
    compute = {
        ActionKind.F: [float(x) for x in fwd],
        ActionKind.B: [float(r) + (float(b - w) if split else float(b)) for b, w, r in zip(bwd, bwd_w, rec)],
        ActionKind.W: [float(x) for x in bwd_w],
    }
    comm = costs.comm
    allreduce = costs.allreduce
    assert allreduce is not None

    assert costs.allgather is not None and costs.reduce_scatter is not None
    # The collectives, per stage (a dict bound once: called for every action of every simulated step)
    collective = {ActionKind.ALLREDUCE: allreduce, ActionKind.REDUCE_SCATTER: costs.reduce_scatter,
                  ActionKind.ALLGATHER: costs.allgather, ActionKind.ALLGATHER_B: costs.allgather}

    def duration(a: Action) -> float:
        per_stage = compute.get(a.kind)
        if per_stage is not None:
            return per_stage[a.stage]
        per_stage = collective.get(a.kind)
        if per_stage is not None:
            return float(per_stage[a.stage])
        return float(comm.get(a.edge, 0.0)) if a.is_send else 0.0

    return duration


#: The timeline's name of each collective's bar (an all-gather before a backward draws as one before a forward).
COLLECTIVE_BARS = {ActionKind.ALLREDUCE: "AR", ActionKind.REDUCE_SCATTER: "RS", ActionKind.ALLGATHER: "AG",
                   ActionKind.ALLGATHER_B: "AG"}


def _events(rank: int, a: Action, start: float, end: float, recompute: float) -> list[TimelineEvent]:
    """The timeline's bars for one compute or collective action: a B that recomputes is an R bar (the forward run
    again) followed by the B bar proper."""
    if a.kind is ActionKind.B and recompute > 0:
        return [TimelineEvent(rank, a.stage, "R", a.mb, start, start + recompute),
                TimelineEvent(rank, a.stage, "B", a.mb, start + recompute, end)]
    return [TimelineEvent(rank, a.stage, COLLECTIVE_BARS.get(a.kind, a.kind.value), a.mb, start, end)]


def simulate(schedule: Schedule, costs: StageCosts, *, timeline: bool = True, label: str = "predicted",
             samples_per_microbatch: int | None = None) -> SimResult:
    """Time one step of ``schedule`` with ``costs`` by walking its action lists (:meth:`Walk.times`).

    Exactly the lists the runtime executes are priced: compute actions occupy their rank;
    a SEND and its RECV are posted when the rank's program reaches them and the tensor
    then takes ``comm[edge]`` seconds on the link, overlapping compute (a receive posted
    late delays its data); tensors handed over within one rank arrive at once. See
    docs/schedules.md. The walk is cached on the schedule, so repeated calls with other
    costs are cheap.
    """
    if costs.num_stages != schedule.num_stages:
        raise ValueError(f"costs are for {costs.num_stages} stages, schedule has {schedule.num_stages}")
    w = walk(schedule)
    comm = costs.comm
    if comm:
        missing = {a.edge for a in w.actions if a.is_send} - comm.keys()
        if missing:
            a, b, t = sorted(missing)[0]
            raise KeyError(f"StageCosts.comm has no time for cut edge {a}->{b} t={t} "
                           f"({len(missing)} cross-rank edges missing)")
    tails = costs.allreduce_tail
    assert tails is not None
    start, end = w.times(_durations(schedule, costs), lambda a: float(tails[a.stage]))
    step = max(end) if end else 0.0
    R = schedule.num_ranks
    busy = [0.0] * R
    for i, a in enumerate(w.actions):
        if a.is_compute:
            busy[w.rank[i]] += end[i] - start[i]
    bubble = 1.0 - sum(busy) / (R * step) if step > 0 else 0.0
    m = schedule.num_microbatches
    thr = m / step if step > 0 else float("inf")
    programs, split = schedule.actions, schedule.split_backward
    inflight = peak_held(programs, schedule.num_stages, split)
    peak_bytes = per_rank = None
    if costs.act_bytes is not None:
        remade = costs.recompute_bytes
        assert remade is not None
        peak_bytes = peak_held_bytes(programs, split, costs.act_bytes, remade)
        per_rank = peak_held_bytes(programs, split, costs.act_bytes, remade, per_rank=True)
    def make_timeline() -> Timeline:
        recompute = costs.recompute
        assert recompute is not None
        events = [e for i, a in enumerate(w.actions) if not a.is_transfer
                  for e in _events(w.rank[i], a, start[i], end[i], float(recompute[a.stage]))]
        return Timeline(events, step, label, R, {"schedule": schedule.name, "num_microbatches": m})

    tl = make_timeline if timeline else None
    return SimResult(tl, step, bubble, thr, busy, inflight, peak_bytes, per_rank,
                     thr * samples_per_microbatch if samples_per_microbatch else None)
