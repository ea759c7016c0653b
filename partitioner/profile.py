"""Profile a traced model op by op into an OpGraph: forward/backward time, bytes, FLOPs."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from partitioner.cuda_timing import GpuTimer
from partitioner.devices import DeviceSpec, dtype_key
from partitioner.graph import OpGraph
from partitioner.trace import TraceError, flatten_inputs, is_inplace, op_nodes, retarget_device, trace

__all__ = ["profile", "op_nodes", "time_whole_model", "TIMINGS"]

TIMINGS = ("measured", "analytic")
ProgressFn = Callable[[int, int], None]


def profile(
    model: nn.Module,
    example_args: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    timing: str = "measured",
    device: str | torch.device | None = None,
    repeats: int = 5,
    warmup: int = 2,
    device_profile: str | Path | dict | None = None,
    dtype: str | None = None,
    training: bool = True,
    graph_module: fx.GraphModule | None = None,
    frontend: str = "auto",
    leaf_modules: Iterable[type | str] = (),
    progress: ProgressFn | None = None,
) -> OpGraph:
    """Trace ``model`` on the sample and cost every op; returns an ``OpGraph``.

    ``timing="measured"`` runs each op on its own inputs (warm-up, then the median of
    ``repeats``; CUDA events on a GPU) and times its backward with autograd on a random
    output gradient. A model whose weights are on the meta device is measured on ``device``
    (default: CUDA when available, else the CPU) **one op at a time**: only the op being run
    has its weights materialized there (random values), so a model larger than the device
    can still be timed on it. ``timing="analytic"`` counts FLOPs (``torch.utils.flop_counter``) and
    bytes moved and prices them on ``device_profile`` (a name in profiles/ or a path;
    ``dtype`` prices the ops as if run in, e.g., ``"bf16"``): this plans a GPU cluster from
    a laptop, and works on a model built on the meta device. ``device`` moves the model
    there for the duration of the call (it is moved back afterwards, its buffers restored).
    """
    if timing not in TIMINGS:
        raise ValueError(f"unknown timing {timing!r}; choose 'measured' or 'analytic'")
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    kwargs = dict(example_kwargs or {})
    home = _model_device(model)
    # weights on meta, timed for real: each op gets its own weights on the target while it runs
    one_at_a_time = home.type == "meta" and timing == "measured"
    target = torch.device(device) if device is not None else \
        _measuring_device() if one_at_a_time else home
    if target.type == "meta" and timing == "measured":
        raise ValueError("measured timing runs the ops for real, not on the meta device: pass device='cuda' or "
                         "'cpu' (each op's weights are materialized there one op at a time), or use "
                         "timing='analytic' (with device_profile='h100-sxm' or another profile)")
    spec = None
    if timing == "analytic":
        spec = DeviceSpec.from_profile(device_profile or ("cpu" if target.type == "cpu" else "h100-sxm"))
    # One op at a time: bytes and FLOPs are counted on meta as analytic timing counts them;
    # the times come from a second walk, on the target, with real values.
    walked_on = home if one_at_a_time else target
    real_args, real_kwargs = _to_device((args, kwargs), target) if one_at_a_time else ((), {})
    args, kwargs = _to_device((args, kwargs), walked_on)
    # Profiling draws random numbers (dropout, output gradients): the caller's stream must not notice.
    with _borrowed(model, walked_on, training), \
            torch.random.fork_rng(devices=[target] if target.type == "cuda" else []):
        gm = graph_module if graph_module is not None else trace(
            model, args, kwargs, frontend=frontend, leaf_modules=leaf_modules)
        try:
            inputs = flatten_inputs(gm, args, kwargs)
            alone = None
            if one_at_a_time:
                real_gm = _retargeted_copy(gm, home, target)
                alone = _OneOpAtATime(real_gm, target, flatten_inputs(gm, real_args, real_kwargs),
                                      training=training, repeats=repeats, warmup=warmup)
        except TypeError as err:
            raise TraceError(f"the sample inputs do not match the traced model: {err}") from None
        runner = _OpRunner(gm, walked_on, training=training, timing=timing, spec=spec, dtype=dtype,
                           repeats=repeats, warmup=warmup, alone=alone)
        graph = runner.run(inputs, progress)
    info = gm.meta.get("smp_trace")
    graph.meta.update({
        "model": type(model).__name__,
        "frontend": getattr(info, "frontend", "unknown"),
        "timing": timing,
        "device": str(target),
        "device_profile": spec.name if spec else None,
        "dtype": dtype,
        "repeats": repeats if timing == "measured" else None,
        "one_op_at_a_time": one_at_a_time,
        "training": training,
        "torch": torch.__version__,
        "inputs": _describe_inputs(args, kwargs),
    })
    return graph


@contextlib.contextmanager
def _borrowed(model: nn.Module, device: torch.device, training: bool) -> Iterator[None]:
    """The model on ``device`` in ``training`` mode for a while; then its device, mode and buffers as they were."""
    home = _model_device(model)
    was_training = model.training
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    if device != home:
        model.to(device)
    model.train(training)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers and b.shape == buffers[name].shape:
                    b.copy_(buffers[name])
        model.train(was_training)
        if device != home:
            model.to(home)


def time_whole_model(model: nn.Module, example_args: Sequence[Any] | Any = (),
                     example_kwargs: Mapping[str, Any] | None = None, *, repeats: int = 7,
                     warmup: int = 2) -> tuple[float, float]:
    """Median (forward, backward) seconds of the whole model: the yardstick for a profile.

    The backward starts from a gradient of ones on every floating output; parameter
    gradients are cleared afterwards and buffers restored, so the model is left as it was.
    """
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    kwargs = dict(example_kwargs or {})
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    # CUDA kernels run asynchronously: without waiting for them the clock reads launch time only.
    gpus = {t.device for t in [*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs))]
            if isinstance(t, torch.Tensor) and t.device.type == "cuda"}

    def now() -> float:
        for device in gpus:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    fwd_times: list[float] = []
    bwd_times: list[float] = []
    try:
        for i in range(warmup + repeats):
            start = now()
            out = model(*args, **kwargs)
            middle = now()
            outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            end = now()
            if i >= warmup:
                fwd_times.append(middle - start)
                bwd_times.append(end - middle)
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    return statistics.median(fwd_times), statistics.median(bwd_times)


# ------------------------------------------------------------------ the op runner


@dataclass
class _Costs:
    fwd: float
    bwd: float
    bwd_input: float
    flops: int


class _OpRunner:
    """Walks the graph in program order, running and costing one op at a time."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, *, training: bool, timing: str,
                 spec: DeviceSpec | None, dtype: str | None, repeats: int, warmup: int,
                 alone: _OneOpAtATime | None = None):
        self.gm = gm
        self.alone = alone  # set: the ops are timed one at a time there, with their own weights
        self.device = device
        self.training = training
        self.timing = timing
        self.spec = spec
        self.dtype = dtype
        self.repeats = repeats
        self.warmup = warmup
        self.interpreter = fx.Interpreter(gm)
        self.gpu_timer = GpuTimer(device) if device.type == "cuda" else None
        self._costs: dict[str, _Costs] = {}  # by _cost_key: the 80 blocks of an LLM are costed once

    def run(self, inputs: list[Any], progress: ProgressFn | None) -> OpGraph:
        ops, owner = op_nodes(self.gm)
        env: dict[fx.Node, Any] = {}
        placeholders = iter(inputs)
        g = nx.DiGraph()
        seen_state: dict[int, str] = {}
        index = 0
        calls: list[tuple[fx.Node, tuple, dict, Any]] = []
        sweeps = 1 + (3 * (self.warmup + self.repeats) if self.timing == "measured" else 0)
        total, done = len(ops) * sweeps, [0]

        def tick(ops_done: int = 1) -> None:
            done[0] += ops_done
            if progress is not None:
                progress(done[0], total)

        kernel_made: dict[str, dict[int, int]] = {}  # op -> storages its matmul kernels made (key -> bytes)
        saved = _SavedTensors([t for t in inputs if isinstance(t, torch.Tensor)]
                              + list(self.gm.parameters()) + list(self.gm.buffers()))
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
                continue
            if node.op == "get_attr":
                env[node] = self.interpreter.fetch_attr(str(node.target))
                continue
            if node.op == "output":
                self._add_output(g, node, owner, index, env)
                continue
            args, kwargs = self._args(node, env)
            if owner[node] is not node:  # getitem: plumbing that belongs to its producer
                with torch.set_grad_enabled(self.training), saved.during(owner[node].name):
                    env[node] = self._call(node, args, kwargs)
                saved.made(owner[node].name, env[node])  # a getitem's piece of its producer's output
                g.nodes[owner[node].name]["fx_nodes"] += (node.name,)
                continue
            with torch.set_grad_enabled(self.training), saved.during(node.name), _KernelOutputs(saved.alive) as kernels:
                out = self._call(node, args, kwargs)
            view_of, storage_bytes = saved.made(node.name, out)
            kernel_made[node.name] = kernels.made
            env[node] = out
            costs = self._cost(node, args, kwargs, out)
            params, buffers, shared, shared_from, param_bytes, buffer_bytes, shared_bytes = self._state(node, seen_state)
            g.add_node(
                node.name,
                fwd=costs.fwd,
                bwd=costs.bwd,
                bwd_w=max(costs.bwd - costs.bwd_input, 0.0),
                params=param_bytes,
                shared_bytes=shared_bytes,
                buffers=buffer_bytes,
                out_bytes=_tensor_bytes(out),
                flops=costs.flops,
                module=node.meta.get("smp_module", ""),
                op=_op_name(node, self.gm),
                index=index,
                param_names=params,
                buffer_names=buffers,
                shared_params=shared,
                shared_from=shared_from,
                fx_nodes=(node.name,),
                view_of=view_of,
                storage_bytes=storage_bytes,
            )
            index += 1
            for producer in node.all_input_nodes:
                if producer in owner and owner[producer] is not node:
                    g.add_edge(owner[producer].name, node.name)
            calls.append((node, args, kwargs, out))
            tick()
        for name, data in g.nodes(data=True):
            data["saved_bytes"] = saved.bytes.get(name, 0) + (data.pop("returned_bytes", 0) if self.training else 0)
            data["saved_output_bytes"] = saved.output_bytes.get(name, 0)
            made = kernel_made.get(name)
            if made is not None:
                data["kernel_bytes"] = sum(made.values())
                data["kernel_saved_bytes"] = sum(saved.size.get(k, 0) for k in made)
                data["kernel_output_bytes"] = sum(made[k] for k in saved.output_keys.get(name, ()) if k in made)
        if self.timing == "measured":
            fwd, bwd, bwd_input = (self.alone.measure([node for node, *_ in calls], tick) if self.alone
                                   else self._measure_in_context(calls, tick))
            for node, *_ in calls:
                data = g.nodes[node.name]
                data["fwd"], data["bwd"] = fwd[node], bwd[node]
                data["bwd_w"] = max(bwd[node] - bwd_input[node], 0.0)
        return OpGraph(g, {"activations": "saved_bytes"})

    @staticmethod
    def _add_output(g: nx.DiGraph, node: fx.Node, owner: Mapping[fx.Node, fx.Node], index: int,
                    env: Mapping[fx.Node, Any]) -> None:
        """The model's output as a node of its own: every value it returns must reach the stage holding it.

        It costs nothing and holds nothing; its in-edges make the cost model price moving
        each returned value to the output stage, and make the plan carry those transfers.
        """
        g.add_node(node.name, fwd=0.0, bwd=0.0, bwd_w=0.0, params=0, shared_bytes=0, buffers=0, out_bytes=0,
                   flops=0, module="", op="output", index=index, param_names=(), buffer_names=(),
                   shared_params=(), shared_from=(), fx_nodes=(node.name,))
        # The loss keeps what the model returns for its own backward, on the output stage, in fp32: torch's
        # losses (log_softmax, cross_entropy, mse_loss) run in fp32 under autocast, and the zoo's and Hugging
        # Face's language-model losses cast the logits up first. Counted at the returned width, a bf16 GPT's
        # last stage held one bf16 copy of its logits more than planned (docs/memory.md).
        g.nodes[node.name]["returned_bytes"] = sum(
            _tensor_bytes(env[p], at_least=4) for p in {owner[p] for p in node.all_input_nodes if p in owner})
        for producer in node.all_input_nodes:
            if producer in owner:
                g.add_edge(owner[producer].name, node.name)

    # -------------------------------------------------------------- running one op

    def _args(self, node: fx.Node, env: Mapping[fx.Node, Any]) -> tuple[tuple, dict]:
        args = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
        return args, kwargs

    def _call(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        return getattr(self.interpreter, node.op)(node.target, args, kwargs)

    def _state(self, node: fx.Node, seen: dict[int, str]) -> tuple[tuple, tuple, tuple, tuple, int, int, int]:
        """Names the node reads, the parameter/buffer bytes it is first to read, and the shared bytes."""
        params = tuple(node.meta.get("smp_params", ()))
        buffers = tuple(node.meta.get("smp_buffers", ()))
        shared: list[str] = []
        shared_from: list[str] = []  # the name each shared parameter was first counted under
        param_bytes = buffer_bytes = shared_bytes = 0
        counted_here: set[int] = set()
        for names, is_param in ((params, True), (buffers, False)):
            for name in names:
                tensor = self.interpreter.fetch_attr(name)
                key = id(tensor)
                if key in seen:
                    if is_param and key not in counted_here:
                        shared.append(name)
                        shared_from.append(seen[key])
                        shared_bytes += tensor.numel() * tensor.element_size()
                    continue
                counted_here.add(key)
                seen[key] = name
                if is_param:
                    param_bytes += tensor.numel() * tensor.element_size()
                else:
                    buffer_bytes += tensor.numel() * tensor.element_size()
        return params, buffers, tuple(shared), tuple(shared_from), param_bytes, buffer_bytes, shared_bytes

    def _cost(self, node: fx.Node, args: tuple, kwargs: dict, out: Any) -> _Costs:
        """FLOPs of the op; with analytic timing also its priced times (measured ones come later).

        An op that computes what an op already costed computes (same function or built-in torch.nn
        module with the same settings, same shapes, dtypes and gradient needs) costs the same:
        counting FLOPs runs the op and its backward again, most of the time of profiling a large
        model analytically."""
        key = self._cost_key(node, args, kwargs, out)
        if key is not None and key in self._costs:
            return dataclasses.replace(self._costs[key])
        costs = self._count_cost(node, args, kwargs, out)
        if key is not None:
            self._costs[key] = dataclasses.replace(costs)
        return costs

    def _cost_key(self, node: fx.Node, args: tuple, kwargs: dict, out: Any) -> str | None:
        """What an op's cost depends on, or None when that cannot be told (a module of the user's: its
        behaviour may hang on attributes no signature shows)."""
        if node.op == "call_module":
            module = self.gm.get_submodule(str(node.target))
            if not type(module).__module__.startswith("torch.nn.modules"):
                return None
            head: Any = (type(module).__qualname__, module.extra_repr(), module.training)
        elif node.op in ("call_function", "call_method"):
            head = (node.op, node.target if isinstance(node.target, str)
                    else f"{getattr(node.target, '__module__', '')}.{getattr(node.target, '__qualname__', node.target)}")
        else:
            return None
        state = {id(t) for t in self._node_state_tensors(node)}

        def describe(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return ("state" if id(value) in state else "tensor", tuple(value.shape), value.dtype,
                        value.requires_grad)
            return value

        described = pytree.tree_map(describe, (args, kwargs, out))
        text = repr((head, is_inplace(node, self.gm), self.training, described,
                     [(tuple(t.shape), t.dtype, t.requires_grad) for t in self._node_state_tensors(node)]))
        return None if " at 0x" in text else text  # an object known only by its address: no key

    def _count_cost(self, node: fx.Node, args: tuple, kwargs: dict, out: Any) -> _Costs:
        inplace = is_inplace(node, self.gm)
        flops_fwd = _count_flops(lambda: self._call(node, *_fresh(args, kwargs, inplace)))
        if self.timing == "analytic":
            needs_bwd = self.training and _requires_grad(out)
            return self._analytic(node, args, kwargs, out, self._grad_inputs(node, args, kwargs), needs_bwd,
                                  flops_fwd, inplace)
        return _Costs(0.0, 0.0, 0.0, flops_fwd)

    def _measure_in_context(self, calls: list[tuple[fx.Node, tuple, dict, Any]], tick: Callable[[int], None]
                            ) -> tuple[dict[fx.Node, float], dict[fx.Node, float], dict[fx.Node, float]]:
        """Forward, backward and input-gradient seconds of every op, timed within whole passes.

        Each repeat is a sweep over every op in program order (forward), or a forward
        that keeps every op's autograd graph followed by a sweep in reverse order
        (backward), so caches hold what they hold in a real step: timing one op again
        and again on the same data keeps its weights hot and underestimates it when they
        do not fit in cache (-30% to -40% on CPU for 2 MB weight matrices). Median of
        ``repeats`` after ``warmup`` sweeps.
        """
        fwd: dict[fx.Node, list[float]] = {node: [] for node, *_ in calls}
        rounds = self.warmup + self.repeats
        for r in range(rounds):
            with torch.set_grad_enabled(self.training):
                for node, args, kwargs, _ in calls:
                    call_args, call_kwargs = _fresh(args, kwargs, is_inplace(node, self.gm))
                    elapsed = self._timed(lambda: self._call(node, call_args, call_kwargs), (node, "fwd"))
                    if r >= self.warmup:
                        fwd[node].append(elapsed)
            tick(len(calls))
        trainable = [(node, args, kwargs) for node, args, kwargs, out in calls
                     if self.training and _requires_grad(out)]
        # A training step's backward accumulates weight gradients into .grad: from the
        # second microbatch on, that adds a read-modify-write of every weight, which matters
        # for memory-bound weights. Time it that way, on zeroed gradients restored afterwards.
        weights = {id(p): p for node, *_ in trainable for p in self._weights(node)}
        saved = {key: p.grad for key, p in weights.items()}
        for p in weights.values():
            p.grad = torch.zeros_like(p)
        try:
            bwd = self._backward_sweeps(trainable, weights=True, accumulate=True, tick=lambda: tick(len(calls)))
        finally:
            for key, p in weights.items():
                p.grad = saved[key]
        # Without weights the whole backward is the input gradient: no second timing, whose
        # noise would only blur the split.
        with_weights = [c for c in trainable if self._weights(c[0])]
        bwd_input = dict(bwd)
        bwd_input.update(self._backward_sweeps(with_weights, weights=False, tick=lambda: tick(len(calls))))
        zero = dict.fromkeys(fwd, 0.0)
        return ({n: statistics.median(v) for n, v in fwd.items()},
                {**zero, **bwd}, {**zero, **{n: min(bwd_input[n], bwd[n]) for n in bwd}})

    def _backward_sweeps(self, ops: list[tuple[fx.Node, tuple, dict]], *, weights: bool,
                         tick: Callable[[], None], accumulate: bool = False) -> dict[fx.Node, float]:
        """Median backward seconds per op: forward every op, then time their backwards in reverse order.

        ``tick`` is called once per sweep."""
        samples: dict[fx.Node, list[float]] = {node: [] for node, *_ in ops}
        prepared = [(node, self._backward_closure(node, args, kwargs, is_inplace(node, self.gm),
                                                  self._grad_inputs(node, args, kwargs), weights, accumulate))
                    for node, args, kwargs in ops]
        for r in range(self.warmup + self.repeats):
            runs = [(node, prepare()) for node, prepare in prepared if prepare is not None]
            for node, run in reversed(runs):
                elapsed = self._timed(run, (node, "bwd", weights))
                if r >= self.warmup:
                    samples[node].append(elapsed)
            del runs
            tick()
        return {node: statistics.median(v) if v else 0.0 for node, v in samples.items()}

    def _grad_inputs(self, node: fx.Node, args: tuple, kwargs: dict) -> list[int]:
        """Positions (in the flat args) of activations that need an input gradient."""
        flat = pytree.tree_leaves((args, kwargs))
        from_state = {id(t) for t in self._node_state_tensors(node)}
        return [i for i, t in enumerate(flat)
                if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in from_state]

    def _node_state_tensors(self, node: fx.Node) -> list[torch.Tensor]:
        names = tuple(node.meta.get("smp_params", ())) + tuple(node.meta.get("smp_buffers", ()))
        return [self.interpreter.fetch_attr(n) for n in names]

    def _weights(self, node: fx.Node) -> list[torch.Tensor]:
        return [t for t in (self.interpreter.fetch_attr(n) for n in node.meta.get("smp_params", ()))
                if t.requires_grad]

    def _backward_closure(self, node: fx.Node, args: tuple, kwargs: dict, inplace: bool,
                          grad_inputs: list[int], weights: bool,
                          accumulate: bool = False) -> Callable[[], Callable[[], Any]] | None:
        """A function that runs the op's forward and returns its (timed) backward call.

        ``accumulate``: the backward adds into the tensors' ``.grad`` as training does,
        rather than returning fresh gradients."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        wrt_weights = self._weights(node) if weights else []
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
                out = self._call(node, call_args, call_kwargs)
            outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            grads = [torch.randn_like(t) if t.is_floating_point() else torch.ones_like(t) for t in outs]
            if accumulate:
                return lambda: torch.autograd.backward(outs, grads, inputs=wrt)
            return lambda: torch.autograd.grad(outs, wrt, grads, allow_unused=True)

        return prepare

    def _timed(self, fn: Callable[[], Any], site: Hashable) -> float:
        """Seconds ``fn`` takes (its kernels' time on a GPU); ``site`` names the call for the GPU timer."""
        self._before_timing()
        if self.gpu_timer is not None:
            return self.gpu_timer(fn, site)
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin

    def _before_timing(self) -> None:
        """In context, caches hold what a step leaves in them: nothing to do."""

    # -------------------------------------------------------------- analytic costs

    def _analytic(self, node: fx.Node, args: tuple, kwargs: dict, out: Any, grad_inputs: list[int],
                  needs_bwd: bool, flops_fwd: int, inplace: bool) -> _Costs:
        assert self.spec is not None
        dtype = self.dtype or _dominant_dtype(out, args)
        state_bytes = sum(_tensor_bytes(t) for t in self._node_state_tensors(node))
        in_bytes = _tensor_bytes((args, kwargs))
        out_bytes = _tensor_bytes(out)
        fwd = self.spec.op_time(flops_fwd, in_bytes + out_bytes, dtype)
        bwd = bwd_input = 0.0
        if needs_bwd:
            full = self._backward_closure(node, args, kwargs, inplace, grad_inputs, weights=True)
            only_input = self._backward_closure(node, args, kwargs, inplace, grad_inputs, weights=False)
            if full is not None:
                run = full()
                bwd = self.spec.op_time(_count_flops(run), 2 * in_bytes + out_bytes + state_bytes, dtype)
            if only_input is not None and self._weights(node):
                run = only_input()
                bwd_input = self.spec.op_time(_count_flops(run), in_bytes + out_bytes, dtype)
            elif only_input is not None:
                bwd_input = bwd
        return _Costs(fwd, bwd, min(bwd_input, bwd), flops_fwd)


class _OneOpAtATime(_OpRunner):
    """Times the ops of a model whose weights are on meta, each with only its own weights real.

    Walks its copy of the program in order on real activations; before an op runs, the
    parameters, buffers and constants it reads are materialized on the device (random
    values, or copied when real elsewhere), and put back on meta after it is timed, so one
    op's weights are held at a time and a model larger than the device can be timed on
    it. Without the rest of the model there are no sweeps in context: each op is timed
    again and again, the caches cleared before each run (``_CacheEvictor``).
    """

    def __init__(self, gm: fx.GraphModule, device: torch.device, inputs: list[Any], *, training: bool,
                 repeats: int, warmup: int) -> None:
        super().__init__(gm, device, training=training, timing="measured", spec=None, dtype=None,
                         repeats=repeats, warmup=warmup)
        self.inputs = inputs
        self.cold = _CacheEvictor(gm, device)

    def measure(self, wanted: list[fx.Node], tick: Callable[[int], None]
                ) -> tuple[dict[fx.Node, float], dict[fx.Node, float], dict[fx.Node, float]]:
        """Forward, backward and input-gradient seconds of the ``wanted`` ops (nodes of the
        caller's program, matched to this copy's by name)."""
        by_name = {node.name: node for node in wanted}
        order = list(self.gm.graph.nodes)
        last_use = {producer: i for i, node in enumerate(order) for producer in node.all_input_nodes}
        env: dict[fx.Node, Any] = {}
        placeholders = iter(self.inputs)
        fwd: dict[fx.Node, float] = {}
        bwd: dict[fx.Node, float] = {}
        bwd_input: dict[fx.Node, float] = {}
        for i, node in enumerate(order):
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "get_attr":  # fetched when an op runs, materialized for it
                value = self.interpreter.fetch_attr(str(node.target))
                env[node] = _Attr(str(node.target)) if isinstance(value, torch.Tensor) else value
            elif node.op != "output":
                theirs = by_name.get(node.name)
                env[node], times = self._run(node, env, timed=theirs is not None, tick=tick)
                if theirs is not None:
                    fwd[theirs], bwd[theirs], bwd_input[theirs] = times
            for producer in node.all_input_nodes:
                if last_use.get(producer) == i:
                    env.pop(producer, None)
        return fwd, bwd, bwd_input

    def _run(self, node: fx.Node, env: Mapping[fx.Node, Any], *, timed: bool, tick: Callable[[int], None]
             ) -> tuple[Any, tuple[float, float, float]]:
        """Run ``node`` with its own weights (and time it); returns its output and (fwd, bwd, bwd_input).

        A function of its own so that nothing holds the weights once it returns."""
        args, kwargs = self._args(node, env)
        with self._own_state(node) as state:
            args, kwargs = pytree.tree_map_only(  # resolved once, not inside the timed calls
                _Attr, lambda a: self.interpreter.fetch_attr(a.name), (args, kwargs))
            with torch.set_grad_enabled(self.training):
                out = _detached(self._call(node, args, kwargs))  # its graph would keep the weights
            if not timed:
                return out, (0.0, 0.0, 0.0)
            self.cold.arm(state)
            weights = {id(t) for t in state}  # read back the activations only: the weights stay cold
            self.cold.hot = [t for t in pytree.tree_leaves((args, kwargs))
                             if isinstance(t, torch.Tensor) and id(t) not in weights]
            try:
                fwd, bwd, bwd_input = self._measure_in_context([(node, args, kwargs, out)], tick)
            finally:
                self.cold.hot = []
            return out, (fwd[node], bwd[node], bwd_input[node])

    def _before_timing(self) -> None:
        self.cold.evict()

    @contextlib.contextmanager
    def _own_state(self, node: fx.Node) -> Iterator[list[torch.Tensor]]:
        """The parameters, buffers and constants ``node`` reads, real on the device while it runs
        (yields those materialized)."""
        names = list(node.meta.get("smp_params", ())) + list(node.meta.get("smp_buffers", ()))
        names += [str(a.target) for a in node.all_input_nodes if a.op == "get_attr"]
        made: dict[int, torch.Tensor] = {}
        swapped: list[tuple[nn.Module, str, str, Any]] = []  # (owner, table, leaf, what was there)
        try:
            for name in dict.fromkeys(names):
                prefix, _, leaf = name.rpartition(".")
                owner = self.gm.get_submodule(prefix)
                tensor = getattr(owner, leaf, None)
                if not isinstance(tensor, torch.Tensor) or tensor.device == self.device:
                    continue
                real = made.setdefault(id(tensor), _materialized(tensor, self.device))  # tied: one copy
                table = "_parameters" if leaf in owner._parameters else "_buffers" if leaf in owner._buffers else ""
                if table:
                    getattr(owner, table)[leaf] = real
                else:
                    object.__setattr__(owner, leaf, real)
                swapped.append((owner, table, leaf, tensor))
            yield list(made.values())
        finally:
            for owner, table, leaf, tensor in reversed(swapped):
                if table:
                    getattr(owner, table)[leaf] = tensor
                else:
                    object.__setattr__(owner, leaf, tensor)


# ------------------------------------------------------------------ helpers


class _SavedTensors:
    """The bytes autograd keeps for the backward, each storage once, charged to the op that made it.

    A storage an op saves is charged to the op whose output it is (a layer's input is
    charged to the layer before, which keeps it alive for its own backward too), or to the
    saving op itself when it is new (an intermediate such as a dropout mask). Parameters,
    buffers and the model's inputs are not activations.
    """

    def __init__(self, not_activations: list[torch.Tensor]) -> None:
        self.owner: dict[int, str | None] = {_storage_key(t): None for t in not_activations}
        self.size: dict[int, int] = {}  # storages saved so far, each counted once
        self.outputs: set[int] = set()
        self.output_keys: dict[str, set[int]] = {}  # op -> the storages its output owns
        self.bytes: dict[str, int] = {}
        self.output_bytes: dict[str, int] = {}  # the part of bytes[op] that is op's own output
        self.alive: list[torch.UntypedStorage] = []

    def made(self, name: str, value: Any) -> tuple[str, int]:
        """``value`` is ``name``'s output (an op that saves its own output saved it before it was returned).

        Returns (the op whose storage the output is a view of, '' when its own; the bytes of
        the storages it owns): what a stage keeps when it sends this output on.
        """
        view_of, own = "", 0
        for t in pytree.tree_leaves(value):
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            owner = self.owner.setdefault(key, name)
            if owner != name:
                view_of = view_of or (owner or "")
                continue
            if key not in self.outputs:
                self.outputs.add(key)
                self.output_keys.setdefault(name, set()).add(key)
                own += t.untyped_storage().nbytes()
                if key in self.size:
                    self.output_bytes[name] = self.output_bytes.get(name, 0) + self.size[key]
        return view_of, own

    def during(self, name: str) -> Any:
        """Count what autograd saves while ``name`` runs. The graph is only measured, never run
        backward (the profiler times backwards on graphs of their own), so it keeps no tensors
        (which would keep the model's parameters referenced); counted storages are kept alive
        until profiling ends, so that no key is reused."""
        def pack(t: torch.Tensor) -> int:
            key = _storage_key(t)
            owner = self.owner.setdefault(key, name)
            if owner is not None and key not in self.size:
                self.alive.append(t.untyped_storage())  # a freed storage's key could come back for another
                self.size[key] = t.untyped_storage().nbytes()
                self.bytes[owner] = self.bytes.get(owner, 0) + self.size[key]
                if key in self.outputs:
                    self.output_bytes[owner] = self.output_bytes.get(owner, 0) + self.size[key]
            return key

        def unpack(key: int) -> torch.Tensor:
            raise RuntimeError("the profiler's measuring pass keeps no tensors for a backward")

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class _KernelOutputs(TorchDispatchMode):
    """The storages made by the matmul kernels an op runs (those ``torch.utils.flop_counter`` counts): what
    selective recomputation keeps of the op (runtime/recompute.py caches exactly these outputs)."""

    def __init__(self, alive: list[torch.UntypedStorage]) -> None:
        super().__init__()
        self.made: dict[int, int] = {}
        self.alive = alive  # kept until profiling ends, so that no later storage reuses a key

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in flop_registry:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and _storage_key(t) not in self.made:
                    self.made[_storage_key(t)] = t.untyped_storage().nbytes()
                    self.alive.append(t.untyped_storage())
        return out


def _storage_key(t: torch.Tensor) -> int:
    """One key per storage, shared by its views (works on meta tensors, whose data pointers are all 0)."""
    return t.untyped_storage()._cdata


def _count_flops(fn: Callable[[], Any]) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


def _requires_grad(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value))


def _fresh(args: tuple, kwargs: dict, inplace: bool) -> tuple[tuple, dict]:
    """The op's arguments; cloned for in-place ops so repeats don't compound their writes."""
    if not inplace:
        return args, kwargs
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))


