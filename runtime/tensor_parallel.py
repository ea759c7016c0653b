"""Tensor parallelism inside pipeline stages: torch DTensor's colwise/rowwise styles on each stage's modules by name."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from partitioner.ir import ScheduleKind
from partitioner.plan import Plan
from partitioner.request import PlanRequest
from runtime.precision import Precision
from runtime.program import Program
from runtime.split import StageProgram, ValueMeta, propagate_meta
from runtime.tp_graph import (ModuleSplit, SplitActivations, TensorParallelError, planned_module, rewrite_stage,
                              split_activations)

__all__ = ["TP_STYLES", "TensorParallel", "TensorParallelError", "resolve_tp_plan", "check_tp_plan", "split_over_tp",
           "refuse_request", "refuse_plan", "tp_plan_for", "settled"]

#: The style names a tp plan takes (Hugging Face's words): colwise/rowwise pairs; "_rep": the output (colwise) or
#: the input (rowwise) whole; "fused_colwise:N": a Linear that is N projections side by side (a fused k/v).
TP_STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "fused_colwise:N")


def resolve_tp_plan(model: nn.Module, tp_plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """The tp plan (module-name pattern -> style) for ``model``: ``tp_plan`` when given, else a Hugging Face
    model's ``config.base_model_tp_plan`` (its names relative to the base model, put under its prefix), else the
    model's own ``tp_plan`` (smp's zoo models). A clear error when there is none."""
    if tp_plan is not None:
        if not isinstance(tp_plan, Mapping) or not tp_plan:
            raise TensorParallelError(f"tp_plan takes a dict of module-name patterns to styles, got {tp_plan!r}")
        return dict(tp_plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if base:
        prefix = getattr(model, "base_model_prefix", "")
        under = prefix and hasattr(model, prefix) and getattr(model, prefix) is not model
        return {f"{prefix}.{k}" if under else k: v for k, v in base.items()}
    own = getattr(model, "tp_plan", None)
    if isinstance(own, Mapping) and own:
        return dict(own)
    raise TensorParallelError(f"tensor_parallel needs a tp plan for {type(model).__name__}, which has none (no "
                              "config.base_model_tp_plan, no tp_plan): pass tp_plan={pattern: style} with styles "
                              f"{', '.join(TP_STYLES)} (e.g. {{'layers.*.attn.q': 'colwise', 'layers.*.attn.out': "
                              "'rowwise'}})")


def refuse_request(request: PlanRequest, tp_size: int) -> None:
    """Refuse what a planning request asks for that tensor parallelism does not run with yet."""
    for why, bad in ((f"sharding={request.sharding!r} (FSDP over the replicas)",
                      request.sharding not in ("auto", "none")),
                     ("compile=True", request.profiling.compile),
                     (f"the zero-bubble schedule {request.schedule!r}",
                      isinstance(request.schedule, str) and ScheduleKind.parse(request.schedule).split_backward),
                     (f"recompute={request.recompute!r}", request.recompute in ("selective", "offload"))):
        if bad:
            raise TensorParallelError(f"tensor_parallel={tp_size} does not run with {why} yet: drop it, or "
                                      "tensor_parallel")


def refuse_plan(plan: Plan) -> None:
    """Refuse what a made plan runs that tensor parallelism does not run with yet."""
    for why, bad in ((f"sharding {plan.sharding!r}", plan.sharding != "none"), ("compiled stages", plan.model.compiled),
                     (f"the zero-bubble schedule {plan.schedule_name!r}", plan.schedule.split_backward),
                     ("selective or offloaded recomputation",
                      any(c in ("selective", "offload") for c in plan.recompute))):
        if bad:
            raise TensorParallelError(f"the plan runs {why}, which tensor_parallel={plan.tensor_parallel} does not "
                                      "run with yet: re-plan without it (sharding='none', recompute='none' or "
                                      "'full', schedule gpipe, 1f1b or interleaved)")


def tp_plan_for(model: nn.Module, given: Mapping[str, Any] | None, request: PlanRequest,
                tp_size: int) -> dict[str, Any] | None:
    """The tp plan a pipeline of ``tensor_parallel=tp_size`` runs (None for 1), resolved and checked against the
    model and the request before any collective."""
    if tp_size == 1:
        if given is not None:
            raise TensorParallelError("tp_plan= goes with tensor_parallel=T > 1: pass tensor_parallel, or drop "
                                      "tp_plan")
        return None
    refuse_request(request, tp_size)
    plan = resolve_tp_plan(model, given)
    check_tp_plan(model, plan, tp_size)
    return plan


def settled(t: torch.Tensor) -> torch.Tensor:
    """A stage's output as a plain tensor: a rowwise module's output is DTensor's asynchronous all-reduce still
    in flight (a wrapper without storage), which a cut sends and the meter counts; its clone waits for it and
    stays on the autograd graph."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.clone() if isinstance(t, AsyncCollectiveTensor) else t


