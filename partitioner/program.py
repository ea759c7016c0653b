"""What smp reads off a traced program: its inputs flattened, its ops and what they read and write, its fingerprint."""

from __future__ import annotations

import hashlib
import inspect
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from partitioner.trace import TraceError

__all__ = [
    "flatten_inputs",
    "node_state_names",
    "op_nodes",
    "is_inplace",
    "retarget_device",
    "fingerprint",
]


def flatten_inputs(gm: fx.GraphModule, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> list[Any]:
    """The values of ``gm``'s placeholders, in order, for a call ``gm(*args, **kwargs)``."""
    kwargs = dict(kwargs or {})
    codegen = gm.graph._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):
        in_spec = codegen.pytree_info.in_spec
        signature = inspect.signature(gm.forward)
        bound = signature.bind(*args, **kwargs)
        # Export's in_spec is ((args...), {kwargs}) with the traced split of the two.
        n_args = _children(in_spec)[0].num_children
        values = list(bound.arguments.values())
        names = list(bound.arguments.keys())
        call_args = tuple(values[:n_args])
        call_kwargs = dict(zip(names[n_args:], values[n_args:]))
        return list(torch.fx._pytree.tree_flatten_spec((call_args, call_kwargs), in_spec))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    signature = inspect.signature(gm.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = list(bound.arguments.values())
    if len(values) != len(placeholders):
        raise TraceError(f"the traced program takes {len(placeholders)} inputs, the call gave {len(values)}")
    return values


def _children(spec: Any) -> list[Any]:
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(spec.children_specs)


def node_state_names(node: fx.Node) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(parameter FQNs, buffer FQNs) a node reads, as recorded by ``trace``."""
    return tuple(node.meta.get("smp_params", ())), tuple(node.meta.get("smp_buffers", ()))


def retarget_device(gm: fx.GraphModule, old: torch.device, new: torch.device) -> int:
    """Make the ops that name device ``old`` (creating, moving, checking tensors) name ``new``; returns how many.

    A model built on the meta device and traced by torch.export records ``meta`` wherever
    its code asks for "the model's device" (``torch.arange(..., device=self.device)``,
    ``x.to(self.device)``, export's own metadata checks), in nested programs too (an autocast
    region); on a rank that device is the one its stages run on.
    """
    def swap(value: Any) -> Any:
        return new if isinstance(value, torch.device) and value == old else value

    changed = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        touched = False
        for node in module.graph.nodes:
            args, kwargs = pytree.tree_map(swap, (node.args, node.kwargs))
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                changed += 1
                touched = True
        if touched:
            module.recompile()
    return changed


_INPLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.setitem)


def is_inplace(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``node`` may write into one of its inputs.

    In-place methods (``x.add_``), functions (``operator.iadd``, ``F.relu(x, inplace=True)``,
    aten ops whose schema marks a written argument) and modules built with
    ``inplace=True`` (``nn.ReLU(inplace=True)``). Such an op must not be fed a leaf that
    requires grad, and must not be run twice on the same input.
    """
    if node.op == "call_method":
        name = str(node.target)
        return (name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
            return True
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        name = getattr(node.target, "__name__", str(node.target))
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    return False


def op_nodes(gm: fx.GraphModule) -> tuple[list[fx.Node], dict[fx.Node, fx.Node]]:
    """The fx nodes that become ops (OpGraph nodes), and the op each call node belongs to.

    Every call node is an op except ``getitem``, which belongs to the op whose output it
    picks from: a cut never falls between a tuple and its elements.
    """
    ops: list[fx.Node] = []
    owner: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0] in owner:
            owner[node] = owner[node.args[0]]
            continue
        owner[node] = node
        ops.append(node)
    return ops, owner


def fingerprint(gm: fx.GraphModule, model: nn.Module) -> str:
    """A hash of the traced program's ops and edges and of the model's parameter shapes.

    Two processes that trace the same model on same-shaped inputs get the same value; a
    plan records it so that the runtime can refuse a plan made for another model.
    """
    ops, owner = op_nodes(gm)
    lines = []
    for node in ops:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        inputs = sorted({owner[p].name for p in node.all_input_nodes if p in owner and owner[p] is not node})
        lines.append(f"{node.name}|{node.op}|{target}|{node.meta.get('smp_module', '')}|{','.join(inputs)}")
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        lines.append(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
