"""The compiler driver: trace, profile, solve, schedule and simulate a model (or a profiled graph) into a Plan."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner.cluster import Cluster
from partitioner.errors import PlanningError
from partitioner.graph import OpGraph
from partitioner.ir import ScheduleKind
from partitioner.microbatch import batch_size, split_microbatches
from partitioner.plan import ModelInfo, Plan, PlanError, schedule_for, simulate_partition
from partitioner.profile import profile
from partitioner.solve import solve
from partitioner.trace import fingerprint, trace

__all__ = ["plan", "plan_from_graph", "plan_microbatches", "Candidate", "MicrobatchSearch", "tied_groups"]


def plan(
    model: nn.Module,
    example_args: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    stages: int,
    microbatches: int | str = 1,
    schedule: str = "1f1b",
    cluster: Cluster | str | Path | None = None,
    memory_limit: float | None = None,
    method: str = "auto",
    time_limit: float | None = None,
    timing: str | None = None,
    device: str | torch.device | None = None,
    device_profile: str | Path | None = None,
    dtype: str | None = None,
    virtual_stages: int = 2,
    colocate_tied: bool = False,
    frontend: str = "auto",
    leaf_modules: Iterable[type | str] = (),
    repeats: int = 5,
    graph: OpGraph | None = None,
    name: str | None = None,
    objective: str = "step_time",
    training: bool = True,
    progress: Callable[[int, int], None] | None = None,
    recompute: str = "auto",
) -> Plan:
    """Trace, profile, solve, schedule and simulate: the whole compiler in one call.

    ``stages`` is the number of pipeline ranks; ``schedule`` is gpipe, 1f1b, interleaved
    (``virtual_stages`` stages per rank) or zb-h1. The sample batch is the whole batch a
    training step sees: ops are profiled on one microbatch of it. ``timing`` defaults to
    measured, or analytic on ``device_profile`` for a model on the meta device.
    ``graph`` skips profiling (a graph from ``smp profile``). ``objective="step_time"`` (the
    default: the figure people read) takes the solver's bottleneck-optimal answer and the
    peer baselines, keeps the fastest by simulated step time and refines it
    (partitioner/refine.py); ``"bottleneck"`` returns the solver's answer itself. Bounds,
    gap and ``optimal`` always speak of the bottleneck (``Partition.bound_on``).
    ``training`` (default) plans a training step whatever mode the module is in, tracing
    and profiling it in train mode; ``training=False`` plans inference in eval mode.
    ``recompute``: activation recomputation per stage (docs/memory.md): "auto" (the
    default: chosen with the partition, none wherever the memory limit allows), or
    "none", "selective", "full" on every stage; ``Plan.recompute`` gives each stage's.
    ``microbatches="auto"`` and/or ``schedule="auto"`` try every divisor of the batch
    (and every schedule) and return the fastest simulated plan that fits memory:
    :func:`plan_microbatches`, which also returns the candidates it weighed.
    """
    if microbatches == "auto" or schedule == "auto":
        if graph is not None:
            raise PlanError("microbatches='auto' profiles every microbatch size, so it needs the model, not a graph")
        return plan_microbatches(
            model, example_args, example_kwargs, stages=stages, microbatches=microbatches, schedule=schedule,
            cluster=cluster, memory_limit=memory_limit, method=method, time_limit=time_limit, timing=timing,
            device=device, device_profile=device_profile, dtype=dtype, virtual_stages=virtual_stages,
            colocate_tied=colocate_tied, frontend=frontend, leaf_modules=leaf_modules, repeats=repeats,
            name=name, objective=objective, training=training, progress=progress, recompute=recompute).best
    if isinstance(microbatches, str):
        raise PlanError(f"microbatches must be a count or 'auto', got {microbatches!r}")
    if stages < 1:
        raise PlanError(f"stages must be >= 1, got {stages}")
    ScheduleKind.parse(schedule)  # a typo should fail before minutes of profiling
    cluster = _resolve_cluster(cluster, stages)
    graph, model_info = _profile_model(model, example_args, example_kwargs, microbatches=microbatches,
                                       timing=timing, device=device, device_profile=device_profile, dtype=dtype,
                                       frontend=frontend, leaf_modules=leaf_modules, repeats=repeats, graph=graph,
                                       name=name, training=training, progress=progress)
    return plan_from_graph(graph, stages=stages, microbatches=microbatches, schedule=schedule, cluster=cluster,
                           memory_limit=memory_limit, method=method, time_limit=time_limit,
                           virtual_stages=virtual_stages, colocate_tied=colocate_tied, training=training,
                           model_info=model_info, objective=objective, recompute=recompute)


def _profile_model(model: nn.Module, example_args: Sequence[Any] | Any, example_kwargs: Mapping[str, Any] | None, *,
                   microbatches: int, timing: str | None, device: str | torch.device | None,
                   device_profile: str | Path | None, dtype: str | None, frontend: str,
                   leaf_modules: Iterable[type | str], repeats: int, graph: OpGraph | None, name: str | None,
                   training: bool, progress: Callable[[int, int], None] | None) -> tuple[OpGraph, ModelInfo]:
    """The op graph of one microbatch (profiled unless given) and what the plan records about the model."""
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    kwargs = dict(example_kwargs or {})
    was_training = model.training
    model.train(training)
    try:
        # One trace, on one microbatch: what the runtime traces too (an export trace is specialised
        # to the shapes it saw), so the fingerprint is the one every rank will compute.
        micro_args, micro_kwargs = split_microbatches(args, kwargs, microbatches)[0]
        gm = trace(model, micro_args, micro_kwargs, frontend=frontend, leaf_modules=leaf_modules)
        if graph is None:
            on_meta = any(p.is_meta for p in model.parameters())
            timing = timing or ("analytic" if on_meta or device_profile else "measured")
            graph = profile(model, micro_args, micro_kwargs, timing=timing, device=device, repeats=repeats,
                            device_profile=device_profile, dtype=dtype, training=training,
                            graph_module=gm, progress=progress)
        info = gm.meta["smp_trace"]
        model_info = ModelInfo(
            name=name or type(model).__name__,
            class_name=f"{type(model).__module__}.{type(model).__qualname__}",
            fingerprint=fingerprint(gm, model),
            frontend=info.frontend,
            leaf_modules=tuple(info.leaf_modules),
            batch_size=batch_size(args, kwargs),
            inputs=graph.meta.get("inputs"),
            num_params=sum(p.numel() for p in model.parameters()),
            param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            training=training,
            timing=graph.meta.get("timing"),
            profiled_on=graph.meta.get("device"),
        )
    finally:
        model.train(was_training)
    return graph, model_info


@dataclass(frozen=True)
class Candidate:
    """One (microbatch count, schedule) that :func:`plan_microbatches` weighed.

    ``peak_memory``: the plan's largest stage memory (bytes); when nothing fits, the least a
    plan needs (``MemoryLimitError.works``, else its lower bound ``needed``). ``proven``:
    the plan's bottleneck is proven optimal. ``error``: why there is no plan.
    """

    microbatches: int
    schedule: str
    step_time: float | None
    bubble: float | None
    peak_memory: float | None
    fits: bool
    proven: bool
    recompute: tuple[str, ...] = ()
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recompute"] = list(self.recompute)
        return d


@dataclass
class MicrobatchSearch:
    """The fastest plan that fits and every candidate weighed, best first."""

    best: Plan
    candidates: list[Candidate]


def plan_microbatches(
    model: nn.Module,
    example_args: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    stages: int,
    microbatches: int | str | Sequence[int] = "auto",
    schedule: str | Sequence[str] = "1f1b",
    progress: Callable[[int, int], None] | None = None,
    **options: Any,
) -> MicrobatchSearch:
    """Choose the microbatch count (and schedule) with the partition: the fastest simulated step that fits memory.

    ``microbatches``: "auto" (every divisor of the batch), a list of counts, or one count;
    ``schedule``: "auto" (every schedule kind), a list, or one. Each microbatch size is
    profiled once (a smaller microbatch is not a scaled-down larger one: per-op overheads
    and weight traffic stay), then every schedule is solved as :func:`plan` does with the
    other ``options``. More microbatches shrink the bubble but keep more activations in
    flight under GPipe and pay each transfer's latency once more; the step time, simulated
    on the schedule's own action lists, weighs both. Raises the best candidate's error when
    none fits.
    """
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    kwargs = dict(example_kwargs or {})
    batch = batch_size(args, kwargs)
    counts = _microbatch_counts(microbatches, batch)
    kinds = [k.value for k in ScheduleKind] if schedule == "auto" else (
        [schedule] if isinstance(schedule, str) else list(schedule))
    kinds = [ScheduleKind.parse(k).value for k in kinds]
    plan_options = {k: options.pop(k) for k in list(options) if k in _SOLVE_OPTIONS}
    plan_options["cluster"] = _resolve_cluster(plan_options.get("cluster"), stages)
    candidates: list[tuple[Candidate, Plan | None, PlanningError | None]] = []
    for m in counts:
        graph, model_info = _profile_model(model, args, kwargs, microbatches=m, progress=progress,
                                           **_profile_options(options))
        for kind in kinds:
            try:
                p = plan_from_graph(graph, stages=stages, microbatches=m, schedule=kind, model_info=model_info,
                                    training=options.get("training", True), **plan_options)
            except PlanningError as err:
                needed = getattr(err, "works", None) or getattr(err, "needed", None)
                candidates.append((Candidate(m, kind, None, None, needed, False, False,
                                             error=" ".join(str(err).split())), None, err))
                continue
            candidates.append((Candidate(m, kind, p.step_time, p.bubble, max(p.stage_memory), p.partition.memory_ok,
                                         bool(p.partition.optimal), tuple(p.recompute)), p, None))
    candidates.sort(key=lambda c: (not c[0].fits, c[0].step_time if c[0].step_time is not None else math.inf,
                                   c[0].peak_memory or math.inf, c[0].microbatches, kinds.index(c[0].schedule)))
    head, best, error = candidates[0]
    if best is None or not head.fits:
        raise error if error is not None else PlanError(
            "no microbatch count fits the memory limit; raise it or add stages")
    weighed = [c for c, _, _ in candidates]
    best.partition.notes.append(
        f"chosen among {len(weighed)} candidates (microbatches {counts}, schedules {kinds}): the fastest simulated "
        "step that fits memory")
    return MicrobatchSearch(best, weighed)


#: Options of :func:`plan_microbatches` that go to the solver; the rest go to profiling.
_SOLVE_OPTIONS = ("cluster", "memory_limit", "method", "time_limit", "virtual_stages", "colocate_tied", "objective",
                  "recompute")


def _profile_options(options: Mapping[str, Any]) -> dict[str, Any]:
    known = ("timing", "device", "device_profile", "dtype", "frontend", "leaf_modules", "repeats", "name", "training")
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"plan_microbatches() got unexpected options {unknown}")
    defaults = {"timing": None, "device": None, "device_profile": None, "dtype": None, "frontend": "auto",
                "leaf_modules": (), "repeats": 5, "name": None, "training": True}
    return {**defaults, **options, "graph": None}


def _microbatch_counts(microbatches: int | str | Sequence[int], batch: int | None) -> list[int]:
    """The counts to try: every divisor of the batch for "auto", else those given (each dividing the batch)."""
    if microbatches == "auto":
        if batch is None:
            raise PlanError("microbatches='auto' needs a tensor input with a batch dimension to split")
        return [d for d in range(1, batch + 1) if batch % d == 0]
    if isinstance(microbatches, str):
        raise PlanError(f"microbatches must be a count, a list of counts or 'auto', got {microbatches!r}")
    counts = [int(microbatches)] if isinstance(microbatches, int) else sorted({int(m) for m in microbatches})
    bad = [m for m in counts if m < 1 or (batch is not None and batch % m)]
    if bad:
        raise PlanError(f"microbatch count {bad[0]} does not divide the batch of {batch}; use divisors of it")
    return counts


def plan_from_graph(
    graph: OpGraph,
    *,
    stages: int,
    microbatches: int = 1,
    schedule: str = "1f1b",
    cluster: Cluster | str | Path | None = None,
    memory_limit: float | None = None,
    method: str = "auto",
    time_limit: float | None = None,
    virtual_stages: int = 2,
    colocate_tied: bool = False,
    training: bool | None = None,
    model_info: ModelInfo | None = None,
    name: str | None = None,
    objective: str = "step_time",
    recompute: str = "auto",
) -> Plan:
    """Solve, schedule and simulate an already-profiled graph (e.g. ``smp profile -o graph.json``).

    The graph's costs are per microbatch. Without ``model_info`` the plan's model section
    comes from ``graph.meta`` (its ``fingerprint`` is ``"unknown"`` when the graph has none).
    """
    if stages < 1:
        raise PlanError(f"stages must be >= 1, got {stages}")
    kind = ScheduleKind.parse(schedule)
    v = virtual_stages if kind.interleaved else 1
    if v < 1:
        raise PlanError("virtual_stages must be >= 1")
    num_stages = stages * v
    if training is None:
        training = bool(graph.meta.get("training", True))
    base_cluster = _resolve_cluster(cluster, stages)
    if len(graph) < num_stages:
        raise PlanError(f"the model has {len(graph)} ops, fewer than the {num_stages} stages asked for; "
                        "use fewer stages (or fewer virtual stages)")
    stage_cluster = base_cluster.interleaved(stages, v) if base_cluster is not None else None
    limit = memory_limit / v if (memory_limit is not None and v > 1) else memory_limit
    colocate = tied_groups(graph) if colocate_tied else ()
    part = solve(graph, num_stages, cluster=stage_cluster, microbatches=microbatches, schedule=kind.value,
                 training=training, memory_limit=limit, colocate=colocate, method=method, time_limit=time_limit,
                 objective=objective, ranks=stages, recompute=recompute)
    sched = schedule_for(kind, part, microbatches, stages)
    if model_info is None:
        model_info = _model_info_from_graph(graph, microbatches, training, name)
    return Plan(model=model_info, graph=graph, partition=part, schedule=sched,
                simulated=simulate_partition(sched, part))


def _model_info_from_graph(graph: OpGraph, microbatches: int, training: bool, name: str | None) -> ModelInfo:
    meta = graph.meta
    per_microbatch = meta.get("batch_size")
    return ModelInfo(
        name=name or meta.get("name") or meta.get("model") or "model",
        class_name=meta.get("class"),
        fingerprint=meta.get("fingerprint") or "unknown",
        frontend=meta.get("frontend"),
        leaf_modules=tuple(meta.get("leaf_modules", ())),
        # The graph is costed per microbatch: a step's batch is that times the microbatches.
        batch_size=per_microbatch * microbatches if isinstance(per_microbatch, int) else None,
        inputs=meta.get("inputs"),
        num_params=meta.get("num_params"),
        param_bytes=meta.get("param_bytes", graph.total_params),
        training=training,
        timing=meta.get("timing"),
        profiled_on=meta.get("device"),
    )


def _resolve_cluster(cluster: Cluster | str | Path | None, devices: int) -> Cluster | None:
    if cluster is None or isinstance(cluster, Cluster):
        if isinstance(cluster, Cluster) and len(cluster.devices) < devices:
            raise PlanError(f"the cluster has {len(cluster.devices)} devices, fewer than the {devices} stages")
        return cluster
    return Cluster.load(cluster, devices=devices)


def tied_groups(graph: OpGraph) -> list[list[str]]:
    """Ops that read the same parameter (under any of its names), as colocation groups."""
    owner: dict[str, str] = {}  # name a parameter was first counted under -> the op that counted it
    for node in graph.nx:
        shared = set(graph[node]["shared_params"])
        for param in graph[node]["param_names"]:
            if param not in shared:
                owner.setdefault(param, node)
    readers: dict[str, list[str]] = {}
    for node in graph.nx:
        for first_name in graph[node]["shared_from"]:
            if first_name in owner:
                group = readers.setdefault(first_name, [owner[first_name]])
                if node not in group:
                    group.append(node)
    return [group for group in readers.values() if len(group) > 1]
