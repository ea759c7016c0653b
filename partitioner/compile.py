"""The compiler driver: trace, profile, solve, schedule and simulate a model (or a profiled graph) into a Plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.fx as fx
from torch import nn

from partitioner.cluster import Cluster
from partitioner.cost import Partition
from partitioner.errors import MemoryLimitError, PlanningError, ShapePruned
from partitioner.graph import OpGraph
from partitioner.ir import ScheduleKind
from partitioner.microbatch import batch_size, split_microbatches
from partitioner.plan import (PLACEMENTS, ModelInfo, Plan, PlanError, replica_layout, schedule_for,
                              simulate_partition)
from partitioner.problem import DEFAULT_WORKSPACE_FACTOR, ProblemSettings
from partitioner.profile import profile
from partitioner.program import fingerprint, flatten_inputs
from partitioner.request import PlanRequest
from partitioner.shapes import ShapeSearch, search_shapes
from partitioner.sharding import SHARDING_MODES, state_bytes
from partitioner.solve import solve
from partitioner.tensor_parallel import (TensorParallelSplit, global_shapes, price_tensor_parallel,
                                         tensor_parallel_split, tp_link)
from partitioner.tp_graph import SequenceParallelError
from partitioner.trace import trace
from partitioner.units import format_bytes

__all__ = ["plan", "plan_from_graph", "plan_shapes", "profile_model", "trace_model", "tied_groups", "PlanRequest"]


def plan(
    model: nn.Module,
    example_args: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    request: PlanRequest | None = None,
    *,
    graph: OpGraph | None = None,
    progress: Callable[[int, int], None] | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    **options: Any,
) -> Plan:
    """Trace, profile, solve, schedule and simulate: the whole compiler in one call.

    What to plan is a :class:`PlanRequest` (``request``, with ``options`` naming its fields:
    ``stages``, ``microbatches``, ``schedule``, ``cluster``, ``memory_limit``, ``recompute``,
    ... and the profiling ones, ``timing``, ``device``, ``device_profile``, ``dtype``, ...).
    The sample batch is the whole batch a training step sees: ops are profiled on one
    microbatch of it (``microbatches`` defaults to :func:`default_microbatches` of it).
    ``graph`` skips profiling (a graph from ``smp profile``); ``progress(done, total)`` follows
    the profiling. ``objective="step_time"`` (the default: the figure people read) takes the
    solver's bottleneck-optimal answer and the peer baselines, keeps the fastest by simulated
    step time and refines it (partitioner/refine.py); ``"bottleneck"`` returns the solver's
    answer itself. Bounds, gap and ``optimal`` always speak of the bottleneck
    (``Partition.bound_on``). A training plan traces and profiles the model in train mode
    whatever mode the module is in; ``training=False`` plans inference in eval mode.
    ``tensor_parallel=T`` > 1 prices each stage's modules split over T ranks by ``tp_plan`` (default the model's
    own: partitioner/tp_plan.py), per tp rank (partitioner/tensor_parallel.py).

    A search instead of one shape (``devices=N``, ``microbatches="auto"`` or a list,
    ``schedule="auto"`` or a list): the fastest simulated plan that fits memory;
    :func:`plan_shapes` also returns every candidate.
    """
    request = PlanRequest.build(request, **options)
    if request.searching:
        return plan_shapes(model, example_args, example_kwargs, request, graph=graph, progress=progress,
                           tp_plan=tp_plan).best
    if request.stages is None:
        raise PlanError("pass stages= (pipeline ranks), or devices= to search data parallel x stages x microbatches")
    args, kwargs = _inputs(example_args, example_kwargs)
    batch = batch_size(args, kwargs)
    request = request.with_(microbatches=request.microbatches_for(batch if isinstance(batch, int) else 1),
                            training=request.trains)
    cluster = _resolve_cluster(request.cluster, request.stages * request.data_parallel * request.tensor_parallel)
    gm = trace_model(model, args, kwargs, request, microbatches=request.microbatches)
    graph, model_info = profile_model(model, args, kwargs, request, microbatches=request.microbatches, graph=graph,
                                      progress=progress, traced=gm)
    if request.tensor_parallel > 1:
        split = _tp_split(model, gm, _micro_inputs(gm, args, kwargs, request.microbatches), request.tensor_parallel,
                          tp_plan, request.sequence_parallel)
        graph = price_tensor_parallel(graph, split, tp_link(cluster, request.tensor_parallel))
    elif request.sequence_parallel is True:
        raise PlanError("sequence_parallel=True splits the sequence between the modules tensor parallelism splits: "
                        "pass tensor_parallel=T > 1 too, or drop it")
    return plan_from_graph(graph, request, model_info=model_info)


def _tp_split(model: nn.Module, gm: fx.GraphModule, flat_inputs: list[Any], size: int,
              tp_plan: Mapping[str, Any] | None, sequence_parallel: bool | str, *,
              shapes: Mapping[str, Any] | None = None) -> TensorParallelSplit:
    """What ``size`` tp ranks split of ``gm``, with sequence parallelism as ``sequence_parallel`` says: True
    requires it (its SequenceParallelError says why not), "auto" runs it where the program allows it (a sequence
    ``size`` divides, a rowwise output [batch, sequence, features]: Megatron-LM's choice wherever it can, since it
    moves the same bytes as the all-reduces it replaces and runs the norms and residual adds on 1/T of the
    sequence), else without."""
    shapes = global_shapes(gm, flat_inputs) if shapes is None else shapes
    why_not = None
    if sequence_parallel is not False:
        try:
            return tensor_parallel_split(model, gm, flat_inputs, size, tp_plan, shapes=shapes, sequence_parallel=True)
        except SequenceParallelError as err:
            if sequence_parallel is True:
                raise
            why_not = " ".join(str(err).split())  # "auto" plans without it and says why (the plan's summary)
    split = tensor_parallel_split(model, gm, flat_inputs, size, tp_plan, shapes=shapes)
    return dataclasses.replace(split, sequence_off=why_not)


def plan_shapes(
    model: nn.Module,
    example_args: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    request: PlanRequest | None = None,
    *,
    graph: OpGraph | None = None,
    progress: Callable[[int, int], None] | None = None,
    shape_progress: Callable[[int, int], None] | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    **options: Any,
) -> ShapeSearch:
    """Every shape of ``devices`` weighed for ``global_batch`` samples a step, fastest first.

    The request's ``devices`` (default: its ``stages``, for a microbatch or schedule search of
    one pipeline), ``global_batch`` (default: the sample batch), ``stages`` and
    ``microbatches`` fixing their part of the grid, ``schedule`` one kind, a tuple or "auto".
    The model is profiled on the sample batch as one microbatch, and each shape's microbatch
    is that graph scaled (partitioner/shapes.py); with measured timing, a microbatch size the
    sample batch splits into is profiled on its own instead. ``cluster`` (default:
    ``device_profile``'s devices, else free links and no memory limit) prices the links and
    bounds the memory. ``tensor_parallel="auto"`` weighs T in :data:`TP_DEGREES` (those that divide the GPUs of a
    node and the devices, and that the model's ``tp_plan`` can split: the others are reported as skipped, with why);
    a whole number fixes T.
    """
    request = PlanRequest.build(request, **options)
    devices = request.devices if request.devices is not None else request.stages
    if devices is None:
        raise PlanError("a shape search needs devices= (or stages= for a microbatch or schedule search)")
    request = request.with_(devices=devices, training=request.trains)
    cluster = request.cluster if request.cluster is not None else request.profiling.device_profile
    resolved = _resolve_cluster(cluster, devices)
    if resolved is None and devices > (request.stages or 1):
        raise PlanError("weighing data parallelism needs the links its gradient all-reduce crosses: pass a cluster "
                        "(e.g. cluster='h100-sxm'), or fix stages= to the device count")
    args, kwargs = _inputs(example_args, example_kwargs)
    sample = batch_size(args, kwargs)
    if not isinstance(sample, int):
        raise PlanError("the shape search splits the batch among replicas and microbatches: the sample inputs need "
                        "a batch dimension (dim 0 of the tensor inputs)")
    given = graph is not None
    gm = trace_model(model, args, kwargs, request, microbatches=1)
    graph, model_info = profile_model(model, args, kwargs, request, microbatches=1, graph=graph, progress=progress,
                                      traced=gm)
    degrees, skipped, splits = _tp_degrees(model, gm, _micro_inputs(gm, args, kwargs, 1), request, resolved, tp_plan)
    link = {t: tp_link(resolved, t) for t in degrees}

    def price_tp(g: OpGraph, t: int) -> OpGraph:
        return price_tensor_parallel(g, splits[t], link[t])

    def profiled(micro: int) -> OpGraph | None:
        """Measured times do not scale with the microbatch (per-op overheads, caches): a size the sample
        batch splits into is profiled on its own, as smp.plan would; analytic graphs are scaled."""
        if given or graph.meta.get("timing") != "measured" or sample % micro:
            return None
        return profile_model(model, args, kwargs, request, microbatches=sample // micro)[0]

    return search_shapes(graph, request.with_(global_batch=request.global_batch or sample, cluster=resolved,
                                              tensor_parallel=1),
                         profiled_batch=sample, solve_plan=plan_from_graph, model_info=model_info,
                         progress=shape_progress, graph_for=profiled, price_tp=price_tp, tensor_parallel=degrees,
                         skipped=skipped)


#: The tensor-parallel degrees a search weighs (within a node: T divides its GPUs).
TP_DEGREES = (1, 2, 4, 8)


def _tp_degrees(model: nn.Module, gm: fx.GraphModule, flat_inputs: list[Any], request: PlanRequest,
                cluster: Cluster | None, tp_plan: Mapping[str, Any] | None
                ) -> tuple[list[int], dict[int, str], dict[int, TensorParallelSplit]]:
    """The degrees T a search weighs (the request's, or :data:`TP_DEGREES` for "auto"), those skipped and why, and
    each weighed T's split of the model. A fixed T the model cannot split is an error; under "auto" it is skipped."""
    auto = request.tensor_parallel == "auto"
    asked = TP_DEGREES if auto else (int(request.tensor_parallel),)
    devices = request.devices or 1
    per_node = None
    if cluster is not None:
        per_node = sum(1 for d in cluster.devices if d.node == cluster.devices[0].node)
    degrees, skipped, splits = [], {}, {}
    shapes = None
    for t in asked:
        if devices % t:
            skipped[t] = f"does not divide the {devices} devices"
        elif auto and per_node is not None and per_node % t:
            skipped[t] = f"does not divide the {per_node} GPUs of a node (tensor parallelism stays within one)"
        elif t > 1:
            try:
                if shapes is None:
                    shapes = global_shapes(gm, flat_inputs)  # one fake run serves every T
                splits[t] = _tp_split(model, gm, flat_inputs, t, tp_plan, request.sequence_parallel, shapes=shapes)
            except PlanningError as err:  # TensorParallelError: heads, features, no tp plan
                if not auto:
                    raise
                skipped[t] = " ".join(str(err).split())
        if t not in skipped:
            degrees.append(t)
    if not degrees:
        raise PlanError(f"no tensor-parallel degree of {asked} can run: " + "; ".join(
            f"T={t} {why}" for t, why in skipped.items()))
    return degrees, skipped, splits


def _inputs(example_args: Sequence[Any] | Any, example_kwargs: Mapping[str, Any] | None) -> tuple[tuple, dict]:
    """The sample batch as positional and keyword inputs (one positional input may be passed bare)."""
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    return args, dict(example_kwargs or {})


def trace_model(model: nn.Module, example_args: Sequence[Any] | Any, example_kwargs: Mapping[str, Any] | None,
                request: PlanRequest, *, microbatches: int) -> fx.GraphModule:
    """The model traced on one of ``microbatches`` microbatches of the sample batch, in the request's mode (train
    mode for a training plan, whatever mode the module is in)."""
    args, kwargs = _inputs(example_args, example_kwargs)
    how = request.profiling
    was_training = model.training
    model.train(request.trains)
    try:
        # One trace, on one microbatch: what the runtime traces too (an export trace is specialised
        # to the shapes it saw), so the fingerprint is the one every rank will compute.
        micro_args, micro_kwargs = split_microbatches(args, kwargs, microbatches)[0]
        return trace(model, micro_args, micro_kwargs, frontend=how.frontend, leaf_modules=how.leaf_modules)
    finally:
        model.train(was_training)


def _micro_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict, microbatches: int) -> list[Any]:
    """The traced program's inputs for one of ``microbatches`` microbatches of the sample batch."""
    micro_args, micro_kwargs = split_microbatches(args, kwargs, microbatches)[0]
    return flatten_inputs(gm, micro_args, micro_kwargs)


def profile_model(model: nn.Module, example_args: Sequence[Any] | Any, example_kwargs: Mapping[str, Any] | None,
                  request: PlanRequest, *, microbatches: int, graph: OpGraph | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  traced: fx.GraphModule | None = None) -> tuple[OpGraph, ModelInfo]:
    """The model traced (unless ``traced`` is :func:`trace_model`'s already) and costed on one of ``microbatches``
    microbatches of the sample batch (unless ``graph`` is given), as ``request.profiling`` says, and what a plan
    says of the model."""
    args, kwargs = _inputs(example_args, example_kwargs)
    how = request.profiling
    training = request.trains
    was_training = model.training
    model.train(training)
    try:
        micro_args, micro_kwargs = split_microbatches(args, kwargs, microbatches)[0]
        gm = traced if traced is not None else trace_model(model, args, kwargs, request, microbatches=microbatches)
        if graph is None:
            on_meta = any(p.is_meta for p in model.parameters())
            timing = how.timing or ("analytic" if on_meta or how.device_profile else "measured")
            graph = profile(model, micro_args, micro_kwargs, timing=timing, device=how.device, repeats=how.repeats,
                            device_profile=how.device_profile, dtype=how.dtype, training=training,
                            graph_module=gm, progress=progress, compiled=how.compile)
        info = gm.meta["smp_trace"]
        model_info = ModelInfo(
            name=how.name or type(model).__name__,
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
            compiled=bool(graph.meta.get("compiled", False)),
        )
    finally:
        model.train(was_training)
    return graph, model_info


def plan_from_graph(
    graph: OpGraph,
    request: PlanRequest | None = None,
    *,
    model_info: ModelInfo | None = None,
    check_schedule: bool = True,
    prune_above: float | None = None,
    **options: Any,
) -> Plan:
    """Solve, schedule and simulate an already-profiled graph (e.g. ``smp profile -o graph.json``).

    The graph's costs are per microbatch, so any microbatch count splits it (the default is
    :func:`default_microbatches` of an unknown batch). Without ``model_info`` the plan's model
    section comes from ``graph.meta`` (its ``fingerprint`` is ``"unknown"`` when the graph has
    none). ``data_parallel`` replicas of the ``stages``-rank pipeline run on D x P devices of
    the cluster, laid out by ``placement`` ("cluster" or "spread", see :class:`Plan`; None
    tries both and keeps the faster step). ``check_schedule=False`` skips validating the
    schedule (the simulator still walks it and stops at a deadlock): for a search that
    screens many shapes and validates the plan it returns. ``prune_above`` (seconds): raise
    :class:`ShapePruned` instead of scheduling a partition whose step is provably at least
    that long (:func:`pipeline_step_bound`), for a search that needs no slower plan. ``sharding="auto"``
    with replicas weighs each mode (:func:`weigh_sharding`).
    """
    request = PlanRequest.build(request, **options)
    if request.searching:
        raise PlanError("plan_from_graph makes one plan; a search over devices, microbatch counts or schedules is "
                        "plan_shapes (or smp.plan with the model)")
    if request.stages is None:
        raise PlanError("pass stages= (pipeline ranks)")
    stages, data_parallel = request.stages, request.data_parallel
    if graph.meta.get("tensor_parallel", 1) != request.tensor_parallel:
        raise PlanError(f"the graph is priced for tensor_parallel={graph.meta.get('tensor_parallel', 1)}, the request "
                        f"asks for {request.tensor_parallel}: plan the model itself (smp.plan(model, ..., "
                        "tensor_parallel=T) prices T; partitioner/tensor_parallel.py)")
    sequence_parallel = bool(graph.meta.get("sequence_parallel", False))
    if request.tensor_parallel > 1 and request.sequence_parallel not in ("auto", sequence_parallel):
        raise PlanError(f"the graph is priced with sequence_parallel={sequence_parallel}, the request asks for "
                        f"{request.sequence_parallel}: plan the model itself (smp.plan(model, ..., "
                        "sequence_parallel=...) prices it)")
    if request.placement is None and data_parallel > 1 and request.cluster is not None:
        plans, bounds = [], []
        for how in PLACEMENTS:
            try:
                plans.append(plan_from_graph(graph, request.with_(placement=how), model_info=model_info,
                                             check_schedule=check_schedule, prune_above=prune_above))
            except ShapePruned as pruned:
                bounds.append(pruned.bound)
        if not plans:
            raise ShapePruned(min(bounds))
        return min(plans, key=lambda p: p.step_time)
    training = bool(graph.meta.get("training", True)) if request.training is None else request.training
    # compiled stages run unsharded (PlanRequest refuses a sharding given with compile=True). Split stages (T > 1)
    # are weighed as whole ones: the graph priced for T holds each tp rank's parameter bytes, which the modes'
    # per-byte factors (partitioner.sharding.state_bytes) split again over the replicas
    if request.sharding == "auto" and data_parallel > 1 and training and not graph.meta.get("compiled", False):
        return weigh_sharding(lambda mode: plan_from_graph(graph, request.with_(sharding=mode), model_info=model_info,
                                                           check_schedule=check_schedule, prune_above=prune_above),
                              request.stages_per_rank, request.kind)
    placement = request.placement or "cluster"
    microbatches = request.microbatches_for(None)
    kind = request.kind
    v = request.stages_per_rank
    num_stages = stages * v
    base_cluster, dp_link = replica_layout(_tp_groups(_resolve_cluster(request.cluster, stages * data_parallel
                                                                       * request.tensor_parallel),
                                                      request.tensor_parallel), stages, data_parallel, placement)
    if len(graph) < num_stages:
        raise PlanError(f"the model has {len(graph)} ops, fewer than the {num_stages} stages asked for; "
                        "use fewer stages (or fewer virtual stages)")
    stage_cluster = base_cluster.interleaved(stages, v) if base_cluster is not None else None
    memory_limit = request.memory_limit
    limit = memory_limit / v if (memory_limit is not None and v > 1) else memory_limit
    colocate = tied_groups(graph) if request.colocate_tied else ()
    sharding = request.sharding_for(data_parallel)
    held = state_bytes(sharding, data_parallel, DEFAULT_WORKSPACE_FACTOR, stages_per_rank=v)
    # the request as the problem's settings: the one place its fields reach the solver and the cost model
    settings = ProblemSettings(num_stages, cluster=stage_cluster, microbatches=microbatches, schedule=kind.value,
                               training=training, memory_limit=limit, ranks=stages, recompute=request.recompute,
                               active_microbatches=request.active_microbatches, state_factor=held.state,
                               working_factor=held.working, workspace_factor=held.workspace)
    part = solve(graph, settings, colocate=colocate, method=request.method, time_limit=request.time_limit,
                 objective=request.objective)
    if prune_above is not None:
        bound = pipeline_step_bound(part, kind, microbatches)
        if bound is not None and bound >= prune_above:
            raise ShapePruned(bound)
    sched = schedule_for(kind, part, microbatches, stages, data_parallel, check=check_schedule, sharding=sharding)
    if model_info is None:
        model_info = _model_info_from_graph(graph, microbatches, training, request.profiling.name)
    return Plan(model=model_info, graph=graph, partition=part, schedule=sched,
                simulated=simulate_partition(sched, part, dp_link, graph), placement=placement, dp_link=dp_link,
                tensor_parallel=request.tensor_parallel, sequence_parallel=sequence_parallel)


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


def weigh_sharding(plan_under: Callable[[str], Plan], stages_per_rank: int, kind: ScheduleKind) -> Plan:
    """The fastest plan among the sharding modes that fit (the least sharded on a tie), with each mode's verdict
    in ``Plan.sharding_weighed``.

    ``full_shard`` is weighed only with interleaved stages: with one stage (one FSDP unit) per
    rank it holds at its peak what ``shard_grad_op`` holds (the stage's parameters gathered
    while it computes, :func:`partitioner.sharding.state_bytes`) and gathers them before
    every forward and backward instead of once a step, so it is never faster. A schedule that
    splits the backward (``kind``) runs unsharded (:func:`partitioner.sharding.check_backward`). When no mode
    fits, the most sharded one's error is raised (it needs the least memory).
    """
    plans: dict[str, Plan] = {}
    verdicts: dict[str, str] = {}
    failure: Exception | None = None
    bounds: list[float] = []
    for mode in SHARDING_MODES:
        if mode != "none" and kind.split_backward:
            verdicts[mode] = f"not weighed: {kind.value} splits the backward, which FSDP2's hooks do not follow"
            continue
        if mode == "full_shard" and stages_per_rank == 1:
            verdicts[mode] = ("not weighed: with one stage per rank it holds shard_grad_op's peak and gathers the "
                              "parameters before every forward and backward")
            continue
        try:
            plans[mode] = plan_under(mode)
        except ShapePruned as pruned:
            bounds.append(pruned.bound)
            verdicts[mode] = f"pruned: its critical path alone takes {pruned.bound:.4g} s"
        except PlanningError as err:
            failure = err
            needs = getattr(err, "works", None) or getattr(err, "needed", None)
            verdicts[mode] = ("does not fit in memory" + (f" (needs {format_bytes(needs)} per device)" if needs else "")
                              if isinstance(err, MemoryLimitError) else " ".join(str(err).split()))
    if not plans:
        if bounds and failure is None:
            raise ShapePruned(min(bounds))
        assert failure is not None
        raise failure
    best = min(plans.values(), key=lambda p: p.step_time)  # min keeps the first (least sharded) of equals
    for mode, made in plans.items():
        verdicts[mode] = "chosen: the fastest that fits" if made is best else \
            f"fits, step {made.step_time / best.step_time:.3f}x the chosen one's ({made.step_time * 1e3:.4g} ms)"
    best.sharding_weighed = {mode: verdicts[mode] for mode in SHARDING_MODES}
    return best


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
        compiled=bool(meta.get("compiled", False)),
    )


def _tp_groups(cluster: Cluster | None, tensor_parallel: int) -> Cluster | None:
    """The cluster as its tensor-parallel groups (T consecutive devices each, as runtime/layout.py places them): one
    device per group, its first, linked to the next group's as their peers are (each tp rank sends to its peer)."""
    if cluster is None or tensor_parallel == 1:
        return cluster
    return cluster.subset(range(0, len(cluster) - tensor_parallel + 1, tensor_parallel))


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
