"""Which activations of a traced program tensor parallelism splits (on features, or with sequence parallelism on the
sequence); its head counts rewritten to each rank's share."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch import nn

from partitioner.errors import PlanError

__all__ = ["TensorParallelError", "SequenceParallelError", "ModuleSplit", "Gather", "Scatter", "SplitActivations",
           "split_activations", "rewrite_stage", "planned_module", "SEQUENCE_DIM"]


class ShapedLeaf(Protocol):
    """One leaf of a value: a tensor's shape (None for a constant)."""

    shape: tuple[int, ...] | None

    @property
    def is_tensor(self) -> bool: ...


class ShapedValue(Protocol):
    """A traced value's leaves with their global shapes (runtime.split.ValueMeta; the planner's own)."""

    leaves: Sequence[ShapedLeaf]


class TensorParallelError(PlanError):
    """The tensor-parallel plan cannot run on this model: the message names the module or op and the count."""


class SequenceParallelError(TensorParallelError):
    """Sequence parallelism cannot run on this program (the sequence length, an op): tensor parallelism without it
    can ("auto" then plans it off)."""


#: The dim sequence parallelism splits: a rowwise output [batch, sequence, features] (torchtitan's Shard(1)).
SEQUENCE_DIM = 1


@dataclass(frozen=True)
class Gather:
    """A sequence-split ``value`` all-gathered on the sequence for ``readers`` (fx node names; "output": the model
    output). ``colwise``: the readers are the plan's colwise modules, handed the gathered value as one DTensor (their
    input gradients' partial sums add up, then one reduce-scatter); else the readers run on the whole value on every
    tp rank (the backward keeps this rank's chunk of its gradient)."""

    value: str
    readers: tuple[str, ...]
    colwise: bool


@dataclass(frozen=True)
class Scatter:
    """A whole ``value`` (with the full sequence) cut to this rank's chunk of the sequence for ``readers``, ops on
    sequence shards (the backward all-gathers its gradient)."""

    value: str
    readers: tuple[str, ...]


@dataclass(frozen=True)
class ModuleSplit:
    """How a tensor-parallel style treats a module's activations: ``reads_split`` (its input must be split on
    its last dim: rowwise) or whole; ``makes_split`` (its output is split on its last dim: colwise) or whole;
    ``parts``: the output is that many projections side by side, each split alike (a fused k/v Linear);
    ``rowwise``: the weight is split along its input features (its output is each rank's partial sum, all-reduced;
    a bias stays whole), else along its output features (colwise: the input's gradient is the partial sum)."""

    reads_split: bool
    makes_split: bool
    parts: int = 1
    rowwise: bool = False


#: Modules that act on each element alone (so on a shard as on the whole).
_ELEMENTWISE_MODULES = (nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)
#: Functions and methods that act element by element (broadcasting): a split input gives an output split alike.
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "gelu", "relu", "silu", "tanh", "sigmoid", "exp", "rsqrt",
    "sqrt", "cos", "sin", "dropout", "contiguous", "float", "half", "bfloat16", "to", "type_as", "clone",
    "masked_fill", "add_", "mul_", "iadd", "imul", "alias",
})
_VIEWS = frozenset({"view", "reshape", "_unsafe_view"})
_TRANSPOSES = frozenset({"transpose", "permute"})
_CHUNKS = frozenset({"chunk", "split"})
_ATTENTION = frozenset({"scaled_dot_product_attention"})
_MATMULS = frozenset({"matmul", "bmm"})
_SOFTMAX = frozenset({"softmax", "log_softmax"})
_SIZES = frozenset({"size", "dim"})
_SLICES = frozenset({"slice", "narrow"})


