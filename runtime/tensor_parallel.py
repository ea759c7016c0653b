"""Tensor parallelism inside pipeline stages: torch DTensor's colwise/rowwise styles on each stage's modules by name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from partitioner.plan import Plan
from partitioner.request import PlanRequest
from partitioner.tp_graph import (ModuleSplit, SplitActivations, TensorParallelError, planned_module, rewrite_stage,
                                  split_activations)
from partitioner.tensor_parallel import not_run_split
from partitioner.tp_plan import check_tp_plan, resolve_tp_plan
from runtime.errors import RuntimeConfigError
from runtime.precision import Precision
from runtime.program import Program
from runtime.split import StageProgram, ValueMeta, propagate_meta

__all__ = ["TensorParallel", "TensorParallelRefused", "split_over_tp", "refuse_plan",
           "tp_plan_for", "settled"]


class TensorParallelRefused(TensorParallelError, RuntimeConfigError):
    """Tensor parallelism refused as the pipeline is set up (the request, the plan, the tp plan, the activations):
    the planner's error about it, and one of the runtime's configuration errors."""


@contextlib.contextmanager
def _refused_at_setup() -> Iterator[None]:
    """The shared checks' (partitioner/tp_plan.py, tp_graph.py) errors raised as :class:`TensorParallelRefused`."""
    try:
        yield
    except TensorParallelRefused:
        raise
    except TensorParallelError as err:
        raise TensorParallelRefused(str(err)) from None


def refuse_plan(plan: Plan) -> None:
    """Refuse a made plan (from a file, or made without tensor parallelism's limits) that tensor-parallel stages do
    not run with yet."""
    why = not_run_split(compiled=plan.model.compiled, schedules=[plan.schedule_name])
    if why is not None:
        raise TensorParallelRefused(f"the plan runs {why}, which tensor_parallel={plan.tensor_parallel} does not "
                                    "run with yet: re-plan without it (compile=False, schedule gpipe, 1f1b or "
                                    "interleaved)")


def tp_plan_for(model: nn.Module, given: Mapping[str, Any] | None, request: PlanRequest,
                tp_size: int) -> dict[str, Any] | None:
    """The tp plan a pipeline of ``tensor_parallel=tp_size`` runs (None for 1), resolved and checked against the
    model and the request before any collective."""
    if tp_size == 1:
        if given is not None:
            raise TensorParallelRefused("tp_plan= goes with tensor_parallel=T > 1: pass tensor_parallel, or drop "
                                      "tp_plan")
        return None
    plan = resolve_tp_plan(model, given)
    with _refused_at_setup():
        check_tp_plan(model, plan, tp_size)
    return plan


def settled(t: torch.Tensor) -> torch.Tensor:
    """A stage's output as a plain tensor: a rowwise module's output is DTensor's asynchronous all-reduce still
    in flight (a wrapper without storage), which a cut sends and the meter counts; its clone waits for it and
    stays on the autograd graph."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.clone() if isinstance(t, AsyncCollectiveTensor) else t


def split_over_tp(t: torch.Tensor) -> bool:
    """Whether ``t`` (a parameter or gradient) is split over the tp ranks: a DTensor sharded on its mesh's "tp"
    dimension, not replicated there (sharded over the replicas too, its "dp" placement is FSDP's)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and any(name == "tp" and not (p.is_replicate() or p.is_partial())
                                          for name, p in zip(t.device_mesh.mesh_dim_names or (), t.placements))


def _torch_style(style: Any, module: nn.Module) -> Any:
    """The torch ParallelStyle of a style name (a torch style as given)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(style, str):
        return style
    name = style.strip().lower()
    if name.startswith("fused_colwise:"):
        return _fused_colwise(int(name.split(":", 1)[1]))
    embedding = isinstance(module, nn.Embedding)
    return {"colwise": lambda: ColwiseParallel(),
            "rowwise": lambda: RowwiseParallel(input_layouts=Replicate()) if embedding else RowwiseParallel(),
            "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
            "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate())}[name]()


def _fused_colwise_class() -> type:
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class FusedColwise(ColwiseParallel):
        """Colwise for a Linear that is ``parts`` projections side by side: rank t holds the t-th share of each
        (DTensor's strided shard), so the output's chunks are each projection's share."""

        def __init__(self, parts: int) -> None:
            super().__init__(output_layouts=_StridedShard(-1, split_factor=parts))
            self.parts = parts

        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            for key, param in list(module.named_parameters()):
                placement = _StridedShard(0, split_factor=self.parts)
                module.register_parameter(key, nn.Parameter(
                    distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                    requires_grad=param.requires_grad))

        @staticmethod
        def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                               device_mesh: Any) -> Any:
            return outputs.to_local()  # strided over the output features already: each projection's share

    return FusedColwise


def _fused_colwise(parts: int) -> Any:
    """The style of a Linear of ``parts`` projections side by side (its class made on first use: torch's
    distributed imports wait until tensor parallelism runs)."""
    return _fused_colwise_class()(parts)


