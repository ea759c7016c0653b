"""The compiler driver: trace, profile, solve, schedule and simulate a model (or a profiled graph) into a Plan."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner.cluster import Cluster
from partitioner.graph import OpGraph
from partitioner.ir import ScheduleKind
from partitioner.microbatch import batch_size, split_microbatches
from partitioner.plan import ModelInfo, Plan, PlanError, schedule_for, simulate_partition
from partitioner.profile import profile
from partitioner.solve import solve
from partitioner.trace import fingerprint, trace

__all__ = ["plan", "plan_from_graph", "tied_groups"]


def plan(
    model: nn.Module,
    example_args: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    stages: int,
    microbatches: int = 1,
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
    """
    if stages < 1:
        raise PlanError(f"stages must be >= 1, got {stages}")
    ScheduleKind.parse(schedule)  # a typo should fail before minutes of profiling
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    kwargs = dict(example_kwargs or {})
    base_cluster = _resolve_cluster(cluster, stages)
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
    return plan_from_graph(graph, stages=stages, microbatches=microbatches, schedule=schedule, cluster=base_cluster,
                           memory_limit=memory_limit, method=method, time_limit=time_limit,
                           virtual_stages=virtual_stages, colocate_tied=colocate_tied, training=training,
                           model_info=model_info, objective=objective, recompute=recompute)


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