def _tensor_bytes(value: Any, *, at_least: int = 0) -> int:
    """Bytes of the tensors in ``value``; ``at_least``: floating ones counted at that width or more."""
    return sum(t.numel() * (max(t.element_size(), at_least) if t.is_floating_point() else t.element_size())
               for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def _dominant_dtype(out: Any, args: Any) -> str:
    for value in (out, args):
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return dtype_key(t.dtype)
    return "fp32"


def _op_name(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def _to_device(value: Any, device: torch.device) -> Any:
    """``value``'s tensors on ``device``; a meta tensor sent to a real device is given values."""
    def place(t: torch.Tensor) -> torch.Tensor:
        return _materialized(t, device) if t.is_meta and device.type != "meta" else t.to(device)
    return pytree.tree_map_only(torch.Tensor, place, value)


# ------------------------------------------------------------------ one op's weights at a time


@dataclass(frozen=True)
class _Attr:
    """A parameter, buffer or constant the program fetches, resolved when an op runs (one op at a time)."""

    name: str


def _measuring_device() -> torch.device:
    """Where a model built on meta is timed when no device is named: the GPU if there is one."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _materialized(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real copy of ``tensor`` on ``device``: its values if it has any, else random ones
    (timing does not depend on them: small normals for floats, zeros for integers, which
    are valid indices)."""
    if not tensor.is_meta:
        real = tensor.detach().to(device)
    else:
        real = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        if real.is_floating_point() or real.is_complex():
            real.normal_(0.0, 0.02)
        else:
            real.zero_()
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(real, requires_grad=tensor.requires_grad)
    return real


def _detached(value: Any) -> Any:
    """``value`` cut from the autograd graph that made it, still asking for gradients where it did."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), value)


def _retargeted_copy(gm: fx.GraphModule, old: torch.device, new: torch.device) -> fx.GraphModule:
    """A copy of the traced program whose device constants name ``new`` instead of ``old``
    (the caller's program, and its fingerprint, stay as traced)."""
    gm = copy.deepcopy(gm)
    retarget_device(gm, old, new)
    return gm


class _CacheEvictor:
    """Clears the caches before a timed run of one op, then reads the op's inputs back in.

    Timing one op again and again keeps its weights in cache, which a training step does
    not: between two uses of an op's weights the rest of the model's weights stream
    through the caches. Writing a buffer of the model's state bytes (at most the
    last-level cache, as triton's ``do_bench`` does on GPUs) before each run gives the
    op its weights from where a step finds them; its inputs, just made by the op before,
    are read back so that they are as warm as in a step. On a CPU the eviction also
    evicts the interpreter's own data, which a step keeps warm and which costs a small op
    several times its run time: there, ops whose weights fit in a core's L2 are timed warm.
    """

    def __init__(self, gm: fx.GraphModule, device: torch.device) -> None:
        state = sum(t.numel() * t.element_size() for t in list(gm.parameters()) + list(gm.buffers()))
        last_level = (int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or 256 << 20
                      if device.type == "cuda" else _cpu_cache_bytes(max) or 32 << 20)
        size = max(min(state, last_level), 1 << 20)
        self.buffer = torch.empty(size // 4, dtype=torch.float32, device=device)
        self.warm_below = 0 if device.type == "cuda" else _cpu_cache_bytes(lambda levels: 2 if 2 in levels else 0)
        self.hot: list[torch.Tensor] = []
        self.armed = True

    def arm(self, weights: list[torch.Tensor]) -> None:
        """Evict before the next runs if the op's ``weights`` would not stay in cache in a step."""
        held = sum(t.numel() * t.element_size() for t in weights)
        self.armed = bool(weights) and held >= self.warm_below

    def evict(self) -> None:
        if not self.armed:
            return
        self.buffer.zero_()
        for t in self.hot:
            if t.numel():
                t.detach().reshape(-1)[:: max(1, 64 // t.element_size())].sum()  # one element per cache line


def _cpu_cache_bytes(pick: Callable[[dict[int, int]], int]) -> int:
    """The size of the CPU cache level ``pick`` chooses from {level: bytes} (0 if unknown)."""
    sizes: dict[int, int] = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes[level] = max(sizes.get(level, 0), int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return sizes.get(pick(sizes), 0) if sizes else 0


def _describe_inputs(args: tuple, kwargs: dict) -> dict[str, Any]:
    def describe(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
        return repr(v)
    return {"args": [pytree.tree_map(describe, a) for a in args],
            "kwargs": {k: pytree.tree_map(describe, v) for k, v in kwargs.items()}}