def split_over_tp(t: torch.Tensor) -> bool:
    """Whether ``t`` (a parameter or gradient) is split over the tp ranks: a DTensor sharded there, not replicated."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and any(not (p.is_replicate() or p.is_partial()) for p in t.placements)


def _matches(pattern: str, name: str) -> bool:
    """A plan pattern matches a module's qualified name atom by atom ("*" one atom, as torch's parallelize_module)."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))


def _split_of(style: Any, module: nn.Module, where: str) -> ModuleSplit:
    """What ``style`` (a name of TP_STYLES or a torch ParallelStyle) does to the module's activations."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, str):
        name = style.strip().lower()
        if name.startswith("fused_colwise:"):
            try:
                n = int(name.split(":", 1)[1])
            except ValueError:
                n = 0
            if n < 1 or embedding:
                raise TensorParallelError(f"{where}: style {style!r} takes a Linear and a count of projections "
                                          "(fused_colwise:2 for a fused k/v)")
            return ModuleSplit(False, True, n)
        known = {"colwise": ModuleSplit(False, True), "rowwise": ModuleSplit(not embedding, False),
                 "colwise_rep": ModuleSplit(False, False), "rowwise_rep": ModuleSplit(False, False)}
        if name not in known:
            raise TensorParallelError(f"{where}: unknown style {style!r}; use one of {', '.join(TP_STYLES)} or a "
                                      "torch ColwiseParallel/RowwiseParallel")
        return known[name]
    if getattr(style, "use_local_output", True) is False:
        raise TensorParallelError(f"{where}: use_local_output=False (DTensor activations) is not supported; the "
                                  "stage programs run on local shards")
    if isinstance(style, ColwiseParallel):
        return ModuleSplit(False, not isinstance(style.output_layouts[0], Replicate))
    if isinstance(style, RowwiseParallel):
        return ModuleSplit(not embedding and not isinstance(style.input_layouts[0], Replicate), False)
    raise TensorParallelError(f"{where}: style {type(style).__name__} is not supported; use ColwiseParallel, "
                              f"RowwiseParallel or a name of {', '.join(TP_STYLES)}")


def check_tp_plan(model: nn.Module, plan: Mapping[str, Any], tp_size: int) -> dict[str, tuple[Any, ModuleSplit]]:
    """Every module of ``model`` the plan names (qualified name -> (style, how it splits)), checked before any
    collective: a pattern that names no module, a module that is no Linear or Embedding, or a feature count
    ``tp_size`` does not divide is a clear error naming both."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    modules = dict(model.named_modules())
    chosen: dict[str, tuple[Any, ModuleSplit]] = {}
    for pattern, style in plan.items():
        names = [n for n in modules if n and _matches(pattern, n)]
        if not names:
            raise TensorParallelError(f"tp_plan names {pattern!r}, which matches no module of "
                                      f"{type(model).__name__} (its modules are named like "
                                      f"{', '.join(list(modules)[1:4])}, ...)")
        for name in names:
            module = modules[name]
            where = f"tp_plan's {pattern!r} on module {name}"
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise TensorParallelError(f"{where}: a {type(module).__name__}; tensor parallelism splits "
                                          "nn.Linear and nn.Embedding modules")
            how = _split_of(style, module, where)
            colwise = how.makes_split or (isinstance(style, str) and style.strip().lower() == "colwise_rep") or \
                isinstance(style, ColwiseParallel)
            if isinstance(module, nn.Linear):
                count, what = (module.out_features, "output features") if colwise else \
                    (module.in_features, "input features")
            else:
                count, what = (module.embedding_dim, "embedding dims") if colwise else \
                    (module.num_embeddings, "embeddings")
            if count % (tp_size * how.parts):
                each = f" ({how.parts} projections of {count // how.parts})" if how.parts > 1 else ""
                raise TensorParallelError(f"module {name} has {count} {what}{each}, which tensor_parallel={tp_size} "
                                          "does not divide")
            chosen[name] = (style, how)
    _check_heads(modules, chosen, tp_size)
    _refuse_split_ties(model, chosen)
    return chosen


