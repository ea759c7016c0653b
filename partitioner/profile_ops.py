"""One op of a traced program run on given values: its call, the state it reads, its backward (both timings use it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from partitioner.devices import Kernel

__all__ = ["OpCaller", "OpCosts", "count_kernels", "fresh_args", "requires_grad", "tensor_bytes"]


@dataclass
class OpCosts:
    """One op's forward, backward and input-gradient seconds, and its forward FLOPs."""

    fwd: float
    bwd: float
    bwd_input: float
    flops: int


class OpCaller:
    """Runs the ops of one traced program on values it is given, and tells what each reads."""

    def __init__(self, gm: fx.GraphModule, *, training: bool) -> None:
        self.gm = gm
        self.training = training
        self.interpreter = fx.Interpreter(gm)

    def fetch(self, name: str) -> Any:
        """The parameter, buffer or constant the program calls ``name``."""
        return self.interpreter.fetch_attr(name)

    def args(self, node: fx.Node, env: Mapping[fx.Node, Any]) -> tuple[tuple, dict]:
        args = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
        return args, kwargs

    def call(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        return getattr(self.interpreter, node.op)(node.target, args, kwargs)

    def state_tensors(self, node: fx.Node) -> list[torch.Tensor]:
        """The parameters and buffers ``node`` reads."""
        names = tuple(node.meta.get("smp_params", ())) + tuple(node.meta.get("smp_buffers", ()))
        return [self.fetch(n) for n in names]

    def weights(self, node: fx.Node) -> list[torch.Tensor]:
        """The parameters ``node`` reads that get gradients."""
        return [t for t in (self.fetch(n) for n in node.meta.get("smp_params", ())) if t.requires_grad]

    def grad_inputs(self, node: fx.Node, args: tuple, kwargs: dict) -> list[int]:
        """Positions (in the flat args) of activations that need an input gradient."""
        flat = pytree.tree_leaves((args, kwargs))
        from_state = {id(t) for t in self.state_tensors(node)}
        return [i for i, t in enumerate(flat)
                if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in from_state]

    def backward_closure(self, node: fx.Node, args: tuple, kwargs: dict, inplace: bool,
                         grad_inputs: list[int], weights: bool,
                         accumulate: bool = False) -> Callable[[], Callable[[], Any]] | None:
        """A function that runs the op's forward and returns its (timed) backward call.

        ``accumulate``: the backward adds into the tensors' ``.grad`` as training does,
        rather than returning fresh gradients."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        wrt_weights = self.weights(node) if weights else []
        if not grad_inputs and not wrt_weights:
            return None

        def prepare() -> Callable[[], Any]:
            leaves = list(flat)
            wrt: list[torch.Tensor] = list(wrt_weights)
            for i in grad_inputs:
                leaf = flat[i].detach().requires_grad_(True)
                wrt.append(leaf)
                leaves[i] = leaf.clone() if inplace else leaf
            call_args, call_kwargs = pytree.tree_unflatten(leaves, spec)
            with torch.enable_grad():
                out = self.call(node, call_args, call_kwargs)
            outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            grads = [torch.randn_like(t) if t.is_floating_point() else torch.ones_like(t) for t in outs]
            if accumulate:
                return lambda: torch.autograd.backward(outs, grads, inputs=wrt)
            return lambda: torch.autograd.grad(outs, wrt, grads, allow_unused=True)

        return prepare


def count_kernels(fn: Callable[[], Any]) -> list[Kernel]:
    """Each kernel ``torch.utils.flop_counter`` counts FLOPs of while ``fn`` runs: its kind and FLOPs."""
    counter = _KernelCounter()
    with counter:
        fn()
    return counter.kernels


class _KernelCounter(FlopCounterMode):
    """A FLOP counter that keeps each counted call apart (their sum is its total): a price needs each
    kernel's size, as a small matrix product reaches less of the peak than a large one."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.kernels: list[Kernel] = []

    def _count_flops(self, func_packet: Any, out: Any, args: tuple, kwargs: dict) -> Any:
        if func_packet in self.flop_registry:
            flops = int(self.flop_registry[func_packet](*args, **kwargs, out_val=out))
            self.kernels.append(Kernel("conv" if "conv" in str(func_packet) else "gemm", flops))
        return super()._count_flops(func_packet, out, args, kwargs)


def requires_grad(value: Any) -> bool:
    """Whether a tensor in ``value`` asks for gradients."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value))


def fresh_args(args: tuple, kwargs: dict, inplace: bool) -> tuple[tuple, dict]:
    """The op's arguments; cloned for in-place ops so repeats don't compound their writes."""
    if not inplace:
        return args, kwargs
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))


def tensor_bytes(value: Any, *, at_least: int = 0) -> int:
    """Bytes of the tensors in ``value``; ``at_least``: floating ones counted at that width or more."""
    return sum(t.numel() * (max(t.element_size(), at_least) if t.is_floating_point() else t.element_size())
               for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))
