"""Measured timing: ops timed for real in whole-program sweeps, or one at a time with only their own weights real."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from partitioner.cuda_timing import GpuTimer
from partitioner.profile_ops import OpCaller, fresh_args, requires_grad
from partitioner.program import is_inplace

__all__ = ["SweepTimer", "OneOpAtATime", "materialized", "to_device", "time_whole_model", "PROFILE_THREADS",
           "UNSTABLE_SPREAD", "RETRIES", "profiling_threads", "sweep_totals", "sweep_spread", "unstable_timing_warning"]

OpTimes = tuple[dict[fx.Node, float], dict[fx.Node, float], dict[fx.Node, float]]
Samples = dict[fx.Node, list[float]]  # every op's seconds, one entry per timed sweep

#: CPU threads ops are timed with by default. One: with several, every parallel op waits at its barrier
#: for the slowest thread, and on a busy machine one of them is often descheduled for a whole time
#: slice, which turned a 50 us op sum into 83 ms; one thread slows by at most the contention.
PROFILE_THREADS = 1
#: Relative spread of the per-sweep totals ((max - min) / median) above which timings are unstable.
UNSTABLE_SPREAD = 0.5
#: How many more sets of ``repeats`` sweeps unstable sweeps get (the medians are over all of them).
RETRIES = 2
#: What times an op on a CPU (a name of its own: tests give the profiler a fake clock through it).
clock = time.perf_counter


@contextlib.contextmanager
def profiling_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for a while (None: left as they are), then restored."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sweep_totals(samples: Samples) -> list[float]:
    """Each sweep's seconds summed over its ops (ops without samples, such as those with no backward, left out)."""
    return [sum(sweep) for sweep in zip(*(v for v in samples.values() if v))]


def sweep_spread(totals: Sequence[float]) -> float:
    """(max - min) / median of the sweeps' totals: how steady the timings were; 0 under two sweeps."""
    if len(totals) < 2 or statistics.median(totals) <= 0:
        return 0.0
    return (max(totals) - min(totals)) / statistics.median(totals)


def unstable_timing_warning(spread: float | None) -> str | None:
    """What a profile whose sweeps spread by ``spread`` should warn of (None: stable enough, or not measured)."""
    if spread is None or spread <= UNSTABLE_SPREAD:
        return None
    return (f"unstable timings: the profile's sweeps differed by {spread:.0%} of their median "
            f"(over {UNSTABLE_SPREAD:.0%}, after more sweeps); is the machine busy? "
            f"Its times, and the plan's predicted step time, may be off by that much")


class SweepTimer:
    """Times ops within whole passes over them, as a training step runs them."""

    def __init__(self, ops: OpCaller, device: torch.device, *, repeats: int, warmup: int,
                 before_each: Callable[[], None] | None = None, retries: int = RETRIES) -> None:
        self.ops = ops
        self.repeats = repeats
        self.warmup = warmup
        self.before_each = before_each  # run before each timed call (None: caches as the sweep leaves them)
        self.retries = retries  # more sets of sweeps when the totals spread over UNSTABLE_SPREAD
        self.gpu_timer = GpuTimer(device) if device.type == "cuda" else None
        # per kind of sweep (forward, backward, input gradient): every sweep's seconds, op by op, summed
        # over every measure() call (one op at a time: the r-th run of every op makes the r-th sweep)
        self.kept: dict[str, list[float]] = {}

    @property
    def spread(self) -> float:
        """The largest relative spread of the sweeps' totals over the kinds of sweep (see ``sweep_spread``)."""
        return max((sweep_spread(totals) for totals in self.kept.values()), default=0.0)

    def measure(self, calls: list[tuple[fx.Node, tuple, dict, Any]], tick: Callable[[int], None]) -> OpTimes:
        """Forward, backward and input-gradient seconds of every op, timed within whole passes.

        Each repeat is a sweep over every op in program order (forward), or a forward
        that keeps every op's autograd graph followed by a sweep in reverse order
        (backward), so caches hold what they hold in a real step: timing one op again
        and again on the same data keeps its weights hot and underestimates it when they
        do not fit in cache (-30% to -40% on CPU for 2 MB weight matrices). Median of
        ``repeats`` after ``warmup`` sweeps; a set of sweeps whose totals spread over
        ``UNSTABLE_SPREAD`` gets more sweeps (``_pooled``).
        """
        ops = self.ops

        def forward_sweeps(warmup: int, tick: Callable[[], None]) -> Samples:
            fwd: Samples = {node: [] for node, *_ in calls}
            for r in range(warmup + self.repeats):
                with torch.set_grad_enabled(ops.training):
                    for node, args, kwargs, _ in calls:
                        call_args, call_kwargs = fresh_args(args, kwargs, is_inplace(node, ops.gm))
                        elapsed = self._timed(lambda: ops.call(node, call_args, call_kwargs), (node, "fwd"))
                        if r >= warmup:
                            fwd[node].append(elapsed)
                tick()
            return fwd

        fwd = self._pooled("fwd", forward_sweeps, tick=lambda: tick(len(calls)))
        trainable = [(node, args, kwargs) for node, args, kwargs, out in calls
                     if ops.training and requires_grad(out)]
        # A training step's backward accumulates weight gradients into .grad: from the
        # second microbatch on, that adds a read-modify-write of every weight, which matters
        # for memory-bound weights. Time it that way, on zeroed gradients restored afterwards.
        weights = {id(p): p for node, *_ in trainable for p in ops.weights(node)}
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
        with_weights = [c for c in trainable if ops.weights(c[0])]
        bwd_input = dict(bwd)
        bwd_input.update(self._backward_sweeps(with_weights, weights=False, tick=lambda: tick(len(calls))))
        zero = dict.fromkeys(fwd, 0.0)
        return fwd, {**zero, **bwd}, {**zero, **{n: min(bwd_input[n], bwd[n]) for n in bwd}}

    def _pooled(self, kind: str, sweeps: Callable[[int, Callable[[], None]], Samples], *,
                tick: Callable[[], None]) -> dict[fx.Node, float]:
        """Median seconds per op from ``sweeps(warmup, tick)``, with more sweeps while their totals spread too much.

        When the sweeps' totals spread over ``UNSTABLE_SPREAD`` (another process took the CPU or
        GPU for a while), up to ``retries`` more sets of ``repeats`` sweeps are run, without
        warm-up, and every op's median is taken over all of them: a median over more sweeps is
        less moved by the ones the machine slowed. The extra sweeps tick no progress: the
        total was announced."""
        pool = sweeps(self.warmup, tick)
        for _ in range(self.retries):
            if sweep_spread(sweep_totals(pool)) <= UNSTABLE_SPREAD:
                break
            for node, more in sweeps(0, lambda: None).items():
                pool[node].extend(more)
        totals = sweep_totals(pool)
        so_far = self.kept.setdefault(kind, [])
        if totals:
            self.kept[kind] = [a + b for a, b in zip(so_far, totals)] if so_far else totals
        return {node: statistics.median(v) if v else 0.0 for node, v in pool.items()}

    def _backward_sweeps(self, ops: list[tuple[fx.Node, tuple, dict]], *, weights: bool,
                         tick: Callable[[], None], accumulate: bool = False) -> dict[fx.Node, float]:
        """Median backward seconds per op: forward every op, then time their backwards in reverse order.

        ``tick`` is called once per sweep."""
        caller = self.ops
        prepared = [(node, caller.backward_closure(node, args, kwargs, is_inplace(node, caller.gm),
                                                   caller.grad_inputs(node, args, kwargs), weights, accumulate))
                    for node, args, kwargs in ops]

        def backward_sweeps(warmup: int, tick: Callable[[], None]) -> Samples:
            samples: Samples = {node: [] for node, *_ in ops}
            for r in range(warmup + self.repeats):
                runs = [(node, prepare()) for node, prepare in prepared if prepare is not None]
                for node, run in reversed(runs):
                    elapsed = self._timed(run, (node, "bwd", weights))
                    if r >= warmup:
                        samples[node].append(elapsed)
                del runs
                tick()
            return samples

        return self._pooled("bwd" if weights else "bwd_input", backward_sweeps, tick=tick)

    def _timed(self, fn: Callable[[], Any], site: Hashable) -> float:
        """Seconds ``fn`` takes (its kernels' time on a GPU); ``site`` names the call for the GPU timer."""
        if self.before_each is not None:
            self.before_each()
        if self.gpu_timer is not None:
            return self.gpu_timer(fn, site)
        begin = clock()
        fn()
        return clock() - begin


