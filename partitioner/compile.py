"""The compiler driver: trace, profile, solve, schedule and simulate a model (or a profiled graph) into a Plan."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner.cluster import Cluster, Link
from partitioner.cost import Partition
from partitioner.errors import ShapePruned
from partitioner.graph import OpGraph
from partitioner.ir import ScheduleKind
from partitioner.microbatch import batch_size, split_microbatches
from partitioner.plan import (PLACEMENTS, ModelInfo, Plan, PlanError, replica_layout, schedule_for,
                              simulate_partition)
from partitioner.problem import DEFAULT_STATE_FACTOR
from partitioner.profile import profile
from partitioner.schedule import check_active_microbatches
from partitioner.shapes import ShapeSearch, search_shapes
from partitioner.solve import solve
from partitioner.trace import fingerprint, trace

__all__ = ["plan", "plan_from_graph", "plan_shapes", "tied_groups"]


def plan(
    model: nn.Module,
    example_args: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    stages: int | None = None,
    microbatches: int | str | Sequence[int] | None = None,
    schedule: str | Sequence[str] = "1f1b",
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
    data_parallel: int = 1,
    placement: str | None = None,
    devices: int | None = None,
    global_batch: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    recompute: str = "auto",
    active_microbatches: int | None = None,
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
    ``data_parallel`` replicas of the pipeline (each with the sample batch as its share)
    and their ``placement``: see :func:`plan_from_graph`. ``recompute``: activation
    recomputation per stage (docs/memory.md): "auto" (the default: chosen with the
    partition, none wherever the memory limit allows), or "none", "selective", "full" on
    every stage; ``Plan.recompute`` gives each stage's. ``active_microbatches`` caps the
    microbatches a stage holds in flight (gpipe, 1f1b; SMP v1's name; docs/schedules.md).

    A search instead of one shape: ``devices=N`` weighs every D replicas x P stages x m
    microbatches on N devices of ``cluster`` for ``global_batch`` samples a step (default:
    the sample batch), with ``stages`` or ``microbatches`` fixing their part of the grid;
    ``microbatches="auto"`` (or a list of counts) and ``schedule="auto"`` (or a list) weigh
    the counts and schedules of a ``stages``-rank pipeline. Either returns the fastest
    simulated plan that fits memory; :func:`plan_shapes` also returns every candidate.
    """
    searching = (devices is not None or microbatches == "auto" or not isinstance(schedule, str)
                 or schedule in ("auto", "all") or isinstance(microbatches, (list, tuple)))
    if searching:
        if active_microbatches is not None:
            raise PlanError("active_microbatches fixes one schedule's warm-up, and a search weighs schedules and "
                            "microbatch counts as they are: drop active_microbatches, or fix the schedule and count")
        if data_parallel != 1:
            raise PlanError("devices= searches the data-parallel degree itself; drop data_parallel=")
        if devices is None and stages is None:
            raise PlanError("a microbatch or schedule search is for a pipeline of stages= ranks (or pass devices=)")
        return plan_shapes(
            model, example_args, example_kwargs, devices=devices if devices is not None else stages,
            global_batch=global_batch, stages=stages, microbatches=microbatches, schedule=schedule, cluster=cluster,
            memory_limit=memory_limit, method=method, time_limit=time_limit, timing=timing, device=device,
            device_profile=device_profile, dtype=dtype, virtual_stages=virtual_stages, colocate_tied=colocate_tied,
            frontend=frontend, leaf_modules=leaf_modules, repeats=repeats, graph=graph, name=name,
            objective=objective, training=training, placement=placement, recompute=recompute,
            progress=progress).best
    if global_batch is not None:
        raise PlanError("global_batch= goes with devices= (the shape search); without it the sample batch is "
                        "one replica's batch")
    if stages is None:
        raise PlanError("pass stages= (pipeline ranks), or devices= to search data parallel x stages x microbatches")
    if isinstance(microbatches, str):
        raise PlanError(f"microbatches must be a count, a list of counts or 'auto', got {microbatches!r}")
    if stages < 1:
        raise PlanError(f"stages must be >= 1, got {stages}")
    microbatches = 1 if microbatches is None else int(microbatches)  # type: ignore[arg-type]  # lists search
    try:  # a typo should fail before minutes of profiling
        check_active_microbatches(ScheduleKind.parse(schedule), active_microbatches)  # type: ignore[arg-type]
    except ValueError as err:
        raise PlanError(str(err)) from None
    _resolve_cluster(cluster, stages * data_parallel)
    graph, model_info = _profile(model, example_args, example_kwargs, microbatches=microbatches, timing=timing,
                                 device=device, device_profile=device_profile, dtype=dtype, frontend=frontend,
                                 leaf_modules=leaf_modules, repeats=repeats, graph=graph, name=name,
                                 training=training, progress=progress)
    return plan_from_graph(graph, stages=stages, microbatches=microbatches, schedule=schedule,  # type: ignore[arg-type]
                           cluster=cluster, memory_limit=memory_limit, method=method, time_limit=time_limit,
                           virtual_stages=virtual_stages, colocate_tied=colocate_tied, training=training,
                           model_info=model_info, objective=objective, data_parallel=data_parallel,
                           placement=placement, recompute=recompute, active_microbatches=active_microbatches)