def _refuse_split_ties(model: nn.Module, chosen: Mapping[str, Any]) -> None:
    """A parameter the plan splits must belong to that module alone: a tied one (an LM head sharing the
    embedding's weight) would be split two ways, or split in one place and whole in the other."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for names in owners.values():
        split = [n for n in names if n.rpartition(".")[0] in chosen]
        if split and len(names) > 1:
            others = ", ".join(n for n in names if n != split[0])
            raise TensorParallelError(f"parameter {split[0]} is tied to {others}: tensor parallelism does not "
                                      "split a tied weight; keep its modules out of tp_plan")


def _check_heads(modules: Mapping[str, nn.Module], chosen: Mapping[str, Any], tp_size: int) -> None:
    """An attention module whose projections are split (a parent with a ``head_dim``: the zoo's, Hugging Face's)
    must have head counts ``tp_size`` divides; its own or its config's (grouped key/value heads too)."""
    for parent in sorted({name.rpartition(".")[0] for name in chosen}):
        module = modules.get(parent)
        if module is None or not hasattr(module, "head_dim"):
            continue
        config = getattr(module, "config", None)
        counts = {"heads": getattr(module, "heads", None), "num_heads": getattr(module, "num_heads", None),
                  "num_attention_heads": getattr(config, "num_attention_heads", None),
                  "num_key_value_heads": getattr(config, "num_key_value_heads", None)}
        for what, n in counts.items():
            if isinstance(n, int) and not isinstance(n, bool) and n % tp_size:
                raise TensorParallelError(f"attention module {parent} has {n} {what.replace('_', ' ')}, which "
                                          f"tensor_parallel={tp_size} does not divide")


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
    (runtime/tp_graph.py), rewrites their head counts to this rank's share, and applies
    ``parallelize_module`` to the stage modules the plan names (each rank cuts its share of the whole
    weights it holds: no communication). The parameters become DTensors (``replaced`` pairs each
    old one with its new one, for the ownership's ids).
    """

    def __init__(self, model: nn.Module, plan: Mapping[str, Any], mesh: Any, tp_size: int) -> None:
        self.model = model
        self.mesh = mesh
        self.size = tp_size
        self.modules = check_tp_plan(model, plan, tp_size)
        self._applied: dict[int, nn.Module] = {}

    def styles(self) -> dict[str, ModuleSplit]:
        return {name: how for name, (_, how) in self.modules.items()}

    def activations(self, gm: fx.GraphModule, meta: Mapping[str, ValueMeta]) -> SplitActivations:
        """Which of ``gm``'s values are split (and its rewrites), from every value's global shape ``meta``."""
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
                raise TensorParallelError(f"module {name}: the traced program reads its weights other than by one "
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
