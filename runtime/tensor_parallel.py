"""Tensor parallelism inside pipeline stages: torch DTensor's colwise/rowwise styles on each stage's modules by name,
and sequence parallelism between them (each stage program's gathers and scatters on the sequence, the partial gradients
of what ops on sequence shards read summed over the tp ranks)."""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from partitioner.plan import Plan
from partitioner.request import PlanRequest
from partitioner.tp_graph import (SEQUENCE_DIM, ModuleSplit, SplitActivations, TensorParallelError, planned_module,
                                  rewrite_stage, split_activations)
from partitioner.tensor_parallel import not_run_split
from partitioner.tp_plan import check_tp_plan, resolve_tp_plan
from runtime.comm import Comm
from runtime.errors import RuntimeConfigError
from runtime.precision import Precision
from runtime.program import Ownership, Program
from runtime.sharding import local
from runtime.split import OUTPUT_KEY, StageProgram, ValueMeta, propagate_meta

__all__ = ["TensorParallel", "TensorParallelRefused", "split_over_tp", "refuse_plan",
           "tp_plan_for", "settled", "insert_sequence_collectives", "SequenceGrads", "check_sequence_length"]


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
        if request.sequence_parallel is True:
            raise TensorParallelRefused("sequence_parallel=True splits the sequence between the modules tensor "
                                        "parallelism splits: pass tensor_parallel=T > 1 too, or drop it")
        return None
    plan = resolve_tp_plan(model, given)
    with _refused_at_setup():
        check_tp_plan(model, plan, tp_size)
    return plan


def settled(t: torch.Tensor) -> torch.Tensor:
    """A stage's output (or a sequence gather's or scatter's input) as a plain tensor: a rowwise module's output is
    DTensor's asynchronous all-reduce (or reduce-scatter) still in flight (a wrapper without storage), which a cut
    sends and the meter counts; its clone waits for it and stays on the autograd graph."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.clone() if isinstance(t, AsyncCollectiveTensor) else t


def split_over_tp(t: torch.Tensor) -> bool:
    """Whether ``t`` (a parameter or gradient) is split over the tp ranks: a DTensor sharded on its mesh's "tp"
    dimension, not replicated there (sharded over the replicas too, its "dp" placement is FSDP's)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and any(name == "tp" and not (p.is_replicate() or p.is_partial())
                                          for name, p in zip(t.device_mesh.mesh_dim_names or (), t.placements))


