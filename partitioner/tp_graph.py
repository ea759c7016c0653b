"""Which activations of a traced program tensor parallelism splits; its head counts rewritten to each rank's share."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch import nn

from partitioner.errors import PlanError

__all__ = ["TensorParallelError", "ModuleSplit", "SplitActivations", "split_activations", "rewrite_stage",
           "planned_module"]


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
    "masked_fill", "add_", "mul_", "iadd", "imul",
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
    value: one entry per leaf), and each view's shape arguments rewritten to this rank's share (by node name)."""

    tp_size: int
    split: dict[str, Any] = field(default_factory=dict)
    rewrites: dict[str, tuple[int, int]] = field(default_factory=dict)  # view -> (which size, its local value)

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
                      tp_size: int) -> SplitActivations:
    """Follow the split activations of ``gm`` (the whole traced program, every stage) from the modules of
    ``styles`` (by qualified name), with every value's global shape in ``meta``; the view and expand shapes
    that name a split dim's size as a constant (a head count fx baked in) are rewritten to its share.

    Refuses, naming the op or module and the count, what would compute wrongly on shards: a head count or
    feature count ``tp_size`` does not divide, a rowwise module reading a whole tensor, an op smp does not know
    reading a split tensor, the model's output split.
    """
    acts = SplitActivations(tp_size)
    split = acts.split
    parts: dict[str, int] = {}  # values that are a fused module's output (or its chunks' source)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            bad = [a.name for a in node.all_input_nodes if split.get(a.name) is not None]
            if bad:
                raise TensorParallelError(f"the model's output {bad[0]} is split over the tp ranks: end the "
                                          "tensor-parallel region before the output (a rowwise module, or "
                                          "'colwise_rep' for the last projection)")
            continue
        ins = [a for a in node.all_input_nodes if split.get(a.name) is not None]
        module = planned_module(node)
        if module in styles:
            style = styles[module]
            x = node.args[0] if node.args else None
            dim = split.get(x.name) if isinstance(x, fx.Node) else None
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
            continue
        if not ins:
            continue
        _follow(node, ins, gm, meta, acts, parts)
    return acts


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
