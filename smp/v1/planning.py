"""Partitioning a v1 model: smp's planner (memory_weight mapped onto a memory cap) or the manual assignment, with
the stages of checkpointed modules recomputing, made once on rank 0 and shared; then checked against memory."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

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
from partitioner.request import PlanRequest
from partitioner.units import format_bytes
from smp.rank0_plan import plan_on_rank0
from smp.v1 import manual
from smp.v1.comm import CommGroup, gather_objects, group_ranks
from smp.v1.errors import V1Error
from smp.v1.state import State

__all__ = ["partition_plan", "weigh_memory", "recompute_checkpointed", "module_paths", "check_fits", "out_of_memory", "warn_unreached", "device_memory"]

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
    request = cfg.request(data_parallel=state.topology.dp_size).with_(device=profile_on)

    def build() -> Plan:
        with torch.random.fork_rng(devices=[]):  # profiling runs the model; every rank's RNG stays the same
            if cfg.auto_partition:
                asked = request.with_(memory_limit=limit)
                chosen = weigh_memory(make_plan(module, args, kwargs, asked), asked, cfg.memory_weight)
                return recompute_checkpointed(chosen, module, state.checkpointed)
            # any quick plan gives the profiled graph and the model's identity; the stages are the user's
            base = make_plan(module, args, kwargs, request.with_(method="dp", objective="bottleneck"))
        stage_of = manual.stage_of_ops(module, base.graph, cfg.partitions, cfg.default_partition)
        return recompute_checkpointed(manual.manual_plan(base, stage_of, limit), module, state.checkpointed)

    return plan_on_rank0(build, rank=state.topology.rank, store=state.store if state.distributed else None,
                         timeout=state.config.timeout, key=state.next_key("plan"))


def weigh_memory(fast: Plan, request: PlanRequest, weight: float | None) -> Plan:
    """v1's ``memory_weight`` w as a cap on the largest stage's memory, the fastest plan under it kept.

    ``fast`` is the plan of ``request`` (whose ``memory_limit`` stays a cap on every stage). The cap is ``peak - w * (peak - floor)``: ``peak`` is the largest stage of the fastest
    plan (w = 0), ``floor`` the least any plan can need (``partitioner.bounds.memory_lower_bound``,
    w = 1). When the planner proves a cap infeasible it is relaxed toward ``peak``.
    """
    if not weight:
        return fast
    peak = max(fast.stage_memory)
    # the fastest plan's settings, unlimited and without recomputation: the least any plan needs
    prob = Problem(fast.graph, fast.partition.settings(), cluster=None, training=True, memory_limit=None,
                   recompute="none")
    floor = memory_lower_bound(prob)[0]
    target = peak - weight * (peak - floor)
    for step in _RELAX_STEPS:
        cap = target + step * (peak - target)
        if cap >= peak:
            break
        try:
            limit = cap if request.memory_limit is None else min(cap, request.memory_limit)
            plan = plan_from_graph(fast.graph, request.with_(memory_limit=limit), model_info=fast.model)
        except PlanningError:
            continue
        plan.partition.notes.append(
            f"v1 memory_weight={weight:g}: largest stage capped at {format_bytes(cap)} (fastest plan "
            f"{format_bytes(peak)}, least possible {format_bytes(floor)})")
        return plan
    fast.partition.notes.append(f"v1 memory_weight={weight:g}: no plan under a lower memory cap than the fastest "
                                f"plan's {format_bytes(peak)}; the fastest plan is kept")
    return fast


def recompute_checkpointed(plan: Plan, model: nn.Module, modules: Sequence[nn.Module]) -> Plan:
    """``plan`` with every stage that runs an op of one of ``modules`` (``smp.set_activation_checkpointing``)
    recomputing its whole forward in the backward ("full"), the other stages as planned; the assignment stays.

    smp recomputes whole stages (docs/memory.md), so "full" on each stage holding a part of
    the module is the least recomputation that covers every activation of the module.
    """
    if not modules:
        return plan
    graph, stage_of = plan.graph, plan.partition.stage_of
    full: set[int] = set()
    for mod in modules:
        paths = module_paths(model, mod)
        ops = [n for n in graph.nx if n != OUTPUT_OP and any(_inside(graph[n]["module"], p) for p in paths)]
        if not ops:
            warnings.warn(f"smp.v1: module {paths[0]!r} runs no op in the traced forward; "
                          "set_activation_checkpointing() changes nothing for it", stacklevel=3)
        full.update(int(stage_of[n]) for n in ops)
    recompute = ["full" if s in full else choice for s, choice in enumerate(plan.recompute)]
    if recompute == list(plan.recompute):
        return plan
    redone = plan.resimulate(recompute=recompute)
    redone.partition.notes[:0] = plan.partition.notes
    redone.partition.notes.append(f"v1 set_activation_checkpointing: partition{'s' if len(full) > 1 else ''} "
                                  f"{', '.join(map(str, sorted(full)))} recompute their forward in the backward")
    return redone


def module_paths(model: nn.Module, module: nn.Module) -> list[str]:
    """Every path of ``module`` inside ``model`` (a shared module has several); an error when it is not there."""
    paths = [path for path, sub in model.named_modules(remove_duplicate=False) if sub is module]
    if not paths:
        raise V1Error(f"smp.set_activation_checkpointing() was given a {type(module).__name__} that is not part of "
                      "the DistributedModel's module; pass one of its submodules")
    return paths


def _inside(op_module: str, path: str) -> bool:
    """Whether an op of module ``op_module`` runs inside the module at ``path`` ("" is the whole model)."""
    return not path or op_module == path or op_module.startswith(path + ".")


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
