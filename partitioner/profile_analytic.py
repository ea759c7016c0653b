"""Analytic timing: an op's forward and backward priced on a device profile from its FLOPs and the bytes it moves."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from partitioner.devices import DeviceSpec, Kernel, dtype_key
from partitioner.profile_ops import OpCaller, OpCosts, count_kernels, tensor_bytes

__all__ = ["analytic_costs", "dispatches"]


def analytic_costs(ops: OpCaller, spec: DeviceSpec, dtype: str | None, node: fx.Node, args: tuple, kwargs: dict,
                   out: Any, grad_inputs: list[int], needs_bwd: bool, kernels_fwd: list[Kernel],
                   inplace: bool) -> OpCosts:
    """``node``'s prices on ``spec`` in ``dtype`` (default: its own floating dtype), from its forward's
    FLOP-counted ``kernels_fwd`` and those its backward counts when ``needs_bwd``; each phase priced with
    the host's dispatch of the op (``DeviceSpec.op_time``)."""
    dtype = dtype or _dominant_dtype(out, args)
    state_bytes = sum(tensor_bytes(t) for t in ops.state_tensors(node))
    in_bytes = tensor_bytes((args, kwargs))
    out_bytes = tensor_bytes(out)
    if not dispatches(node, out):  # Python-level (a shape read, indexing a tuple): no aten op for the host
        spec = spec.compiled()
    fwd = spec.op_time(spec.kernel_time(kernels_fwd, in_bytes + out_bytes, dtype), "fwd")
    bwd = bwd_input = 0.0
    if needs_bwd:
        full = ops.backward_closure(node, args, kwargs, inplace, grad_inputs, weights=True)
        only_input = ops.backward_closure(node, args, kwargs, inplace, grad_inputs, weights=False)
        if full is not None:
            run = full()
            bwd = spec.op_time(spec.kernel_time(count_kernels(run), 2 * in_bytes + out_bytes + state_bytes, dtype),
                               "bwd")
        if only_input is not None and ops.weights(node):
            run = only_input()
            bwd_input = spec.op_time(spec.kernel_time(count_kernels(run), in_bytes + out_bytes, dtype), "bwd")
        elif only_input is not None:
            bwd_input = bwd
    return OpCosts(fwd, bwd, min(bwd_input, bwd), sum(k.flops for k in kernels_fwd))


def dispatches(node: fx.Node, out: Any) -> bool:
    """Whether running ``node`` makes the host dispatch an aten op: it returns a tensor and is not plain Python
    (``operator.getitem`` of a tuple, an attribute or buffer read). A shape read (``x.size()``) returns no tensor."""
    if node.op == "get_attr" or (node.op == "call_function" and node.target in (operator.getitem, getattr)):
        return False
    return any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out))


def _dominant_dtype(out: Any, args: Any) -> str:
    for value in (out, args):
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return dtype_key(t.dtype)
    return "fp32"
