"""The data-parallel x pipeline x tensor-parallel shape search: every (replicas, stages, tp, microbatches, schedule).

A shape is D replicas of a P-rank pipeline whose stages are split over T tensor-parallel ranks
(partitioner/tensor_parallel.py prices a T), D x P x T = N, each replica's share of the
global batch B split into m microbatches, run under one schedule. The shapes are compared
by simulated step time, which, the global batch being the same for all, orders them by
samples per second too. Two phases keep 64 devices under a minute: every shape is first
screened with the exact bottleneck DP (``method="dp"``, ``objective="bottleneck"``: about a
second each where CP-SAT and the step-time refinement take tens), then the finalists
(screened within ``FINALIST_SLACK`` of the fastest, at most ``MAX_FINALISTS``) are solved
as :func:`partitioner.compile.plan` would (default method and objective; the refinement
rarely moves a step by more than a percent). A ``method`` or ``objective`` given by the
caller (other than the defaults, auto and step_time) is used for every shape instead, in one phase;
a finalist keeps its screened plan when the full solve finds no faster one. The screen is exact over the
enumerated grid (for the bottleneck-optimal plans it compares): a shape is skipped only when a lower bound on its step time (the busiest
rank does at least its share of the work) is no better than a step time already found, and a
screened partition is not scheduled and simulated when its pipeline's critical path
(:func:`partitioner.compile.pipeline_step_bound`: the forwards into a stage, its m forwards and
backwards, the backwards out of it) already puts it beyond the finalists' slack of the best
step found. The finalists are solved in threads, one per core.
Piper (Tarnawski et al., NeurIPS 2021) and Alpa's inter-operator pass (Zheng et al.,
OSDI 2022) choose such shapes; torch.distributed.pipelining and DeepSpeed leave them to
the user.

The graph is profiled on the sample batch as one microbatch; a shape's microbatch of u
samples is that graph scaled by u / (sample batch) (:meth:`OpGraph.scaled`): exact for
activation bytes, and for analytic times up to the per-op overheads that do not scale.
Measured times do not scale (small microbatches pay per-op overheads): the compiler then
profiles each microbatch size the sample batch splits into on its own (``graph_for``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from partitioner.blocks import block_graph
from partitioner.checks import whole
from partitioner.cluster import Cluster
from partitioner.errors import PlanError, PlanningError, ShapePruned
from partitioner.graph import OpGraph
from partitioner.ir import ScheduleKind, ScheduleError
from partitioner.plan import ModelInfo, Plan
from partitioner.request import PlanRequest, check_stages_divide
from partitioner.solve.dp import dp_search_work
from partitioner.tensor_parallel import runs_split
from partitioner.walk import gc_spaced, validate

__all__ = ["Shape", "Candidate", "ShapeSearch", "search_shapes", "shapes_for"]

#: Screened shapes within this fraction of the fastest screened step are solved again in full ...
FINALIST_SLACK = 0.03
#: ... at most this many of them (the fastest).
MAX_FINALISTS = 3
#: dp's branch-and-bound budget in the screen (a tenth of a full solve's ``DP_SEARCH_WORK``): on the Llama-3-70B
#: shape search it ran out on most shapes at either budget, and the smaller one left the chosen plan and 113 of 116
#: candidates' figures unchanged (one non-finalist 0.2% slower, two pruned at other path lengths: docs/optimizer.md);
#: the finalists get the full one.
SCREEN_DP_WORK = 500_000


@dataclass(frozen=True, order=True)
class Shape:
    """D replicas x P pipeline ranks (each stage split over T tp ranks), m microbatches per replica per step, one
    schedule."""

    data_parallel: int
    stages: int
    microbatches: int
    schedule: str
    tensor_parallel: int = 1

    @property
    def devices(self) -> int:
        return self.data_parallel * self.stages * self.tensor_parallel

    def __str__(self) -> str:
        tp = f" tp{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return f"{self.data_parallel}x{self.stages}{tp} {self.schedule} m={self.microbatches}"


@dataclass
class Candidate:
    """One shape weighed: its plan, or why it has none (does not fit, pruned by its bound, cannot be built)."""

    shape: Shape
    global_batch: int
    plan: Plan | None = None
    #: seconds no plan of this shape is faster, whatever its cut: its busiest rank's share of the compute (a shape
    #: pruned by its screened partition's critical path keeps it: that path bounds the partition, not the shape)
    lower_bound: float = 0.0
    reason: str = ""
    needs: float | None = None  # bytes: the least a plan of this shape needs, when none fits
    final: bool = False  # solved with the full method and objective (a finalist), not only screened

    @property
    def compute_bound(self) -> float:
        """:attr:`lower_bound`, by the name the step-time gap reads it by (the compute share it is)."""
        return self.lower_bound

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def step_time(self) -> float:
        return self.plan.step_time if self.plan is not None else math.inf

    @property
    def samples_per_second(self) -> float:
        return self.global_batch / self.step_time if self.plan is not None and self.step_time > 0 else 0.0

    @property
    def memory(self) -> float | None:
        """The fullest rank's predicted peak bytes (what it would need, when nothing fits)."""
        return max(self.plan.rank_memory) if self.plan is not None else self.needs

    @property
    def proven(self) -> bool:
        """Whether the partition's bottleneck is proven optimal for this shape."""
        return bool(self.plan is not None and self.plan.partition.optimal)

    @property
    def recompute(self) -> list[str]:
        return list(self.plan.recompute) if self.plan is not None else []

    @property
    def gap(self) -> float:
        """step / :attr:`compute_bound` - 1: how far this shape's plan may be from the fastest plan of its shape."""
        return self.step_time / self.compute_bound - 1 if self.plan is not None and self.compute_bound > 0 \
            else math.inf

    @property
    def pruned(self) -> bool:
        return self.plan is None and self.reason.startswith("pruned")

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        return {"data_parallel": self.shape.data_parallel, "stages": self.shape.stages,
                "tensor_parallel": self.shape.tensor_parallel, "microbatches": self.shape.microbatches,
                "schedule": self.shape.schedule,
                "placement": p.placement if p is not None else None, "fits": self.fits,
                "step_time": self.step_time if p is not None else None,
                "samples_per_second": self.samples_per_second if p is not None else None,
                "bubble": p.bubble if p is not None else None, "memory_bytes": self.memory,
                "proven": self.proven, "recompute": self.recompute, "lower_bound": self.lower_bound,
                "compute_bound": self.compute_bound,
                "gap": self.gap if self.gap < math.inf else None,
                "sharding": p.sharding if p is not None else None,
                "sharding_weighed": dict(p.sharding_weighed) if p is not None else None,
                "final": self.final,
                "reason": self.reason or None}