# ------------------------------------------------------------------ one op's weights at a time


class OneOpAtATime:
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
        self.ops = OpCaller(gm, training=training)
        self.device = device
        self.inputs = inputs
        self.cold = _CacheEvictor(gm, device)
        # No re-measuring here: one op's few runs spread more than a whole sweep does, and re-measuring
        # each op would multiply the cost; the spread is still told, from every op's runs summed.
        self.timer = SweepTimer(self.ops, device, repeats=repeats, warmup=warmup, before_each=self.cold.evict,
                                retries=0)

    def measure(self, wanted: list[fx.Node], tick: Callable[[int], None]) -> OpTimes:
        """Forward, backward and input-gradient seconds of the ``wanted`` ops (nodes of the
        caller's program, matched to this copy's by name)."""
        by_name = {node.name: node for node in wanted}
        order = list(self.ops.gm.graph.nodes)
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
                value = self.ops.fetch(str(node.target))
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
        args, kwargs = self.ops.args(node, env)
        with self._own_state(node) as state:
            args, kwargs = pytree.tree_map_only(  # resolved once, not inside the timed calls
                _Attr, lambda a: self.ops.fetch(a.name), (args, kwargs))
            with torch.set_grad_enabled(self.ops.training):
                out = _detached(self.ops.call(node, args, kwargs))  # its graph would keep the weights
            if not timed:
                return out, (0.0, 0.0, 0.0)
            self.cold.arm(state)
            weights = {id(t) for t in state}  # read back the activations only: the weights stay cold
            self.cold.hot = [t for t in pytree.tree_leaves((args, kwargs))
                             if isinstance(t, torch.Tensor) and id(t) not in weights]
            try:
                fwd, bwd, bwd_input = self.timer.measure([(node, args, kwargs, out)], tick)
            finally:
                self.cold.hot = []
            return out, (fwd[node], bwd[node], bwd_input[node])

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
                owner = self.ops.gm.get_submodule(prefix)
                tensor = getattr(owner, leaf, None)
                if not isinstance(tensor, torch.Tensor) or tensor.device == self.device:
                    continue
                real = made.setdefault(id(tensor), materialized(tensor, self.device))  # tied: one copy
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


@dataclass(frozen=True)
class _Attr:
    """A parameter, buffer or constant the program fetches, resolved when an op runs (one op at a time)."""

    name: str


def to_device(value: Any, device: torch.device) -> Any:
    """``value``'s tensors on ``device``; a meta tensor sent to a real device is given values."""
    def place(t: torch.Tensor) -> torch.Tensor:
        return materialized(t, device) if t.is_meta and device.type != "meta" else t.to(device)
    return pytree.tree_map_only(torch.Tensor, place, value)


def materialized(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
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


# ------------------------------------------------------------------ the whole model


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
