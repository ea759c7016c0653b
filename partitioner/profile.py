"""Profile a traced model op by op into an OpGraph: forward/backward time, bytes, FLOPs.

The walk over the program and what it records (bytes saved, state read, FLOPs) live here;
the times come from ``profile_measured`` (run for real) or ``profile_analytic`` (priced).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from partitioner.checks import whole
from partitioner.devices import DeviceSpec
from partitioner.graph import OpGraph
from partitioner.profile_analytic import analytic_costs
from partitioner.profile_autocast import autocast_walk, running_autocast, walk_autocast
from partitioner.profile_measured import (PROFILE_THREADS, OneOpAtATime, SweepTimer, profiling_threads, to_device,
                                         unstable_timing_warning)
from partitioner.profile_ops import OpCaller, OpCosts, count_kernels, fresh_args, requires_grad, tensor_bytes
from partitioner.program import flatten_inputs, is_inplace, op_nodes, retarget_device
from partitioner.trace import TraceError, trace

__all__ = ["profile", "TIMINGS"]

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
    threads: int | None = PROFILE_THREADS,
    compiled: bool = False,
) -> OpGraph:
    """Trace ``model`` on the sample and cost every op; returns an ``OpGraph``.

    ``timing="measured"`` runs each op on its own inputs (warm-up, then the median of
    ``repeats``; CUDA events on a GPU) and times its backward with autograd on a random
    output gradient. A model whose weights are on the meta device is measured on ``device``
    (default: CUDA when available, else the CPU) **one op at a time**: only the op being run
    has its weights materialized there (random values), so a model larger than the device
    can still be timed on it. ``timing="analytic"`` counts FLOPs (``torch.utils.flop_counter``) and
    bytes moved and prices them on ``device_profile`` (a name in profiles/ or a path;
    ``dtype="bf16"`` or ``"fp16"`` prices a mixed-precision run: the walk runs under ``torch.autocast``, on
    fake CPU tensors for a model on meta, ``partitioner.profile_autocast``): this plans a GPU cluster from
    a laptop, and works on a model built on the meta device. ``device`` moves the model
    there for the duration of the call (it is moved back afterwards, its buffers restored).

    Measured on a CPU, the ops run on ``threads`` intra-op threads (default 1, the steadiest on a
    busy machine; None: torch's setting as it is), restored afterwards. ``compiled``: the stages will run
    compiled with ``torch.compile``; analytic prices then leave out the per-op dispatch
    (:meth:`DeviceSpec.compiled`), measured times stay the eager ops' (docs/cost-model.md#compiled-stages). The relative spread of
    the sweeps' totals is recorded as ``graph.meta["timing_spread"]``: a set of sweeps spread over
    ``UNSTABLE_SPREAD`` gets more sweeps, and if the spread stays above it a warning says so.
    """
    if timing not in TIMINGS:
        raise ValueError(f"unknown timing {timing!r}; choose 'measured' or 'analytic'")
    whole(repeats, "repeats", error=ValueError)
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
        if compiled:
            spec = spec.compiled()
    # One op at a time: bytes and FLOPs are counted on meta as analytic timing counts them;
    # the times come from a second walk, on the target, with real values.
    walked_on = home if one_at_a_time else target
    threads = threads if timing == "measured" and target.type == "cpu" else None
    real_args, real_kwargs = to_device((args, kwargs), target) if one_at_a_time else ((), {})
    args, kwargs = to_device((args, kwargs), walked_on)
    # Profiling draws random numbers (dropout, output gradients): the caller's stream must not notice.
    with _borrowed(model, walked_on, training), profiling_threads(threads), \
            torch.random.fork_rng(devices=[target] if target.type == "cuda" else []):
        gm = graph_module if graph_module is not None else trace(
            model, args, kwargs, frontend=frontend, leaf_modules=leaf_modules)
        try:
            inputs = flatten_inputs(gm, args, kwargs)
            alone = None
            if one_at_a_time:
                real_gm = _retargeted_copy(gm, home, target)
                alone = OneOpAtATime(real_gm, target, flatten_inputs(gm, real_args, real_kwargs),
                                     training=training, repeats=repeats, warmup=warmup)
        except TypeError as err:
            raise TraceError(f"the sample inputs do not match the traced model: {err}") from None
        # a low-precision dtype prices a mixed-precision run: the walk runs under autocast, and each op is priced
        # in the dtype it runs in there (a matmul in bf16, an fp32 reduction in fp32), as a pipeline's own profile is
        low = walk_autocast(dtype, walked_on) if timing == "analytic" else None
        autocast = dtype if low is not None else running_autocast(walked_on)  # what the walk runs under
        walk = autocast_walk(gm, inputs, walked_on, low) if low is not None else contextlib.nullcontext((gm, inputs))
        with walk as (walked_gm, walked_inputs):
            runner = _OpRunner(walked_gm, walked_on, training=training, timing=timing, spec=spec,
                               dtype=None if autocast is not None else dtype, repeats=repeats, warmup=warmup,
                               alone=alone)
            graph = runner.run(walked_inputs, progress)
        used_threads = torch.get_num_threads() if timing == "measured" and target.type == "cpu" else None
    info = gm.meta.get("smp_trace")
    spread = runner.timing_spread
    graph.meta.update({
        "model": type(model).__name__,
        "frontend": getattr(info, "frontend", "unknown"),
        "timing": timing,
        "device": str(target),
        "device_profile": spec.name if spec else None,
        "dtype": dtype,
        "autocast": autocast,
        "repeats": repeats if timing == "measured" else None,
        "threads": used_threads,
        "timing_spread": None if spread is None else round(spread, 4),
        "one_op_at_a_time": one_at_a_time,
        "training": training,
        "compiled": compiled,
        "torch": torch.__version__,
        "inputs": _describe_inputs(args, kwargs),
    })
    unstable = unstable_timing_warning(spread)
    if unstable is not None:
        warnings.warn(f"profiling {type(model).__name__}: {unstable}", RuntimeWarning, stacklevel=2)
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


# ------------------------------------------------------------------ the op runner


class _OpRunner:
    """Walks the graph in program order, running and costing one op at a time."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, *, training: bool, timing: str,
                 spec: DeviceSpec | None, dtype: str | None, repeats: int, warmup: int,
                 alone: OneOpAtATime | None = None):
        self.gm = gm
        self.ops = OpCaller(gm, training=training)
        self.alone = alone  # set: the ops are timed one at a time there, with their own weights
        self.training = training
        self.timing = timing
        self.spec = spec
        self.dtype = dtype
        self.repeats = repeats
        self.warmup = warmup
        # measured, in context: each op timed within sweeps over the whole program on ``device``
        self.in_context = SweepTimer(self.ops, device, repeats=repeats, warmup=warmup) \
            if timing == "measured" and alone is None else None
        self._costs: dict[str, OpCosts] = {}  # by _cost_key: the 80 blocks of an LLM are costed once

    @property
    def timing_spread(self) -> float | None:
        """How much the measured sweeps' totals spread (relative; None when analytic)."""
        timer = self.alone.timer if self.alone is not None else self.in_context
        return None if timer is None else timer.spread

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
                env[node] = self.ops.fetch(str(node.target))
                continue
            if node.op == "output":
                self._add_output(g, node, owner, index, env)
                continue
            args, kwargs = self.ops.args(node, env)
            if owner[node] is not node:  # getitem: plumbing that belongs to its producer
                with torch.set_grad_enabled(self.training), saved.during(owner[node].name):
                    env[node] = self.ops.call(node, args, kwargs)
                saved.made(owner[node].name, env[node])  # a getitem's piece of its producer's output
                g.nodes[owner[node].name]["fx_nodes"] += (node.name,)
                continue
            with torch.set_grad_enabled(self.training), saved.during(node.name), _KernelOutputs(saved.alive) as kernels:
                out = self.ops.call(node, args, kwargs)
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
                out_bytes=tensor_bytes(out),
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
                                   else self.in_context.measure(calls, tick))
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
            tensor_bytes(env[p], at_least=4) for p in {owner[p] for p in node.all_input_nodes if p in owner})
        for producer in node.all_input_nodes:
            if producer in owner:
                g.add_edge(owner[producer].name, node.name)

    # -------------------------------------------------------------- what one op reads and costs

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
                tensor = self.ops.fetch(name)
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

    def _cost(self, node: fx.Node, args: tuple, kwargs: dict, out: Any) -> OpCosts:
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
        state = {id(t) for t in self.ops.state_tensors(node)}

        def describe(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return ("state" if id(value) in state else "tensor", tuple(value.shape), value.dtype,
                        value.requires_grad)
            return value

        described = pytree.tree_map(describe, (args, kwargs, out))
        text = repr((head, is_inplace(node, self.gm), self.training, described,
                     [(tuple(t.shape), t.dtype, t.requires_grad) for t in self.ops.state_tensors(node)]))
        return None if " at 0x" in text else text  # an object known only by its address: no key

    def _count_cost(self, node: fx.Node, args: tuple, kwargs: dict, out: Any) -> OpCosts:
        inplace = is_inplace(node, self.gm)
        kernels_fwd = count_kernels(lambda: self.ops.call(node, *fresh_args(args, kwargs, inplace)))
        if self.timing == "analytic":
            assert self.spec is not None
            needs_bwd = self.training and requires_grad(out)
            return analytic_costs(self.ops, self.spec, self.dtype, node, args, kwargs, out,
                                  self.ops.grad_inputs(node, args, kwargs), needs_bwd, kernels_fwd, inplace)
        return OpCosts(0.0, 0.0, 0.0, sum(k.flops for k in kernels_fwd))


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


def _measuring_device() -> torch.device:
    """Where a model built on meta is timed when no device is named: the GPU if there is one."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _retargeted_copy(gm: fx.GraphModule, old: torch.device, new: torch.device) -> fx.GraphModule:
    """A copy of the traced program whose device constants name ``new`` instead of ``old``
    (the caller's program, and its fingerprint, stay as traced)."""
    gm = copy.deepcopy(gm)
    retarget_device(gm, old, new)
    return gm


def _describe_inputs(args: tuple, kwargs: dict) -> dict[str, Any]:
    def describe(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
        return repr(v)
    return {"args": [pytree.tree_map(describe, a) for a in args],
            "kwargs": {k: pytree.tree_map(describe, v) for k, v in kwargs.items()}}