def plan_shapes(
    model: nn.Module,
    example_args: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    devices: int,
    global_batch: int | None = None,
    stages: int | None = None,
    microbatches: int | str | Sequence[int] | None = None,
    schedule: str | Sequence[str] = "1f1b",
    cluster: Cluster | str | Path | None = None,
    device_profile: str | Path | None = None,
    training: bool = True,
    graph: OpGraph | None = None,
    placement: str | None = None,
    virtual_stages: int = 2,
    progress: Callable[[int, int], None] | None = None,
    shape_progress: Callable[[int, int], None] | None = None,
    **options: Any,
) -> ShapeSearch:
    """Every shape of ``devices`` weighed for ``global_batch`` samples a step, fastest first.

    The model is profiled on the sample batch as one microbatch, and each shape's microbatch
    is that graph scaled (partitioner/shapes.py); with measured timing, a microbatch size the
    sample batch splits into is profiled on its own instead. ``cluster`` (default:
    ``device_profile``'s devices, else free links and no memory limit) prices the links and
    bounds the memory. ``microbatches``: None or "auto" (the default grid), a count or a
    list of counts; ``schedule``: one name, a list, or "auto" (every kind). ``options`` go
    to :func:`plan_from_graph` (method, time_limit, memory_limit, objective, colocate_tied,
    recompute) and to profiling (timing, device, dtype, frontend, leaf_modules, repeats, name).
    """
    schedules = [k.value for k in ScheduleKind] if schedule in ("auto", "all") else \
        [schedule] if isinstance(schedule, str) else list(schedule)
    for kind in schedules:
        ScheduleKind.parse(kind)
    if isinstance(microbatches, str) and microbatches != "auto":
        raise PlanError(f"microbatches must be a count, a list of counts or 'auto', got {microbatches!r}")
    counts = None if microbatches in (None, "auto") else \
        [microbatches] if isinstance(microbatches, int) else [int(m) for m in microbatches]  # type: ignore[union-attr]
    resolved = _resolve_cluster(cluster if cluster is not None else device_profile, devices)
    if resolved is None and devices > (stages or 1):
        raise PlanError("weighing data parallelism needs the links its gradient all-reduce crosses: pass a cluster "
                        "(e.g. cluster='h100-sxm'), or fix stages= to the device count")
    profile_keys = ("timing", "device", "dtype", "frontend", "leaf_modules", "repeats", "name")
    prof = {k: options.pop(k) for k in profile_keys if k in options}
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    sample = batch_size(args, dict(example_kwargs or {}))
    if not isinstance(sample, int):
        raise PlanError("the shape search splits the batch among replicas and microbatches: the sample inputs need "
                        "a batch dimension (dim 0 of the tensor inputs)")
    given = graph is not None
    graph, model_info = _profile(model, args, example_kwargs, microbatches=1, device_profile=device_profile,
                                 graph=graph, training=training, progress=progress, **prof)

    def profiled(micro: int) -> OpGraph | None:
        """Measured times do not scale with the microbatch (per-op overheads, caches): a size the sample
        batch splits into is profiled on its own, as smp.plan would; analytic graphs are scaled."""
        if given or graph.meta.get("timing") != "measured" or sample % micro:
            return None
        return _profile(model, args, example_kwargs, microbatches=sample // micro, device_profile=device_profile,
                        training=training, **prof)[0]

    return search_shapes(graph, devices=devices, global_batch=global_batch or sample, profiled_batch=sample,
                         cluster=resolved, solve_plan=plan_from_graph, schedules=schedules, stages=stages,
                         microbatches=counts, model_info=model_info, placement=placement,
                         virtual_stages=virtual_stages, options={**options, "training": training},
                         progress=shape_progress, graph_for=profiled)