@dataclass
class ShapeSearch:
    """Every candidate weighed, best first (those without a plan last, in the order they were enumerated)."""

    devices: int
    global_batch: int
    candidates: list[Candidate]
    skipped: dict[int, str] = field(default_factory=dict)  # a tensor-parallel degree not weighed -> why

    @property
    def lower_bound(self) -> float:
        """Seconds no plan of the shapes weighed beats, whatever its cut: the least of their compute bounds. Only a
        one-stage shape that no plan fits is left out (it holds the whole model: no cut would fit it); another found
        not to fit may fit with another cut (finer than the folded graph's layers, partitioner/blocks.py, or off
        the program order), so it counts."""
        return min((c.compute_bound for c in self.candidates
                    if c.fits or c.shape.stages > 1 or c.needs is None), default=math.inf)

    @property
    def gap(self) -> float:
        """How far the chosen step may be from the fastest of the space weighed: step / :attr:`lower_bound` - 1."""
        step = self.candidates[0].step_time if self.candidates else math.inf
        return step / self.lower_bound - 1 if 0 < self.lower_bound < math.inf and step < math.inf else math.inf

    @property
    def best(self) -> Plan:
        """The fastest plan that fits; PlanError with the reasons when no shape has one."""
        if not self.candidates or self.candidates[0].plan is None:
            reasons = sorted({c.reason for c in self.candidates if c.reason})
            raise PlanError(f"no shape of {self.devices} devices runs a global batch of {self.global_batch}: "
                            + "; ".join(reasons[:4]) + ("" if len(reasons) <= 4 else f" (and {len(reasons) - 4} "
                                                                                      "more reasons)"))
        return self.candidates[0].plan

    def to_dict(self) -> dict[str, Any]:
        return {"devices": self.devices, "global_batch": self.global_batch,
                "lower_bound": self.lower_bound if self.lower_bound < math.inf else None,
                "gap": self.gap if self.gap < math.inf else None,
                "candidates": [c.to_dict() for c in self.candidates],
                "tensor_parallel_skipped": {str(t): why for t, why in self.skipped.items()}}


