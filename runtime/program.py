"""The traced program a pipeline runs, and which ranks hold each of its parameters and buffers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partitioner.ir import Edge, Schedule, StageGraph
from partitioner.plan import Plan
from partitioner.program import fingerprint
from partitioner.graph import MATMUL_FX, is_matmul
from partitioner.schedule import make_schedule, with_allreduce
from runtime.errors import RuntimeConfigError
from runtime.materialize import names_by_id
from runtime.split import carry_stages, cut_edges, stage_state_names, state_meta_of

__all__ = ["Program", "Ownership", "program_for"]


@dataclass
class Program:
    """One traced mode of the model and how it runs: stage of every fx node, and the training schedule.

    ``fx_to_op`` names cut edges after the plan's ops (coarsened groups); ``state_meta``
    is every parameter's and buffer's (shape, dtype), recorded before any was dropped.
    ``recompute``: each stage's activation recomputation when training (the plan's
    choices; empty: none), and ``matmul_nodes`` the fx nodes a selective stage keeps.
    """

    gm: torch.fx.GraphModule
    fx_stage_of: Mapping[str, int]
    fx_to_op: Mapping[str, str]
    schedule: Schedule
    state_meta: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    frontend: str
    recompute: Sequence[str] = ()
    matmul_nodes: frozenset[str] = frozenset()


def program_for(plan: Plan, gm: torch.fx.GraphModule, model: nn.Module, data_parallel: int,
                train: Program | None = None) -> Program:
    """How ``gm`` (``model`` traced in one mode) runs under ``plan`` on ``data_parallel`` replicas.

    The plan's own program when ``gm`` is the model it was made for (its schedule, with the
    gradient all-reduces placed for these replicas when the plan was made for others). An
    eval-mode trace that is another graph (export records dropout and batch norm's mode) runs
    on the training program ``train``'s stages, every parameter where it already is, under
    the plan's schedule kind made for its cut edges: :class:`SplitError` when its ops cannot
    be placed so. A training trace that is not the plan's model is refused.
    """
    frontend = gm.meta["smp_trace"].frontend
    got = fingerprint(gm, model)
    if got == plan.model.fingerprint:
        fx_to_op = plan.fx_to_op
        nodes = plan.graph.nx.nodes
        # a folded group names its matmul-like fx nodes (partitioner.graph.MATMUL_FX); an op is one by its FLOPs
        matmul = frozenset(n for n, op in fx_to_op.items()
                           if (n in nodes[op][MATMUL_FX] if MATMUL_FX in nodes[op]
                               else is_matmul(float(nodes[op].get("flops", 0) or 0))))
        schedule = plan.schedule if plan.schedule.data_parallel == data_parallel else \
            with_allreduce(plan.schedule, data_parallel, sharding=plan.sharding)
        return Program(gm, plan.fx_stage_of, fx_to_op, schedule, state_meta_of(gm), frontend,
                       recompute=tuple(plan.recompute), matmul_nodes=matmul)
    if train is None:
        raise RuntimeConfigError(
            f"this plan was made for another model (plan fingerprint {plan.model.fingerprint}, this model "
            f"{got}; plan for {plan.model.name!r}): the ops, their wiring or the parameter shapes differ. "
            "Re-plan for this model (smp.partition(model, plan=None) or `smp plan`).")
    stage_of = carry_stages(train.gm, plan.fx_stage_of, gm, plan.num_stages)
    graph = StageGraph(plan.num_stages, tuple(Edge(a, b, t) for a, b, t in cut_edges(gm, stage_of)))
    schedule = make_schedule(plan.schedule_name, graph, plan.microbatches, num_ranks=plan.pipeline_ranks,
                             data_parallel=data_parallel, sharding=plan.sharding,
                             active_microbatches=plan.active_microbatches)
    return Program(gm, stage_of, {}, schedule, state_meta_of(gm), frontend)


class Ownership:
    """Which ranks hold each parameter and buffer; the others are dropped here; parameters tied across ranks.

    The stage programs share parameters with ``model`` by reference. On a multi-rank run
    the parameters and buffers of other ranks' stages are replaced by meta tensors in the
    model (and in every traced program), so they take no memory; a tensor no op reads
    stays on rank 0 so that the gathered state dict is complete.
    """

    def __init__(self, model: nn.Module, program: Program, roots: Sequence[nn.Module], *, rank: int | None) -> None:
        self.model = model
        self.names = names_by_id(model)
        self.canonical: dict[int, str] = {i: ns[0] for i, ns in self.names.items()}
        sched = program.schedule
        holders, self.stage_param_ids = _readers_by_stage(program, sched)
        for i in self.names:
            holders.setdefault(i, {0})
        self.holders = holders
        local = set(range(sched.num_ranks)) if rank is None else {rank}
        self.local_ids = {i for i, rs in holders.items() if rs & local}
        # Facts here are keyed by tensor id: the tensors replaced below are kept alive so that no
        # new tensor can reuse an id (an emptied or meta tensor holds no memory).
        self._retired = _drop(model, roots, set(holders) - self.local_ids)
        self.rank = rank
        self._find_ties()

    def rekey(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Follow tensors that materialization replaced (a meta tensor by a real one): same facts, new ids."""
        if not pairs:
            return
        new_id = {id(old): id(new) for old, new in pairs}
        self._retired.extend(old for old, _ in pairs)

        def ids(xs: set[int]) -> set[int]:
            return {new_id.get(i, i) for i in xs}

        self.names = {new_id.get(i, i): n for i, n in self.names.items()}
        self.canonical = {new_id.get(i, i): n for i, n in self.canonical.items()}
        self.holders = {new_id.get(i, i): rs for i, rs in self.holders.items()}
        self.local_ids = ids(self.local_ids)
        self.stage_param_ids = {s: ids(v) for s, v in self.stage_param_ids.items()}
        self._find_ties()

    def _find_ties(self) -> None:
        """Parameters this rank holds together with other ranks (a tied embedding and LM head on two stages)."""
        self.ties: dict[tuple[int, ...], list[nn.Parameter]] = {}
        rank = self.rank
        if rank is not None:
            for p in self.model.parameters():
                rs = tuple(sorted(self.holders.get(id(p), {0})))
                if len(rs) > 1 and rank in rs:
                    self.ties.setdefault(rs, []).append(p)


def _readers_by_stage(program: Program, sched: Schedule) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """(tensor id -> ranks whose stages read it, stage -> ids of the tensors it reads)."""
    gm = program.gm
    tensors = dict(gm.named_parameters(remove_duplicate=False))
    tensors.update(dict(gm.named_buffers(remove_duplicate=False)))
    nodes_by_stage: dict[int, list[Any]] = {s: [] for s in range(sched.num_stages)}
    for node in gm.graph.nodes:
        s = program.fx_stage_of.get(node.name)
        if s is not None and node.op != "output":
            nodes_by_stage[int(s)].append(node)
    holders: dict[int, set[int]] = {}
    per_stage: dict[int, set[int]] = {}
    for s, nodes in nodes_by_stage.items():
        ids = set()
        for name in stage_state_names(gm, nodes):
            t = tensors.get(name)
            if t is None:
                try:
                    t = gm.get_parameter(name)
                except (AttributeError, ValueError):
                    continue
            ids.add(id(t))
            holders.setdefault(id(t), set()).add(sched.stage_to_rank[s])
        per_stage[s] = ids
    return holders, per_stage


def _drop(model: nn.Module, roots: Sequence[nn.Module], drop: set[int]) -> list[torch.Tensor]:
    """Replace the tensors with ids in ``drop`` by meta tensors of the same shape in the model and every root;
    returns the replaced tensors (emptied)."""
    if not drop:
        return []
    dropped: dict[int, torch.Tensor] = {}
    for root in [model, *roots]:
        for mod in root.modules():
            for store in (mod._parameters, mod._buffers):
                for key, t in list(store.items()):
                    if t is not None and id(t) in drop:
                        meta = torch.empty_like(t, device="meta")
                        store[key] = nn.Parameter(meta, requires_grad=t.requires_grad) \
                            if isinstance(t, nn.Parameter) else meta
                        dropped[id(t)] = t
    # An optimizer made before partitioning still refers to the old tensors: empty them so
    # those references hold no memory (they get no gradient, so optimizers skip them).
    for t in dropped.values():
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return list(dropped.values())