def _profile(model: nn.Module, example_args: Sequence[Any] | Any, example_kwargs: Mapping[str, Any] | None, *,
             microbatches: int, timing: str | None = None, device: str | torch.device | None = None,
             device_profile: str | Path | None = None, dtype: str | None = None, frontend: str = "auto",
             leaf_modules: Iterable[type | str] = (), repeats: int = 5, graph: OpGraph | None = None,
             name: str | None = None, training: bool = True, progress: Callable[[int, int], None] | None = None,
             ) -> tuple[OpGraph, ModelInfo]:
    """The model traced and costed on one microbatch (unless ``graph`` is given), and what the plan says of it."""
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
    data_parallel: int = 1,
    placement: str | None = None,
    recompute: str = "auto",
    active_microbatches: int | None = None,
    check_schedule: bool = True,
    prune_above: float | None = None,
) -> Plan:
    """Solve, schedule and simulate an already-profiled graph (e.g. ``smp profile -o graph.json``).

    The graph's costs are per microbatch. Without ``model_info`` the plan's model section
    comes from ``graph.meta`` (its ``fingerprint`` is ``"unknown"`` when the graph has none).
    ``data_parallel`` replicas of the ``stages``-rank pipeline run on D x P devices of the
    cluster, laid out by ``placement`` ("cluster" or "spread", see :class:`Plan`; None
    tries both and keeps the faster step). ``check_schedule=False`` skips validating the
    schedule (the simulator still walks it and stops at a deadlock): for a search that
    screens many shapes and validates the plan it returns. ``prune_above`` (seconds): raise
    :class:`ShapePruned` instead of scheduling a partition whose step is provably at least
    that long (:func:`pipeline_step_bound`), for a search that needs no slower plan.
    """
    if stages < 1:
        raise PlanError(f"stages must be >= 1, got {stages}")
    if data_parallel < 1:
        raise PlanError(f"data_parallel must be >= 1, got {data_parallel}")
    if placement is None and data_parallel > 1 and cluster is not None:
        plans, bounds = [], []
        for how in PLACEMENTS:
            try:
                plans.append(plan_from_graph(
                    graph, stages=stages, microbatches=microbatches, schedule=schedule, cluster=cluster,
                    memory_limit=memory_limit, method=method, time_limit=time_limit, virtual_stages=virtual_stages,
                    colocate_tied=colocate_tied, training=training, model_info=model_info, name=name,
                    objective=objective, data_parallel=data_parallel, placement=how, recompute=recompute,
                    active_microbatches=active_microbatches, check_schedule=check_schedule,
                    prune_above=prune_above))
            except ShapePruned as pruned:
                bounds.append(pruned.bound)
        if not plans:
            raise ShapePruned(min(bounds))
        return min(plans, key=lambda p: p.step_time)
    placement = placement or "cluster"
    if placement not in PLACEMENTS:
        raise PlanError(f"unknown placement {placement!r}; choose {' or '.join(PLACEMENTS)}")
    kind = ScheduleKind.parse(schedule)
    v = virtual_stages if kind.interleaved else 1
    if v < 1:
        raise PlanError("virtual_stages must be >= 1")
    num_stages = stages * v
    if training is None:
        training = bool(graph.meta.get("training", True))
    base_cluster, dp_link = replica_layout(_resolve_cluster(cluster, stages * data_parallel), stages, data_parallel,
                                    placement)
    if len(graph) < num_stages:
        raise PlanError(f"the model has {len(graph)} ops, fewer than the {num_stages} stages asked for; "
                        "use fewer stages (or fewer virtual stages)")
    stage_cluster = base_cluster.interleaved(stages, v) if base_cluster is not None else None
    limit = memory_limit / v if (memory_limit is not None and v > 1) else memory_limit
    colocate = tied_groups(graph) if colocate_tied else ()
    part = solve(graph, num_stages, cluster=stage_cluster, microbatches=microbatches, schedule=kind.value,
                 training=training, memory_limit=limit, colocate=colocate, method=method, time_limit=time_limit,
                 objective=objective, ranks=stages, recompute=recompute, active_microbatches=active_microbatches,
                 state_factor=state_factor_for(data_parallel))
    if prune_above is not None:
        bound = pipeline_step_bound(part, kind, microbatches)
        if bound is not None and bound >= prune_above:
            raise ShapePruned(bound)
    sched = schedule_for(kind, part, microbatches, stages, data_parallel, check=check_schedule)
    if model_info is None:
        model_info = _model_info_from_graph(graph, microbatches, training, name)
    return Plan(model=model_info, graph=graph, partition=part, schedule=sched,
                simulated=simulate_partition(sched, part, dp_link, graph), placement=placement, dp_link=dp_link)


