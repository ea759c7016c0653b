"""Partitioning a v1 model: smp's planner (memory_weight mapped onto a memory cap) or the manual assignment,
made once on rank 0 and shared; then checked against each rank's device memory."""

from __future__ import annotations

import datetime
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import networkx as nx
import torch
from torch import nn

from partitioner.bounds import memory_lower_bound
from partitioner.compile import plan as make_plan
from partitioner.compile import plan_from_graph
from partitioner.errors import PlanningError
from partitioner.graph import OUTPUT_OP
from partitioner.plan import Plan
from partitioner.problem import Problem
from partitioner.units import format_bytes
from smp.v1 import manual
from smp.v1.comm import CommGroup, gather_objects, group_ranks
from smp.v1.errors import V1Error
from smp.v1.state import State

__all__ = ["partition_plan", "weigh_memory", "check_fits", "out_of_memory", "warn_unreached", "device_memory",
           "PLANNING_WAIT"]

#: How long the other ranks wait for rank 0 to trace, profile and plan the model (seconds).
PLANNING_WAIT = 3600.0

#: The memory caps tried between the one memory_weight asks for and the fastest plan's peak, when the
#: planner proves the asked cap infeasible: the fraction of the way back to the peak.
_RELAX_STEPS = (0.0, 0.25, 0.5, 0.75)


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of ``device``; None where smp does not know it (a CPU)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def partition_plan(module: nn.Module, args: tuple, kwargs: dict, state: State, device: torch.device,
                   trace_device: str) -> Plan:
    """The plan every rank runs: made on rank 0 from this batch, shared through the store."""
    cfg = state.config
    memory = device_memory(device)
    # one device holds every partition in a lone process: the cap is on their sum, checked after planning
    limit = float(memory[1]) if memory is not None and state.distributed else None
    profile_on = torch.device("cpu") if trace_device == "cpu" else (device if device.type == "cuda" else None)
    # the plan is for every replica of the pipeline (the sample batch is one replica's share)
    replicas = {"data_parallel": state.topology.dp_size, "placement": cfg.placement,
                "active_microbatches": cfg.active_microbatches}

    def build() -> Plan:
        with torch.random.fork_rng(devices=[]):  # profiling runs the model; every rank's RNG stays the same
            if cfg.auto_partition:
                fast = make_plan(module, args, kwargs, stages=cfg.partitions, microbatches=cfg.microbatches,
                                 schedule=cfg.schedule, memory_limit=limit, device=profile_on, **replicas)
                return weigh_memory(fast, cfg.memory_weight, limit)
            # any quick plan gives the profiled graph and the model's identity; the stages are the user's
            base = make_plan(module, args, kwargs, stages=cfg.partitions, microbatches=cfg.microbatches,
                             schedule=cfg.schedule, device=profile_on, method="dp", objective="bottleneck",
                             **replicas)
        stage_of = manual.stage_of_ops(module, base.graph, cfg.partitions, cfg.default_partition)
        return manual.manual_plan(base, stage_of, limit)

    return _on_rank0(build, state)


def weigh_memory(fast: Plan, weight: float | None, limit: float | None) -> Plan:
    """v1's ``memory_weight`` w as a cap on the largest stage's memory, the fastest plan under it kept.

    The cap is ``peak - w * (peak - floor)``: ``peak`` is the largest stage of the fastest
    plan (w = 0), ``floor`` the least any plan can need (``partitioner.bounds.memory_lower_bound``,
    w = 1). When the planner proves a cap infeasible it is relaxed toward ``peak``.
    """
    if not weight:
        return fast
    peak = max(fast.stage_memory)
    prob = Problem(fast.graph, fast.num_stages, microbatches=fast.microbatches, schedule=fast.schedule_name,
                   active_microbatches=fast.active_microbatches, state_factor=fast.partition.state_factor,
                   workspace_factor=fast.partition.workspace_factor)
    floor = memory_lower_bound(prob)[0]
    target = peak - weight * (peak - floor)
    for step in _RELAX_STEPS:
        cap = target + step * (peak - target)
        if cap >= peak:
            break
        try:
            plan = plan_from_graph(fast.graph, stages=fast.pipeline_ranks, microbatches=fast.microbatches,
                                   schedule=fast.schedule_name, memory_limit=cap if limit is None else min(cap, limit),
                                   model_info=fast.model, data_parallel=fast.data_parallel, placement=fast.placement,
                                   active_microbatches=fast.active_microbatches)
        except PlanningError:
            continue
        plan.partition.notes.append(
            f"v1 memory_weight={weight:g}: largest stage capped at {format_bytes(cap)} (fastest plan "
            f"{format_bytes(peak)}, least possible {format_bytes(floor)})")
        return plan
    fast.partition.notes.append(f"v1 memory_weight={weight:g}: no plan under a lower memory cap than the fastest "
                                f"plan's {format_bytes(peak)}; the fastest plan is kept")
    return fast