class TensorParallel:
    """This rank's tensor parallelism: the checked plan (module name -> style), the "tp" mesh, and which modules
    are split already (the stage programs of both modes share the model's modules).

    :meth:`apply` splits a traced program's stage programs: it follows which activations are split
    (partitioner/tp_graph.py), rewrites their head counts to this rank's share, and applies
    ``parallelize_module`` to the stage modules the plan names (each rank cuts its share of the whole
    weights it holds: no communication). The parameters become DTensors (``replaced`` pairs each
    old one with its new one, for the ownership's ids).
    """

    def __init__(self, model: nn.Module, plan: Mapping[str, Any], mesh: Any, tp_size: int) -> None:
        self.model = model
        self.mesh = mesh
        self.size = tp_size
        with _refused_at_setup():
            self.modules = check_tp_plan(model, plan, tp_size)
        self._applied: dict[int, nn.Module] = {}

    def styles(self) -> dict[str, ModuleSplit]:
        return {name: how for name, (_, how) in self.modules.items()}

    def activations(self, gm: fx.GraphModule, meta: Mapping[str, ValueMeta]) -> SplitActivations:
        """Which of ``gm``'s values are split (and its rewrites), from every value's global shape ``meta``."""
        with _refused_at_setup():
            return split_activations(gm, self.styles(), meta, self.size)

    def split_stages(self, program: Program, stages: Sequence[StageProgram], example_flat: Sequence[Any],
                     device: torch.device, precision: Precision) -> tuple[SplitActivations, list[tuple[Any, Any]]]:
        """Which of ``program``'s values are split (from its global shapes on ``example_flat``, one microbatch),
        and ``stages`` (this rank's programs of it) split: :meth:`apply`'s replaced parameters."""
        every = {n.name for n in program.gm.graph.nodes if n.op not in ("output", "get_attr")}
        with self.hooks_off(), precision.autocast(device):
            values = propagate_meta(program.gm, example_flat, every, program.state_meta, device)
        acts = self.activations(program.gm, values)
        return acts, self.apply(stages, acts)

    def apply(self, stages: Sequence[StageProgram], acts: SplitActivations) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Split ``stages`` (this rank's): local head counts, then their plan modules; the replaced parameters."""
        from torch.distributed.tensor.parallel import parallelize_module

        replaced: list[tuple[torch.Tensor, torch.Tensor]] = []
        for sp in stages:
            rewrite_stage(sp.gm, acts)
            self._call_modules(sp.gm)
            for node in sp.gm.graph.nodes:
                name = str(node.target)
                if node.op != "call_module" or name not in self.modules:
                    continue
                module = sp.gm.get_submodule(name)
                if id(module) in self._applied:
                    continue
                before = dict(module.named_parameters())
                parallelize_module(module, self.mesh, _torch_style(self.modules[name][0], module),
                                   src_data_rank=None)  # every tp rank holds the whole weights: cut, not sent
                self._applied[id(module)] = module
                replaced += [(before[k], p) for k, p in module.named_parameters() if p is not before[k]]
        for old, _ in replaced:  # each rank cut its share: the whole tensor (still named by a traced program) is freed
            old.data = torch.empty(0, dtype=old.dtype, device=old.device)
        return replaced

    def _call_modules(self, stage: fx.GraphModule) -> None:
        """A torch.export stage calls no modules: each ``aten.linear`` on a planned Linear's weight becomes a call of
        the model's own Linear (put in the stage program under its name), which ``parallelize_module`` can split."""
        changed = False
        for node in list(stage.graph.nodes):
            name = planned_module(node)
            if node.op != "call_function" or name not in self.modules:
                continue
            module = self.model.get_submodule(name)
            weights = [a for a in node.args[1:] if isinstance(a, fx.Node)]
            if not isinstance(module, nn.Linear) or any(len(w.users) > 1 for w in weights) or \
                    len(weights) != 1 + (module.bias is not None):
                raise TensorParallelRefused(f"module {name}: the traced program reads its weights other than by one "
                                          "linear op, which tensor parallelism cannot split")
            parent, _, leaf = name.rpartition(".")
            setattr(stage.get_submodule(parent) if parent else stage, leaf, module)
            node.op, node.target, node.args, node.kwargs = "call_module", name, node.args[:1], {}
            for w in weights:
                stage.graph.erase_node(w)
            changed = True
        if changed:
            stage.recompile()

    @contextlib.contextmanager
    def hooks_off(self) -> Iterator[None]:
        """The split modules without their tensor-parallel hooks (deriving the program's global shapes)."""
        saved = [(m, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in self._applied.values()]
        for m, _, _ in saved:
            m._forward_pre_hooks.clear()
            m._forward_hooks.clear()
        try:
            yield
        finally:
            for m, pre, post in saved:
                m._forward_pre_hooks.update(pre)
                m._forward_hooks.update(post)