def pipeline_step_bound(part: Partition, kind: ScheduleKind, microbatches: int) -> float | None:
    """Seconds no GPipe or 1F1B step of ``part`` can beat (None for other schedules): for every stage s,
    its first forward waits for the forwards of the stages before it on a path of cut edges, its rank
    then runs m forwards and m backwards (recomputation included), the last of them B(s, m-1), whose
    gradient the stages before s pass back to the first on a path again. Transfers only add."""
    if kind not in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B):
        return None
    fwd = [float(s.fwd) for s in part.stages]
    bwd = [float(s.bwd) + float(getattr(s, "recompute_time", 0.0) or 0.0) for s in part.stages]
    senders: list[set[int]] = [set() for _ in part.stages]  # stage -> the stages that send to it
    for t in part.transfers:
        if t.src_stage != t.dst_stage:
            senders[int(t.dst_stage)].add(int(t.src_stage))
    before = [0.0] * len(fwd)  # the longest path of forwards into s
    after = [0.0] * len(fwd)  # the longest path of backwards from s's senders back
    for s in range(len(fwd)):  # stages are numbered in pipeline order: senders come first
        before[s] = max((before[u] + fwd[u] for u in senders[s]), default=0.0)
        after[s] = max((bwd[u] + after[u] for u in senders[s]), default=0.0)
    # (1 - 1e-9): the simulator adds the same seconds in another order
    return max(b + microbatches * (f + g) + a for b, f, g, a in zip(before, fwd, bwd, after)) * (1 - 1e-9)


def state_factor_for(data_parallel: int) -> float:
    """Bytes held per parameter byte: weights, gradients and Adam's two moments, and with replicas one more
    gradient-sized copy: the flat buffers of the gradient buckets, alive from their all-reduce's launch to
    the end of the step (runtime/engine.py)."""
    return DEFAULT_STATE_FACTOR + (1.0 if data_parallel > 1 else 0.0)


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