def _on_rank0(build: Callable[[], Plan], state: State) -> Plan:
    """``build()`` on rank 0 (measured profiles differ between ranks), its plan (or error) shared via the store."""
    if not state.distributed:
        return build()
    key = state.next_key("plan")
    if state.topology.rank == 0:
        try:
            payload: dict[str, Any] = {"plan": build().to_dict()}
        except Exception as err:  # noqa: BLE001 - every rank must learn that partitioning failed
            state.store.set(key, pickle.dumps({"error": f"{type(err).__name__}: {err}"}))
            raise
        state.store.set(key, pickle.dumps(payload))
    else:
        try:
            state.store.wait([key], datetime.timedelta(seconds=max(PLANNING_WAIT, state.config.timeout)))
        except Exception as err:  # noqa: BLE001
            raise V1Error(f"rank {state.topology.rank} waited for rank 0 to partition the model and gave up "
                          f"({err}): rank 0 is stuck or died") from None
        payload = pickle.loads(state.store.get(key))
        if "error" in payload:
            raise V1Error(f"rank 0 could not partition the model: {payload['error']}")
    return Plan.from_dict(payload["plan"])


def _ranks_here(plan: Plan, state: State) -> list[int]:
    return [state.topology.pp_rank] if state.distributed else list(range(plan.pipeline_ranks))


def _stage_lines(plan: Plan, ranks: list[int]) -> str:
    part = plan.partition
    lines = []
    for r in ranks:
        for s in plan.schedule.stages_of(r):
            st = part.stages[s]
            lines.append(f"partition {s} ({st.modules or 'no module'}): about {format_bytes(st.memory)} = "
                         f"{format_bytes(st.params)} of parameters x{part.state_factor:g} with gradients and "
                         f"optimizer state + the larger of {format_bytes(st.activations)} of activations per "
                         f"microbatch x {st.in_flight} in flight and the optimizer step's "
                         f"{format_bytes(st.workspace)} of workspace")
    return "; ".join(lines)


def check_fits(plan: Plan, state: State, device: torch.device) -> None:
    """Raise on every rank when a rank's partitions are predicted not to fit its device's free memory."""
    ranks = _ranks_here(plan, state)
    need = sum(plan.rank_memory[r] for r in ranks)
    have = device_memory(device)
    problem = None
    if have is not None and need > have[0]:
        problem = (f"rank {state.topology.rank} on {device}: {_stage_lines(plan, ranks)}; needs about "
                   f"{format_bytes(need)} but {device} has {format_bytes(have[0])} free of {format_bytes(have[1])}")
    problems = [p for p in gather_objects("partition (memory check)", problem, group_ranks(CommGroup.MP_GROUP, state),
                                          state) if p]
    if problems:
        raise V1Error("the partitioned model does not fit: " + " | ".join(problems) + ". Use more partitions, "
                      "smaller or fewer microbatches, or \"memory_weight\" closer to 1.0")


def out_of_memory(plan: Plan, state: State, device: torch.device, during: str) -> V1Error:
    """What to tell a rank whose device ran out of memory: its partitions and what the plan expected them to need."""
    ranks = _ranks_here(plan, state)
    return V1Error(f"rank {state.topology.rank} ran out of memory on {device} {during}. The plan expected "
                   f"{format_bytes(sum(plan.rank_memory[r] for r in ranks))} there: {_stage_lines(plan, ranks)}. "
                   "Use more partitions, smaller or fewer microbatches, or \"memory_weight\" closer to 1.0")


def warn_unreached(plan: Plan) -> None:
    """Name the modules whose outputs never reach the model's output: their parameters get no gradient."""
    graph = plan.graph
    reached = nx.ancestors(graph.nx, OUTPUT_OP)
    unreached = sorted({graph[n]["module"] or "(the model)" for n in graph.nx
                        if n != OUTPUT_OP and n not in reached and graph[n]["param_names"]})
    if unreached:
        warnings.warn(f"smp.v1: the outputs of module{'s' if len(unreached) > 1 else ''} {', '.join(unreached)} never "
                      "reach the model's output; they run in the pipeline, and their parameters get no gradient "
                      "(as in PyTorch)", stacklevel=3)