def _torch_style(style: Any, module: nn.Module, sequence: bool = False) -> Any:
    """The torch ParallelStyle of a style name (a torch style as given). ``sequence``: a rowwise module whose
    output is reduce-scattered on the sequence (``output_layouts=Shard(1)``; its backward all-gathers the
    gradient) instead of all-reduced."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(style, str):
        if sequence:
            style = copy.copy(style)
            style.output_layouts = (Shard(SEQUENCE_DIM),)
        return style
    name = style.strip().lower()
    if name.startswith("fused_colwise:"):
        return _fused_colwise(int(name.split(":", 1)[1]))
    output = Shard(SEQUENCE_DIM) if sequence else Replicate()
    embedding = isinstance(module, nn.Embedding)
    return {"colwise": lambda: ColwiseParallel(),
            "rowwise": lambda: RowwiseParallel(input_layouts=Replicate() if embedding else Shard(-1),
                                               output_layouts=output),
            "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
            "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=output)}[name]()


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
        #: what the plan runs (``Plan.sequence_parallel``), set before the stages are split
        self.sequence_parallel = False

    def styles(self) -> dict[str, ModuleSplit]:
        return {name: how for name, (_, how) in self.modules.items()}

    def activations(self, gm: fx.GraphModule, meta: Mapping[str, ValueMeta]) -> SplitActivations:
        """Which of ``gm``'s values are split (and its rewrites), from every value's global shape ``meta``."""
        with _refused_at_setup():
            return split_activations(gm, self.styles(), meta, self.size, self.sequence_parallel)

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
                style = _torch_style(self.modules[name][0], module, sequence=node.name in acts.rowwise_scatter)
                # every tp rank holds the whole weights: cut, not sent
                parallelize_module(module, self.mesh, style, src_data_rank=None)
                self._applied[id(module)] = module
                replaced += [(before[k], p) for k, p in module.named_parameters() if p is not before[k]]
            insert_sequence_collectives(sp.gm, acts, self.mesh)
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


class _SequenceGather(nn.Module):
    """A value split on the sequence, all-gathered (DTensor's redistribution Shard(1) -> Replicate): as a DTensor for
    colwise modules (their input gradients' partial sums add up, then one reduce-scatter: torchtitan's
    PrepareModuleInput with use_local_output=False), else as a plain tensor (the backward keeps this rank's chunk)."""

    def __init__(self, mesh: Any, colwise: bool) -> None:
        super().__init__()
        self.mesh = mesh
        self.colwise = colwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        whole = DTensor.from_local(settled(x), self.mesh, [Shard(SEQUENCE_DIM)], run_check=False).redistribute(
            self.mesh, [Replicate()])
        return whole if self.colwise else whole.to_local()


class _SequenceScatter(nn.Module):
    """A whole value's chunk of the sequence for this rank (Replicate -> Shard(1); the backward all-gathers)."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        return DTensor.from_local(settled(x), self.mesh, [Replicate()], run_check=False).redistribute(
            self.mesh, [Shard(SEQUENCE_DIM)]).to_local()


def insert_sequence_collectives(stage: fx.GraphModule, acts: SplitActivations, mesh: Any) -> None:
    """Sequence parallelism's gathers and scatters (``acts``, of the whole program) in a stage program, one per value
    and stage, before the first of their readers that runs here; a size read of a sequence shard's sequence dim
    scaled back to the whole sequence."""
    nodes = {n.name: n for n in stage.graph.nodes}
    ops = {name for name, n in nodes.items() if n.op not in ("placeholder", "get_attr")}  # (a value made on an
    # earlier stage is a placeholder of its name here)
    changed = False
    moves = [(g.value, g.readers, _SequenceGather(mesh, g.colwise), f"smp_sequence_gather_{g.value}"
              + ("_colwise" if g.colwise else "")) for g in acts.gathers]
    moves += [(c.value, c.readers, _SequenceScatter(mesh), f"smp_sequence_scatter_{c.value}") for c in acts.scatters]
    for value, readers, module, name in moves:
        here = [nodes[r] for r in readers if r in ops and (r != "output" or _model_output(nodes[r]) is not None)]
        if not here:
            continue
        first = min(here, key=lambda n: _position(stage, n))
        stage.add_submodule(name, module)
        with stage.graph.inserting_before(first):
            moved = stage.graph.call_module(name, (nodes[value],))
        for reader in here:
            if reader.op == "output":  # the model output only: the values sent to later stages stay shards
                result = dict(reader.args[0])
                result[OUTPUT_KEY] = fx.node.map_arg(result[OUTPUT_KEY],
                                                     lambda a, v=nodes[value], m=moved: m if a is v else a)
                reader.args = (result,)
            else:
                reader.replace_input_with(nodes[value], moved)
        changed = True
    for name in acts.sequence_sizes & ops:
        size = nodes[name]
        with stage.graph.inserting_after(size):
            whole = stage.graph.call_function(operator.mul, (size, acts.tp_size))
        size.replace_all_uses_with(whole, delete_user_cb=lambda user, w=whole: user is not w)
        changed = True
    if changed:
        stage.graph.lint()
        stage.recompile()


def _model_output(node: fx.Node) -> Any:
    """A stage's output node's model output (None on a stage without it)."""
    result = node.args[0] if node.op == "output" and node.args else None
    return result.get(OUTPUT_KEY) if isinstance(result, dict) else None


def _position(stage: fx.GraphModule, node: fx.Node) -> int:
    return next(i for i, n in enumerate(stage.graph.nodes) if n is node)


class SequenceGrads:
    """The gradients of the parameters ops on sequence shards read whole (a norm's weight): each tp rank's backward
    makes a partial sum over its chunk of the sequence, summed over the tp ranks after the step's backward, before
    clipping and the optimizer (Megatron-LM's all-reduce of sequence-parallel layernorm gradients). A gradient
    accumulated before the step is set aside meanwhile, so that only this step's partial sums are summed."""

    def __init__(self, names: Sequence[str], mesh: Any) -> None:
        self.names = sorted(names)
        self.group = mesh.get_group()

    @classmethod
    def of(cls, acts: SplitActivations | None, tp: TensorParallel | None) -> SequenceGrads | None:
        """The sums a tensor-parallel engine's step ends with (None without parameters that need them)."""
        return cls(sorted(acts.sequence_params), tp.mesh) if acts is not None and tp is not None and \
            acts.sequence_params else None

    def _params(self, ownership: Ownership) -> list[nn.Parameter]:
        """This rank's parameters of ``names`` (the same on every tp rank of its stages), each once."""
        seen: dict[int, nn.Parameter] = {}
        for name in self.names:
            p = ownership.model.get_parameter(name)
            if id(p) in ownership.local_ids and p.requires_grad and not p.is_meta:
                seen.setdefault(id(p), p)
        return list(seen.values())

    @contextlib.contextmanager
    def summed(self, ownership: Ownership, comm: Comm) -> Iterator[None]:
        """Around a training step's actions (and the data-parallel reduction that ends them)."""
        params = self._params(ownership)
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        yield
        grads = [local(p.grad) for p in params if p.grad is not None]  # sharded over "dp": each rank's shard
        if grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            comm.wait(comm.all_reduce(flat, self.group, "the sum of the sequence-parallel gradients over the tp "
                                                        "ranks"))
            for g, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(summed)
        for p, old in zip(params, before):
            if old is not None:
                p.grad = old + p.grad if p.grad is not None else old


def check_sequence_length(acts: SplitActivations | None, values: Mapping[str, ValueMeta]) -> None:
    """A microbatch of another shape than the traced one (an fx-traced program runs new shapes) must have a
    sequence length the tp ranks divide when sequence parallelism runs: each rank's shard is 1/T of it (DTensor's
    gathers, the cut buffers); refused before any collective, naming S and T. (None: no tensor parallelism.)"""
    for name in sorted(acts.rowwise_scatter if acts is not None else ()):
        leaves = values[name].leaves if name in values else ()
        shape = leaves[0].shape if leaves and leaves[0].is_tensor else None
        if shape is not None and len(shape) > SEQUENCE_DIM and shape[SEQUENCE_DIM] % acts.tp_size:
            raise RuntimeConfigError(
                f"this pipeline runs sequence parallelism over {acts.tp_size} tp ranks, which split the sequence, "
                f"and this microbatch's sequence is {shape[SEQUENCE_DIM]} long ({name}: {list(shape)}), which "
                f"{acts.tp_size} does not divide: pad the sequences to a multiple of {acts.tp_size}, or plan with "
                "sequence_parallel=False")