def shapes_for(devices: int, global_batch: int, *, schedules: Sequence[str], stages: int | None = None,
               microbatches: Sequence[int] | None = None, max_stages: int | None = None,
               tensor_parallel: Sequence[int] = (1,)) -> list[Shape]:
    """Every shape of ``devices`` whose replicas and microbatches split the global batch evenly.

    T runs over ``tensor_parallel`` (those that divide N), P over the divisors of N / T (or is
    ``stages``); m over the divisors of a replica's batch from min(P, batch) up (or over
    ``microbatches``, those that divide it): fewer than P microbatches leave ranks idle; more
    shrink the bubble and, as smaller microbatches, the activations, which is what lets a large
    model fit (on one rank per pipeline they are gradient accumulation). One rank per pipeline
    has no schedule to choose: it is listed once, as 1f1b.
    """
    whole(devices, "devices")
    whole(global_batch, "global_batch")
    kinds = [ScheduleKind.parse(s).value for s in schedules]
    for m in microbatches or ():
        whole(m, "each microbatch count", error=PlanError)
    check_stages_divide(stages, devices)
    out: list[Shape] = []
    for t in tensor_parallel:
        if devices % t or (stages is not None and (devices // t) % stages):
            continue
        for p in [stages] if stages is not None else _divisors(devices // t):
            if max_stages is not None and p > max_stages:
                continue
            d = devices // (p * t)
            if global_batch % d:
                continue
            share = global_batch // d
            if microbatches is not None:
                counts = [m for m in microbatches if share % m == 0]
            else:
                counts = [m for m in _divisors(share) if m >= min(p, share)]
            for kind in (["1f1b"] if p == 1 else [k for k in kinds if t == 1 or runs_split(k)]):
                out.extend(Shape(d, p, m, kind, t) for m in counts)
    return out


# Python's cyclic collector run less often (partitioner/walk.py): a search builds and drops schedules and walks of
# 10^5-10^6 objects each, which set off full collections over everything it holds, a quarter of its time.
@gc_spaced(1_000_000)
def search_shapes(
    graph: OpGraph,
    request: PlanRequest,
    *,
    profiled_batch: int,
    solve_plan: Callable[..., Plan],
    model_info: ModelInfo | None = None,
    progress: Callable[[int, int], None] | None = None,
    graph_for: Callable[[int], OpGraph | None] | None = None,
    price_tp: Callable[[OpGraph, int], OpGraph] | None = None,
    tensor_parallel: Sequence[int] = (1,),
    skipped: Mapping[int, str] | None = None,
) -> ShapeSearch:
    """Weigh every shape of ``request.devices`` for ``request.global_batch`` samples a step; the fastest first.

    ``request`` fixes what it sets (``stages``, ``microbatches``, ``schedule``, the solver's
    options; its ``cluster`` already loaded, or None); each shape is solved as that request
    with the shape's D, P, m and schedule. ``graph`` is costed for one microbatch of
    ``profiled_batch`` samples; a microbatch of u samples is costed by ``graph_for(u)`` where
    it gives a graph (e.g. one profiled at that size), else by ``graph`` scaled. ``solve_plan``
    is :func:`partitioner.compile.plan_from_graph` (passed in: the compiler imports this module).
    ``tensor_parallel``: the degrees T weighed, each shape's graph priced for its T by ``price_tp(graph, T)``
    (:func:`partitioner.tensor_parallel.price_tensor_parallel` for the model; needed for a T > 1); ``skipped``: the
    degrees not weighed and why (reported with the search).
    """
    devices, cluster, placement = request.devices, request.cluster, request.placement
    global_batch = request.global_batch
    if devices is None or global_batch is None:
        raise PlanError("a shape search needs devices= and global_batch=")
    if cluster is not None and not isinstance(cluster, Cluster):
        raise PlanError("search_shapes takes its cluster loaded (Cluster.load(name, devices=N))")
    if cluster is not None and len(cluster.devices) < devices:
        raise PlanError(f"the cluster {cluster.name!r} has {len(cluster.devices)} devices, fewer than the {devices} "
                        "to plan for; load it with more (Cluster.load(name, devices=N))")
    if price_tp is None and any(t > 1 for t in tensor_parallel):
        raise PlanError("weighing tensor parallelism needs its pricing of the model (price_tp)")
    # each shape is solved on the graph with one node per repeated block (partitioner/blocks.py), when it has them
    coarse: dict[tuple[int, int], OpGraph] = {(profiled_batch, 1): block_graph(graph)}
    shapes = shapes_for(devices, global_batch, schedules=request.schedules, stages=request.stages,
                        microbatches=request.microbatch_counts, max_stages=len(graph),
                        tensor_parallel=tensor_parallel)
    if not shapes:
        raise PlanError(f"no shape of {devices} devices splits a global batch of {global_batch} evenly: use a global "
                        f"batch that a divisor of {devices} divides (e.g. {devices * max(1, global_batch // devices)})")
    if cluster is None and any(s.data_parallel > 1 for s in shapes):
        raise PlanError("weighing data parallelism needs the links its gradient all-reduce crosses: pass a cluster "
                        "(e.g. cluster='h100-sxm'), or fix stages= to the device count")
    training = graph.meta.get("training", True) if request.training is None else request.training
    speed = max(d.speed for d in cluster.devices[:devices]) if cluster is not None else 1.0
    graphs: dict[tuple[int, int], OpGraph] = {(profiled_batch, 1): graph}  # (microbatch size, T) -> its graph

    profiled_at: dict[int, OpGraph | None] = {}  # microbatch size -> its own graph (profiled at that size), if any

    def own_graph(micro: int) -> OpGraph | None:
        if micro not in profiled_at:
            profiled_at[micro] = graph_for(micro) if graph_for is not None and micro != profiled_batch else None
        return profiled_at[micro]

    def graph_of(micro: int, tp: int = 1) -> OpGraph:
        """The op graph of a microbatch of ``micro`` samples priced for ``tp`` ranks (what bounds are taken on)."""
        g = graphs.get((micro, tp))
        if g is None:
            if tp > 1:
                assert price_tp is not None
                g = price_tp(graph_of(micro), tp)
            else:
                own = own_graph(micro)
                g = own if own is not None else graph.scaled(micro / profiled_batch)
            graphs[(micro, tp)] = g
        return g

    def blocks_of(micro: int, tp: int) -> OpGraph:
        """What a shape is solved on: its graph folded to its repeated blocks. A folded graph's other microbatch
        sizes without a profile of their own are its profiled size scaled, as the op graph would be, T's
        collectives included (their latency, like the per-op overheads, does not scale; pricing thousands of ops
        for each size took seconds a shape)."""
        g = coarse.get((micro, tp))
        if g is None:
            folded = coarse[profiled_batch, 1] is not graph
            if not folded or micro == profiled_batch or own_graph(micro) is not None:
                g = block_graph(graph_of(micro, tp))
            else:
                g = blocks_of(profiled_batch, tp).scaled(micro / profiled_batch)
            coarse[micro, tp] = g
        return g

    # each T's work per tp rank on the profiled microbatch: scaled by each shape's microbatch below
    base = {t: _work(graph_of(profiled_batch, t), training) for t in sorted({s.tensor_parallel for s in shapes})}
    candidates = []
    for shape in shapes:
        bound = _step_lower_bound(shape, base[shape.tensor_parallel], speed,
                                  global_batch / (shape.data_parallel * shape.microbatches) / profiled_batch)
        candidates.append(Candidate(shape, global_batch, lower_bound=bound))
    # Screen every shape with the fast exact-bottleneck DP, then solve the finalists as plan() would.
    two_phase = request.method == "auto" and request.objective == "step_time"
    # Screened plans' schedules are not validated (a search builds hundreds; the simulator
    # still walks each and stops at a deadlock): the plan returned is, below.
    screen = {"method": "dp", "objective": "bottleneck"} if two_phase else {}

    def solve(cand: Candidate, changes: Mapping[str, Any], *, check: bool, where: str | None = placement,
              prune_above: float | None = None, behind: str = "") -> None:
        shape = cand.shape
        g = blocks_of(global_batch // (shape.data_parallel * shape.microbatches), shape.tensor_parallel)
        info = replace(model_info, batch_size=global_batch // shape.data_parallel) if model_info else None
        try:
            cand.plan = solve_plan(
                g, request.with_(devices=None, global_batch=None, stages=shape.stages, microbatches=shape.microbatches,
                                 schedule=shape.schedule, data_parallel=shape.data_parallel,
                                 tensor_parallel=shape.tensor_parallel,
                                 placement=where if shape.data_parallel > 1 and shape.stages > 1 else "cluster",
                                 **changes),
                model_info=info, prune_above=prune_above, check_schedule=check)
        except (PlanningError, ScheduleError) as err:
            cand.reason = " ".join(str(err).split())
            if g.meta.get("blocks"):
                cand.reason += f" (solved with each member of {g.meta['blocks']} one node: no cut inside one weighed)"
            cand.needs = getattr(err, "works", None) or getattr(err, "needed", None)
        except ShapePruned as pruned:
            # a bound on the screened partition, not on the shape (another cut has another critical path): the
            # shape's proven bound stays its compute bound
            cand.reason = f"pruned: its screened partition's critical path alone takes {pruned.bound:.4g} s, {behind}"

    best = math.inf
    for done, cand in enumerate(sorted(candidates, key=lambda c: (c.lower_bound, c.shape)), 1):
        micro = global_batch // (cand.shape.data_parallel * cand.shape.microbatches)
        if own_graph(micro) is not None:
            # profiled at its own size: the scaled graph's bound does not hold for it, its own does
            cand.lower_bound = _step_lower_bound(
                cand.shape, _work(graph_of(micro, cand.shape.tensor_parallel), training), speed, 1.0)
        folded = coarse[profiled_batch, 1]
        per_rank = request.virtual_stages if ScheduleKind.parse(cand.shape.schedule).interleaved else 1
        if folded is not graph and cand.shape.stages * per_rank > len(folded):
            cand.reason = (f"not weighed: {cand.shape.stages * per_rank} stages are more than the {len(folded)} "
                           f"nodes the graph folds to (each member of {folded.meta['blocks']} one, "
                           "partitioner/blocks.py): a stage boundary inside a layer would be needed")
        elif cand.lower_bound >= best:
            cand.reason = f"pruned: its lower bound {cand.lower_bound:.4g} s is no better than {best:.4g} s"
        else:
            # A partition whose step cannot come within the finalists' slack of the best found is
            # not scheduled and simulated (most of a screen's time at 64 ranks x 256 microbatches).
            slack = FINALIST_SLACK if two_phase else 0.0
            with dp_search_work(SCREEN_DP_WORK) if two_phase else contextlib.nullcontext():
                solve(cand, screen, check=not two_phase, prune_above=best * (1 + slack),
                      behind=f"at least {slack:.0%} behind the best step so far ({best:.4g} s)" if slack
                      else f"no better than the best step so far ({best:.4g} s)")
            best = min(best, cand.step_time)
        if progress is not None:
            progress(done, len(candidates) + (MAX_FINALISTS if two_phase else 0))
    if two_phase:
        solved = sorted((c for c in candidates if c.plan is not None), key=lambda c: c.step_time)
        finalists = [c for c in solved if c.step_time <= solved[0].step_time * (1 + FINALIST_SLACK)][:MAX_FINALISTS]
        finished = itertools.count(len(candidates) + 1)
        lock = threading.Lock()

        def finish(cand: Candidate) -> None:
            screened = cand.plan
            assert screened is not None
            solve(cand, {}, check=True, where=screened.placement)  # the placement the screen chose
            if cand.plan is None or cand.plan.step_time > screened.step_time:  # keep the faster of the two
                cand.plan = screened
            cand.final = True
            if progress is not None:
                with lock:
                    progress(next(finished), len(candidates) + len(finalists))

        # One thread per finalist, up to the cores: CP-SAT (one worker each) runs without the GIL, so
        # one finalist's solver overlaps another's Python. Each solve is deterministic (a work budget,
        # not wall time), so the plans do not depend on the threads.
        # The most ranks first: the largest model to build and solve starts first.
        with ThreadPoolExecutor(max_workers=max(1, min(len(finalists), os.cpu_count() or 1))) as pool:
            list(pool.map(finish, sorted(finalists, key=lambda c: -c.shape.stages)))
    candidates.sort(key=lambda c: (c.plan is None, c.step_time, c.shape.stages, c.memory or 0.0, c.shape))
    head = candidates[0].plan if candidates else None
    if head is not None:
        validate(head.schedule)
        head.partition.notes.append(
            f"shape chosen among {len(candidates)} candidates ({devices} devices, global batch {global_batch}): the "
            "fastest simulated step that fits memory (partitioner/shapes.py)")
    return ShapeSearch(devices, global_batch, candidates, dict(skipped or {}))


def _work(graph: OpGraph, training: bool) -> list[float]:
    """Each op's compute time per rank (forward, and backward when training), largest first.

    A graph priced for T tp ranks counts its split ops' 1/T and leaves out its tensor-parallel collectives
    (``tp_fwd_comm``, ``tp_bwd_comm``, in fwd and bwd): what is left scales exactly with the microbatch, as the
    bound's ``factor`` assumes (a collective's latency does not), and the collectives only add to a rank's time,
    so the bound stays a lower bound under T."""
    def compute(d: Mapping[str, Any]) -> float:
        fwd = d.get("fwd", 0.0) - d.get("tp_fwd_comm", 0.0)
        return fwd + (d.get("bwd", 0.0) - d.get("tp_bwd_comm", 0.0) if training else 0.0)

    return sorted((compute(graph[v]) for v in graph.nx), reverse=True)


def _step_lower_bound(shape: Shape, work: Sequence[float], speed: float, factor: float) -> float:
    """Seconds no plan of ``shape`` beats: its busiest rank computes m microbatches of at least its share.

    A rank's share of one microbatch is at least the total over the ranks, the largest op,
    and (pigeonhole) the P-th and (P+1)-th largest ops together: the compute-only part of
    :func:`partitioner.bounds.named_lower_bounds` over ranks, for ``work`` (each op's time,
    largest first) scaled by ``factor``. Compute only: the simulator may hide transfers.
    """
    p = shape.stages
    share = max(sum(work) / p, work[0] if work else 0.0, work[p - 1] + work[p] if len(work) > p else 0.0)
    return shape.microbatches * share * factor / speed


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