@dataclass
class SplitActivations:
    """Per fx value of a traced program: the dim its tensor is split on over the tp ranks (None: whole; a tuple
    value: one entry per leaf), and each view's shape arguments rewritten to this rank's share (by node name).

    With sequence parallelism (empty without): ``sequence``, the values split on the sequence (``split`` says dim 1
    for them too), not on features; ``rowwise_scatter``, the rowwise module ops whose output is reduce-scattered
    on the sequence instead of all-reduced; ``gathers`` and ``scatters``, where the sequence shards end and begin;
    ``sequence_params``, the parameters (qualified names) that ops on sequence shards read whole, whose gradients
    are each rank's partial sums (all-reduced over the tp ranks after the backward); ``sequence_sizes``, the size
    reads of a sequence-split value's sequence dim (``x.size(1)``: the shard's, scaled back to the whole).
    """

    tp_size: int
    split: dict[str, Any] = field(default_factory=dict)
    rewrites: dict[str, tuple[int, int]] = field(default_factory=dict)  # view -> (which size, its local value)
    sequence: set[str] = field(default_factory=set)
    rowwise_scatter: set[str] = field(default_factory=set)
    gathers: list[Gather] = field(default_factory=list)
    scatters: list[Scatter] = field(default_factory=list)
    sequence_params: set[str] = field(default_factory=set)
    sequence_sizes: set[str] = field(default_factory=set)

    @property
    def sequence_parallel(self) -> bool:
        """Whether any rowwise output is split on the sequence (sequence parallelism runs)."""
        return bool(self.rowwise_scatter)

    def local_shape(self, value: str, leaf: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one tensor leaf of ``value`` on a tp rank (what a cut sends): the split dim's share."""
        dim = self.split.get(value)
        if isinstance(dim, tuple):
            dim = dim[leaf] if leaf < len(dim) else None
        if dim is None:
            return shape
        return tuple(n // self.tp_size if i == dim else n for i, n in enumerate(shape))


def _op_name(node: fx.Node) -> str:
    """The op's short name: a method's, a function's (``torch.add`` -> add), an aten overload's (aten.view.default
    -> view)."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def planned_module(node: fx.Node) -> str | None:
    """The module a node runs, by qualified name: a call_module's target, or the Linear whose weight a torch.export
    ``aten.linear`` reads (export graphs call no modules: ``linear(x, get_attr <module>.weight[, <module>.bias])``)."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_function" and _op_name(node) == "linear" and len(node.args) > 1:
        weight = node.args[1]
        if isinstance(weight, fx.Node) and weight.op == "get_attr" and str(weight.target).endswith(".weight"):
            return str(weight.target)[: -len(".weight")]
    return None


def _shape(meta: Mapping[str, ShapedValue], node: Any) -> tuple[int, ...] | None:
    """The global shape of a single-tensor value (None for anything else)."""
    if not isinstance(node, fx.Node) or node.name not in meta:
        return None
    leaves = meta[node.name].leaves
    return leaves[0].shape if len(leaves) == 1 and leaves[0].is_tensor else None


def _where(node: fx.Node) -> str:
    """The op and the module it runs in, for messages."""
    module = node.meta.get("smp_module")  # the module path the tracer recorded
    return f"op {node.name}" + (f" (in module {module})" if module else "")


def split_activations(gm: fx.GraphModule, styles: Mapping[str, ModuleSplit], meta: Mapping[str, ShapedValue],
                      tp_size: int, sequence_parallel: bool = False) -> SplitActivations:
    """Follow the split activations of ``gm`` (the whole traced program, every stage) from the modules of
    ``styles`` (by qualified name), with every value's global shape in ``meta``; the view and expand shapes
    that name a split dim's size as a constant (a head count fx baked in) are rewritten to its share.

    ``sequence_parallel``: each rowwise output [batch, sequence, features] is reduce-scattered on the sequence
    instead of all-reduced, and the ops after it that act on each position alone (elementwise ops, norms over the
    features) run on the sequence shards, up to the next colwise modules (one all-gather for all of them) or any
    other reader (an all-gather to the whole value) (:class:`_SequenceFlow`). Refused with
    :class:`SequenceParallelError` when it cannot run (a sequence length ``tp_size`` does not divide).

    Refuses, naming the op or module and the count, what would compute wrongly on shards: a head count or
    feature count ``tp_size`` does not divide, a rowwise module reading a whole tensor, an op smp does not know
    reading a split tensor, the model's output split.
    """
    acts = SplitActivations(tp_size)
    split = acts.split
    flow = _SequenceFlow(gm, meta, acts) if sequence_parallel else None
    parts: dict[str, int] = {}  # values that are a fused module's output (or its chunks' source)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if flow is not None:
                flow.note_attribute(node)
            continue
        if node.op == "placeholder":
            continue
        if flow is not None and flow.reads_sequence(node):
            if node.op != "output" and planned_module(node) not in styles and flow.follow(node):
                continue  # runs on the sequence shards
            flow.gather_for(node, styles.get(planned_module(node) or ""))  # the whole value (or a colwise DTensor)
        if flow is not None:
            flow.note_whole(node)
        if node.op == "output":
            bad = [a.name for a in node.all_input_nodes if split.get(a.name) is not None and a.name not in acts.sequence]
            if bad:
                raise TensorParallelError(f"the model's output {bad[0]} is split over the tp ranks: end the "
                                          "tensor-parallel region before the output (a rowwise module, or "
                                          "'colwise_rep' for the last projection)")
            continue
        ins = [a for a in node.all_input_nodes if split.get(a.name) is not None and a.name not in acts.sequence]
        module = planned_module(node)
        if module in styles:
            style = styles[module]
            x = node.args[0] if node.args else None
            dim = split.get(x.name) if isinstance(x, fx.Node) and x.name not in acts.sequence else None
            shape = _shape(meta, x)
            if style.reads_split and (dim is None or shape is None or dim != len(shape) - 1):
                raise TensorParallelError(
                    f"module {module} is rowwise and reads {getattr(x, 'name', x)}, which is not split on its "
                    "last dim: a rowwise module follows a colwise one (or use 'rowwise_rep' for a whole input)")
            if not style.reads_split and dim is not None:
                raise TensorParallelError(f"module {module} reads {x.name}, split over the tp ranks, but its "
                                          "style takes a whole input: make it rowwise")
            out = _shape(meta, node)
            if style.makes_split and out is not None:
                split[node.name] = len(out) - 1
                if style.parts > 1:
                    parts[node.name] = style.parts
            if style.rowwise and flow is not None:
                flow.rowwise_output(node, module)
            continue
        if not ins:
            continue
        _follow(node, ins, gm, meta, acts, parts)
    if flow is not None:
        flow.finish()
    return acts


#: Reductions that keep the sequence dim when they reduce only dims after it (RMSNorm's mean over the features).
_REDUCTIONS = frozenset({"mean", "sum", "var", "std", "amax", "amin"})
#: Norms over the last dim, as functions (their weight and bias are read whole).
_NORMS = frozenset({"layer_norm", "rms_norm"})
#: Norm modules over the last dim (and any module class named ...RMSNorm with a 1-D weight: Hugging Face's).
_NORM_MODULES = (nn.LayerNorm, nn.RMSNorm)


def _drops(node: fx.Node) -> bool:
    """Whether a dropout function draws a mask (each tp rank would draw the same one for its chunk of the
    sequence): its probability is not 0 (or not known) and it is not told it is not training."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", node.kwargs.get("train", True))
    return training is not False and not (isinstance(p, (int, float)) and p == 0)


class _SequenceFlow:
    """Sequence parallelism's part of :func:`split_activations`: which values are split on the sequence, where they
    are gathered and scattered, which parameters their ops read whole (the fields of ``acts`` it fills)."""

    def __init__(self, gm: fx.GraphModule, meta: Mapping[str, ShapedValue], acts: SplitActivations) -> None:
        self.gm = gm
        self.meta = meta
        self.acts = acts
        self.gathers: dict[tuple[str, bool], list[str]] = {}  # (value, colwise) -> readers
        self.scatters: dict[str, list[str]] = {}
        self.grads: set[str] = set()  # values that get a gradient (from a parameter, through any op)
        self.params: dict[str, str] = {}  # get_attr node -> the parameter it reads
        self.whole_reads: dict[str, list[str]] = {}  # parameter -> ops reading it other than on sequence shards
        self.shard_reads: set[str] = set()  # parameters read by ops on sequence shards

    # ------------------------------------------------------------------ what a node reads

    def note_attribute(self, node: fx.Node) -> None:
        """A get_attr: a parameter's gets a gradient."""
        try:
            param = self.gm.get_parameter(str(node.target))
        except AttributeError:
            return
        if param.requires_grad:
            self.params[node.name] = str(node.target)
            self.grads.add(node.name)

    def reads_sequence(self, node: fx.Node) -> bool:
        return any(a.name in self.acts.sequence for a in node.all_input_nodes)

    def note_whole(self, node: fx.Node) -> None:
        """``node`` runs on whole values: what gets a gradient through it, and the parameters it reads whole."""
        if any(a.name in self.grads for a in node.all_input_nodes):
            self.grads.add(node.name)
        for a in node.all_input_nodes:
            if a.name in self.params:
                self.whole_reads.setdefault(self.params[a.name], []).append(node.name)
        if node.op == "call_module":
            module = self.gm.get_submodule(str(node.target))
            for name, p in module.named_parameters():
                if p.requires_grad:
                    self.grads.add(node.name)
                    self.whole_reads.setdefault(f"{node.target}.{name}", []).append(node.name)

    def _shape(self, node: Any) -> tuple[int, ...] | None:
        """A value's global shape; a get_attr's, the attribute's own (the runtime's shapes leave them out)."""
        if isinstance(node, fx.Node) and node.op == "get_attr":
            attribute = functools.reduce(getattr, str(node.target).split("."), self.gm)
            return tuple(attribute.shape) if isinstance(attribute, torch.Tensor) else None
        return _shape(self.meta, node)

    # ------------------------------------------------------------------ the flow

    def rowwise_output(self, node: fx.Node, module: str) -> None:
        """A rowwise module's output [batch, sequence, features] is reduce-scattered on the sequence."""
        out = self._shape(node)
        if out is None or len(out) != 3:
            return
        t = self.acts.tp_size
        if out[SEQUENCE_DIM] % t:
            raise SequenceParallelError(
                f"sequence parallelism splits the sequence (dim {SEQUENCE_DIM} of module {module}'s output "
                f"{list(out)}, S = {out[SEQUENCE_DIM]}) over tensor_parallel={t} ranks, which does not divide it: "
                f"use a sequence length divisible by {t}, or sequence_parallel=False")
        self.acts.split[node.name] = SEQUENCE_DIM
        self.acts.sequence.add(node.name)
        self.acts.rowwise_scatter.add(node.name)

    def follow(self, node: fx.Node) -> bool:
        """Whether ``node`` (no planned module) runs on the sequence shards it reads; if so its output is split on
        the sequence (or it is a size read), the whole operands with the sequence are scattered for it, and the
        parameters it reads whole noted."""
        name = _op_name(node)
        if name == "dim":
            return True
        if name == "size":
            at = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            src = self._shape(node.args[0])
            if at is None or src is None:
                return False  # the whole torch.Size: read off the whole value
            if int(at) % len(src) == SEQUENCE_DIM:
                self.acts.sequence_sizes.add(node.name)
            return True
        out = self._shape(node)
        if out is None or len(out) <= SEQUENCE_DIM:
            return False
        if any(self.acts.split.get(a.name) is not None and a.name not in self.acts.sequence
               for a in node.all_input_nodes):
            raise SequenceParallelError(f"{_where(node)} ({name}) combines a value split on the sequence with one "
                                        "split on features")
        if node.op == "call_module":
            module = self.gm.get_submodule(str(node.target))
            if isinstance(module, _ELEMENTWISE_MODULES) and not getattr(module, "p", 0):  # (a Dropout drawing masks
                # would draw the same one on each rank for its chunk: it runs whole)
                return self._runs_on_shards(node, out, [])
            if self._is_norm_module(module):
                return self._runs_on_shards(node, out, [], params=[
                    f"{node.target}.{n}" for n, p in module.named_parameters() if p.requires_grad])
            return False  # a module smp does not know: on the whole value
        if name in _ELEMENTWISE and not (name == "dropout" and _drops(node)):
            return self._runs_on_shards(node, out, node.all_input_nodes)
        x = node.args[0] if node.args else None
        if not isinstance(x, fx.Node) or x.name not in self.acts.sequence:
            return False
        if name in _REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            dims = [dims] if isinstance(dims, int) else list(dims or [])
            ndim = len(self._shape(x) or ())
            if dims and all(int(d) % ndim > SEQUENCE_DIM for d in dims):
                return self._runs_on_shards(node, out, [x])
            return False
        if name in _NORMS:
            normalized = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
            if normalized is None or len(normalized) != 1:
                return False
            return self._runs_on_shards(node, out, node.all_input_nodes)
        return False

    @staticmethod
    def _is_norm_module(module: nn.Module) -> bool:
        """A norm over the last dim: LayerNorm or RMSNorm of one dim, or a module class named ...RMSNorm whose
        weight is 1-D (Hugging Face's LlamaRMSNorm and its kin)."""
        if isinstance(module, _NORM_MODULES):
            return len(module.normalized_shape) == 1
        weight = getattr(module, "weight", None)
        return type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1

    def _runs_on_shards(self, node: fx.Node, out: tuple[int, ...], operands: Sequence[fx.Node],
                        params: Sequence[str] = ()) -> bool:
        """``node`` on its sequence-split inputs and whole ``operands``: each whole operand either broadcasts along
        the sequence (a norm weight [H]: a parameter, or nothing that gets a gradient, whose gradient would be
        each rank's partial sum) or has the whole sequence in the same place (then its chunk is scattered)."""
        scatter, read = [], list(params)
        for a in operands:
            shape = self._shape(a)
            if shape is None:
                continue
            if a.name in self.acts.sequence:
                if len(shape) != len(out):
                    return False
                continue
            at = SEQUENCE_DIM - (len(out) - len(shape))
            if 0 <= at < len(shape) and shape[at] != 1:
                if len(shape) != len(out) or shape[at] != out[SEQUENCE_DIM]:
                    return False
                scatter.append(a.name)
            elif a.name in self.params:
                read.append(self.params[a.name])
            elif a.name in self.grads:
                return False  # a computed whole operand's gradient would be partial: the op runs whole
        for value in scatter:
            self.scatters.setdefault(value, []).append(node.name)
        self.shard_reads.update(read)
        if any(a.name in self.grads for a in node.all_input_nodes) or read:
            self.grads.add(node.name)
        self.acts.split[node.name] = SEQUENCE_DIM
        self.acts.sequence.add(node.name)
        return True

    def gather_for(self, node: fx.Node, style: ModuleSplit | None) -> None:
        """``node`` reads its sequence-split inputs whole: gathered for it (one gather for every colwise reader of
        a value)."""
        colwise = style is not None and not style.rowwise
        for a in node.all_input_nodes:
            if a.name in self.acts.sequence:
                self.gathers.setdefault((a.name, colwise), []).append(node.name)

    def finish(self) -> None:
        """The gathers and scatters in program order; the parameters ops on sequence shards read, each of which
        must be read by none other (its gradient would be a whole one plus partial ones)."""
        acts = self.acts
        if not acts.rowwise_scatter:
            raise SequenceParallelError("sequence parallelism splits rowwise outputs [batch, sequence, features] on "
                                        "the sequence, and no rowwise module of the tp plan makes one")
        both = sorted(p for p in self.shard_reads if p in self.whole_reads)
        if both:
            raise SequenceParallelError(f"parameter {both[0]} is read by ops on sequence shards and by "
                                        f"{self.whole_reads[both[0]][0]} on whole values: its gradient cannot be "
                                        "summed over the tp ranks")
        acts.gathers = [Gather(v, tuple(r), colwise) for (v, colwise), r in self.gathers.items()]
        acts.scatters = [Scatter(v, tuple(r)) for v, r in self.scatters.items()]
        acts.sequence_params = set(self.shard_reads)


def _follow(node: fx.Node, ins: Sequence[fx.Node], gm: fx.GraphModule, meta: Mapping[str, ShapedValue],
            acts: SplitActivations, parts: dict[str, int]) -> None:
    """The split of ``node``'s value from its split inputs ``ins`` (and a rewrite of its shape arguments)."""
    split = acts.split
    name = _op_name(node)
    src = ins[0]
    dim = split[src.name]
    out = _shape(meta, node)
    if node.op == "call_module":
        if isinstance(gm.get_submodule(str(node.target)), _ELEMENTWISE_MODULES):
            split[node.name] = dim
            return
        raise TensorParallelError(f"module {node.target} reads {src.name}, split over the tp ranks, and is no "
                                  "tensor-parallel module of the plan: add it to tp_plan, or end the split region "
                                  "before it (a rowwise module)")
    if node.target is operator.getitem and isinstance(dim, tuple):
        index = node.args[1]
        split[node.name] = dim[index] if isinstance(index, int) else None
        return
    if name in _SIZES:
        return  # a shape read on a shard is the shard's: a view built from it is local already
    if isinstance(dim, tuple):
        raise TensorParallelError(f"{_where(node)} ({name}) reads the tuple {src.name}, split over the tp ranks: "
                                  "smp follows only a getitem out of it")
    in_shape = _shape(meta, src)
    if in_shape is None or (out is None and name not in _CHUNKS):
        raise TensorParallelError(f"{_where(node)} ({name}) reads {src.name}, split over the tp ranks, and smp "
                                  "cannot follow its shapes")
    if name in _VIEWS or name == "expand":
        split[node.name] = _view(node, src, dim, in_shape, out, acts)  # type: ignore[arg-type]
        if src.name in parts:
            parts[node.name] = parts[src.name]
    elif name == "unsqueeze":
        at = _dim_arg(node, 1, "dim", 0) % (len(in_shape) + 1)
        split[node.name] = dim + 1 if at <= dim else dim
    elif name in _SLICES:
        if _dim_arg(node, 1, "dim", 0) % len(in_shape) == dim:
            raise TensorParallelError(f"{_where(node)} slices {src.name} along the dim split over the tp ranks")
        split[node.name] = dim
    elif name == "cat":
        tensors = node.args[0] if node.args else node.kwargs["tensors"]
        if any(split.get(t.name) != dim for t in tensors if isinstance(t, fx.Node)) or \
                _dim_arg(node, 1, "dim", 0) % len(in_shape) == dim:
            raise TensorParallelError(f"{_where(node)} joins tensors along, or not all split on, the dim split over "
                                      "the tp ranks")
        split[node.name] = dim
    elif name in _TRANSPOSES:
        split[node.name] = _transposed(node, dim, len(in_shape))
        if src.name in parts:
            parts[node.name] = parts[src.name]
    elif name in _CHUNKS:
        chunk_dim = _dim_arg(node, 2, "dim", 0) % len(in_shape)
        if chunk_dim == dim and parts.get(src.name, 1) == 1:
            raise TensorParallelError(
                f"{_where(node)} cuts {src.name} along the dim tensor parallelism splits: it is several projections "
                "side by side (a fused q/k/v or k/v Linear); give that module the style 'fused_colwise:N' (N the "
                "projections) so each rank holds its share of each")
        leaves = meta[node.name].leaves
        pieces = sum(leaf.is_tensor for leaf in leaves)
        if chunk_dim == dim and pieces != parts[src.name]:  # a strided shard holds a share of each of its parts
            raise TensorParallelError(
                f"{_where(node)} cuts {src.name} into {pieces} along the dim tensor parallelism splits, but its "
                f"module's style 'fused_colwise:{parts[src.name]}' makes {parts[src.name]} projections: give that "
                f"module 'fused_colwise:{pieces}'")
        split[node.name] = tuple(dim if leaf.is_tensor else None for leaf in leaves)
    elif name in _ATTENTION:
        others = [a for a in node.args[:3] if isinstance(a, fx.Node)]
        if any(split.get(a.name) != 1 for a in others) or dim != 1:
            raise TensorParallelError(f"{_where(node)}: attention's query, key and value must all be split on "
                                      "the heads (dim 1) by colwise projections")
        split[node.name] = 1
    elif name in _MATMULS:
        dims = {split.get(a.name) for a in node.all_input_nodes if isinstance(a, fx.Node)}
        if len(dims) != 1 or dim >= len(in_shape) - 2:
            raise TensorParallelError(f"{_where(node)} multiplies tensors split over the tp ranks other than "
                                      "along a batch dim (the heads): end the split region before it")
        split[node.name] = dim
    elif name in _SOFTMAX:
        if _dim_arg(node, 1, "dim", -1) % len(in_shape) == dim:
            raise TensorParallelError(f"{_where(node)} normalizes along the dim split over the tp ranks")
        split[node.name] = dim
    elif name in _ELEMENTWISE:
        split[node.name] = _broadcast(node, out, meta, split)  # type: ignore[arg-type]
    else:
        raise TensorParallelError(f"{_where(node)} ({name}) reads {src.name}, split over the tp ranks, and smp does "
                                  "not know how it runs on shards: end the split region before it (a rowwise "
                                  "module), or keep its modules out of tp_plan")


def _dim_arg(node: fx.Node, position: int, keyword: str, default: int) -> int:
    value = node.args[position] if len(node.args) > position else node.kwargs.get(keyword, default)
    return int(value)


def _transposed(node: fx.Node, dim: int, ndim: int) -> int:
    if _op_name(node) == "permute":
        order = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return [int(d) % ndim for d in order].index(dim)
    a, b = (int(d) % ndim for d in node.args[1:3])
    return b if dim == a else a if dim == b else dim


def _broadcast(node: fx.Node, out: tuple[int, ...], meta: Mapping[str, ShapedValue], split: Mapping[str, Any]) -> int:
    """An elementwise op's output split: its split inputs must agree (aligned from the right), and its whole
    tensor inputs must broadcast along that dim (size 1 there)."""
    dims = set()
    for a in node.all_input_nodes:
        shape = _shape(meta, a)
        if shape is None:
            continue
        d = split.get(a.name)
        if d is not None:
            dims.add(len(out) - len(shape) + d)
    if len(dims) != 1:
        raise TensorParallelError(f"{_where(node)} combines tensors split along different dims")
    dim = dims.pop()
    for a in node.all_input_nodes:
        shape = _shape(meta, a)
        if shape is None or split.get(a.name) is not None:
            continue
        aligned = dim - (len(out) - len(shape))
        if 0 <= aligned < len(shape) and shape[aligned] != 1:
            raise TensorParallelError(f"{_where(node)} combines {a.name}, whole, with a tensor split over the tp "
                                      f"ranks along its dim of {shape[aligned]}: make {a.name} split alike or end "
                                      "the split region before this op")
    return dim


def _view(node: fx.Node, src: fx.Node, dim: int, in_shape: tuple[int, ...], out: tuple[int, ...],
          acts: SplitActivations) -> int:
    """The output dim of a view (or expand) that carries the input's split dim, and its shape arguments with that
    dim's size as a constant (a head count, heads x head size) divided by the tp ranks (recorded in ``acts``)."""
    tp = acts.tp_size
    if _op_name(node) == "expand":
        j = dim + len(out) - len(in_shape)
    else:
        before = math.prod(in_shape[:dim])
        # the split dim stays the outermost of what it becomes: the output dims before it hold as many elements
        candidates = [j for j in range(len(out)) if math.prod(out[:j]) == before and out[j] != 1]
        if not candidates:
            raise TensorParallelError(f"{_where(node)} views {src.name} (split over the tp ranks on dim {dim} of "
                                      f"{list(in_shape)}) as {list(out)}, which mixes the split dim with others")
        j = candidates[0]
    if out[j] % tp:
        raise TensorParallelError(f"{_where(node)} views {src.name} with {out[j]} (heads, or features) on the dim "
                                  f"tensor parallelism splits, which tensor_parallel={tp} does not divide")
    sizes = _sizes(node)
    if j < len(sizes) and isinstance(sizes[j], int) and sizes[j] == out[j]:
        acts.rewrites[node.name] = (j, out[j] // tp)
    return j


def _sizes(node: fx.Node) -> list[Any]:
    """A view's or expand's shape arguments: ``x.view(a, b)``, ``x.view((a, b))``, ``torch.reshape(x, shape=...)``."""
    if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
        return list(node.args[1])
    for key in ("size", "shape"):
        if key in node.kwargs:
            return list(node.kwargs[key])
    return list(node.args[1:])


def _set_sizes(node: fx.Node, sizes: list[Any]) -> None:
    if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
        node.args = (node.args[0], type(node.args[1])(sizes))
        return
    for key in ("size", "shape"):
        if key in node.kwargs:
            node.kwargs = {**node.kwargs, key: type(node.kwargs[key])(sizes)}
            return
    node.args = (node.args[0], *sizes)


def rewrite_stage(stage: fx.GraphModule, acts: SplitActivations) -> None:
    """Give a stage program's views (copied from the traced program, same node names) their local shapes."""
    changed = False
    for node in stage.graph.nodes:
        new = acts.rewrites.get(node.name) if node.op in ("call_method", "call_function") else None
        if new is not None:  # (a placeholder of that name is the view's value, made on an earlier stage)
            sizes = _sizes(node)
            sizes[new[0]] = new[1]
            _set_sizes(node, sizes)
            changed = True
    if changed:
        stage.recompile()
