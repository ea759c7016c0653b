"""Tensor parallelism's price: a profiled op graph's costs rewritten for each stage's modules split over T ranks."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from partitioner.cluster import Cluster, Link
from partitioner.errors import PlanError
from partitioner.graph import OUTPUT_OP, OpGraph
from partitioner.ir import ScheduleKind
from partitioner.tp_graph import ModuleSplit, SplitActivations, planned_module, split_activations
from partitioner.tp_plan import module_splits, resolve_tp_plan

__all__ = ["TensorParallelSplit", "tensor_parallel_split", "global_shapes", "tp_link", "price_tensor_parallel", "TP_COST_FIELDS",
           "runs_split", "not_run_split"]


def runs_split(schedule: str) -> bool:
    """Whether tensor-parallel stages run under ``schedule`` (not a split backward: the W passes would run the
    rowwise all-reduces' backward twice)."""
    return not ScheduleKind.parse(schedule).split_backward


def not_run_split(*, compiled: bool, schedules: Sequence[str]) -> str | None:
    """What of a request or a plan tensor-parallel stages do not run with yet (the one list: the request refuses
    it before planning, the runtime before running a plan made elsewhere), or None. Every recomputation choice
    runs split (runtime/recompute.py, runtime/offload.py)."""
    for why, bad in (("compiled stages (compile=True)", compiled),
                     (f"the zero-bubble schedule {next((s for s in schedules if not runs_split(s)), '')!r}",
                      not all(runs_split(s) for s in schedules))):
        if bad:
            return why
    return None

#: What the pricing adds to each op of the graph it rewrites (seconds and bytes, per tp rank).
TP_COST_FIELDS = {
    "tp_fwd_comm": "seconds of the op's tensor-parallel collectives in the forward (a rowwise output's all-reduce, a "
                   "colwise_rep output's all-gather), included in fwd",
    "tp_bwd_comm": "seconds of its collectives in the backward (a colwise input gradient's all-reduce, a rowwise_rep "
                   "one's all-gather), included in bwd",
    "tp_fwd_bytes": "bytes of the tensor the forward collective reduces or gathers (whole)",
    "tp_bwd_bytes": "bytes of the gradient the backward collective reduces or gathers (whole)",
    "tp_whole_fwd": "seconds of the op's forward on one device, unsplit (what a plan's speed-up compares with)",
    "tp_whole_bwd": "seconds of its backward on one device, unsplit",
}

#: An op's activation bytes: each tp rank holds its share of a split output.
_ACTIVATION_FIELDS = ("out_bytes", "saved_bytes", "saved_output_bytes", "storage_bytes", "kernel_bytes",
                      "kernel_saved_bytes", "kernel_output_bytes")
#: An op's compute: a split op runs on its share.
_COMPUTE_FIELDS = ("fwd", "bwd", "bwd_w", "flops")


@dataclass(frozen=True)
class _Shaped:
    """One leaf of a traced value: its shape (None for a constant) and its elements' bytes."""

    shape: tuple[int, ...] | None
    itemsize: int = 0

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None


@dataclass(frozen=True)
class _Value:
    leaves: tuple[_Shaped, ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(leaf.shape) for leaf in self.leaves if leaf.shape is not None)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(leaf.shape) * leaf.itemsize for leaf in self.leaves if leaf.shape is not None)


@dataclass(frozen=True)
class TensorParallelSplit:
    """What tensor parallelism over ``size`` ranks splits in a traced program: the plan's modules (by qualified
    name: how each splits, and the fraction of its parameters' elements that is split), the split activations,
    each value's global elements, and which module each op runs (found once per T, priced on any graph of it)."""

    size: int
    modules: Mapping[str, ModuleSplit]
    split_params: Mapping[str, float]  # module -> share of its parameters' elements split (a rowwise bias is whole)
    activations: SplitActivations
    numel: Mapping[str, int]  # fx value -> its elements (whole)
    nbytes: Mapping[str, int]  # fx value -> its bytes (whole)
    op_module: Mapping[str, str]  # fx node -> the plan's module it runs
    inputs: Mapping[str, tuple[str, bool]]  # a planned op -> (the value it reads, whether that gets a gradient)
    reads: Mapping[str, tuple[str, ...]]  # fx node -> the fx values it reads
    sequence_off: str | None = None  # why sequence parallelism does not run, when "auto" asked for it

    def is_split(self, value: str) -> bool:
        dim = self.activations.split.get(value)
        return any(d is not None for d in dim) if isinstance(dim, tuple) else dim is not None


def tensor_parallel_split(model: nn.Module, gm: fx.GraphModule, flat_inputs: Sequence[Any], size: int,
                          tp_plan: Mapping[str, Any] | None = None, *,
                          shapes: Mapping[str, Any] | None = None,
                          sequence_parallel: bool = False) -> TensorParallelSplit:
    """What ``size`` tp ranks split of ``gm`` (``model`` traced, run on ``flat_inputs``: one microbatch), by
    ``tp_plan`` (default the model's own, partitioner/tp_plan.py): the runtime's own checks and split-activation
    pass, so a T the model cannot split (heads, features) is refused here as it would be there. ``shapes``: the
    values' :func:`global_shapes`, when already known (they do not depend on T). ``sequence_parallel``: with
    sequence parallelism (the activations' ``sequence`` fields; a SequenceParallelError where it cannot run)."""
    modules = module_splits(model, resolve_tp_plan(model, tp_plan), size)
    shapes = global_shapes(gm, flat_inputs) if shapes is None else shapes
    acts = split_activations(gm, modules, shapes, size, sequence_parallel)
    op_module: dict[str, str] = {}
    inputs: dict[str, tuple[str, bool]] = {}
    for node in gm.graph.nodes:
        name = planned_module(node)
        if name in modules:
            op_module[node.name] = name
            x = node.args[0] if node.args else None
            if isinstance(x, fx.Node):
                floating = not isinstance(model.get_submodule(name), nn.Embedding)  # indices get no gradient
                inputs[node.name] = (x.name, floating)
    split_params = {}
    for name, how in modules.items():
        module = model.get_submodule(name)
        weight = module.weight.numel()
        bias = module.bias.numel() if getattr(module, "bias", None) is not None else 0
        split_params[name] = (weight + (0 if how.rowwise else bias)) / (weight + bias)
    reads = {n.name: tuple(a.name for a in n.all_input_nodes) for n in gm.graph.nodes}
    return TensorParallelSplit(size, modules, split_params, acts, {k: v.numel for k, v in shapes.items()},
                               {k: v.nbytes for k, v in shapes.items()},
                               op_module, inputs, reads)


def global_shapes(gm: fx.GraphModule, flat_inputs: Sequence[Any]) -> dict[str, Any]:
    """Every value's global shape for one microbatch, computing nothing: the program run on fake tensors (its
    weights, whatever device they are on or meta, faked on the inputs' device; a constant the program moves to
    a device of its own follows)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tensors = [x for x in flat_inputs if isinstance(x, torch.Tensor)]
    real = [x for x in tensors if not x.is_meta]
    # a program traced on meta inputs bakes device="meta" into the tensors it makes (positions, masks): its
    # weights are faked there too
    device = real[0].device if real else torch.device("meta" if tensors else "cpu")
    seen: dict[str, _Value] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            out = super().run_node(node)
            seen[node.name] = _Value(tuple(_Shaped(tuple(int(d) for d in x.shape), x.element_size())
                                           if isinstance(x, torch.Tensor) else _Shaped(None)
                                           for x in pytree.tree_leaves(out)))
            return out

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gm = gm

        def forward(self, *flat: Any) -> None:
            Recorder(self.gm).run(*flat)

    try:
        with torch.random.fork_rng(devices=[]), FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            state = {f"gm.{name}": torch.empty(t.shape, dtype=t.dtype, device=device) for name, t in
                     [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]}
            inputs = [(torch.empty(x.shape, dtype=x.dtype, device=device) if x.is_meta else mode.from_tensor(x))
                      if isinstance(x, torch.Tensor) else x for x in flat_inputs]
            torch.func.functional_call(Holder(), state, tuple(inputs), strict=False, tie_weights=False)
    except Exception as err:  # an op fake tensors cannot run (data-dependent shapes)
        raise PlanError(f"pricing tensor parallelism runs the traced model on fake tensors for its shapes, which "
                        f"failed: {type(err).__name__}: {err}") from None
    return seen


def tp_link(cluster: Cluster | None, size: int) -> Link:
    """The link a tensor-parallel group's collectives cross: the slowest among its ``size`` consecutive devices
    (the intra-node link when they share a node); free without a cluster."""
    if cluster is None or size < 2:
        return Link("free")
    if len(cluster) < size:
        raise PlanError(f"tensor_parallel={size} needs {size} devices in a group; the cluster has {len(cluster)}")
    return cluster.link(0, size - 1)


def price_tensor_parallel(graph: OpGraph, split: TensorParallelSplit, link: Link) -> OpGraph:
    """``graph`` (profiled whole, one microbatch) priced per tp rank of ``split``: the plan's modules and the ops
    on split activations run 1/T of the compute; a split value's bytes (and what it saves) are 1/T; the plan's
    modules hold 1/T of their split parameters; each rowwise output's all-reduce (forward) and each colwise input
    gradient's all-reduce (backward), ring collectives on ``link``, join the op's time. With sequence
    parallelism (``split.activations.sequence``) a rowwise output is reduce-scattered over the sequence instead
    (its gradient all-gathered), the ops on sequence shards run 1/T, and each gather or scatter between them and
    whole readers is charged to its first reader's op (:func:`_sequence_collectives`). A new graph (the
    profiled one is the T = 1 price); its meta records T and whether sequence parallelism runs."""
    t = split.size
    acts = split.activations
    whole_reads = {(reader, g.value) for g in acts.gathers if not g.colwise for reader in g.readers}
    between = _sequence_collectives(split, link)
    out = graph.nx.copy()
    for name, data in out.nodes(data=True):
        data.update(tp_fwd_comm=0.0, tp_bwd_comm=0.0, tp_fwd_bytes=0, tp_bwd_bytes=0, tp_whole_fwd=data["fwd"],
                    tp_whole_bwd=data["bwd"])
        if data["op"] == OUTPUT_OP:
            continue
        fx_nodes = tuple(data["fx_nodes"])
        module = next((split.op_module[n] for n in fx_nodes if n in split.op_module), None)
        split_out = any(split.is_split(n) for n in fx_nodes)
        # a reader of a whole gather reads the gathered (whole) value: it runs whole
        reads_split = any(split.is_split(v) and (n, v) not in whole_reads for n in fx_nodes
                          for v in split.reads.get(n, ()))
        whole_out = data["out_bytes"]
        if module is not None or split_out or reads_split:
            for f in _COMPUTE_FIELDS:
                if f in data:
                    data[f] = data[f] / t
        if split_out:
            for f in _ACTIVATION_FIELDS:
                if f in data:
                    data[f] = type(data[f])(data[f] / t)
        comm = [0.0, 0.0, 0, 0, 0]  # forward seconds, backward seconds, forward bytes, backward bytes, kept bytes
        for n in fx_nodes:
            for i, v in enumerate(between.get(n, ())):
                comm[i] += v
        if comm[4]:  # a gathered value its readers keep whole for their backward (a colwise Linear's input)
            data["saved_bytes"] = data.get("saved_bytes", 0) + int(comm[4])
        if module is not None:
            op = next(n for n in fx_nodes if n in split.op_module)
            for i, v in enumerate(_module_collectives(split, split.modules[module], op, whole_out, link)):
                comm[i] += v
            data["params"] = int(round(data["params"] * (1 - split.split_params[module] * (t - 1) / t)))
        data["tp_fwd_comm"], data["tp_bwd_comm"] = comm[0], comm[1]
        data["tp_fwd_bytes"], data["tp_bwd_bytes"] = int(comm[2]), int(comm[3])
        data["fwd"] += comm[0]
        data["bwd"] += comm[1]
    off = {"sequence_parallel_off": split.sequence_off} if split.sequence_off else {}
    return OpGraph(out, {**graph.meta, "tensor_parallel": t, "sequence_parallel": acts.sequence_parallel, **off})


def _module_collectives(split: TensorParallelSplit, how: ModuleSplit, op: str, whole_out: float,
                        link: Link) -> tuple[float, float, float, float]:
    """A planned module's own collectives (forward and backward seconds, their bytes): a rowwise output
    all-reduced (reduce-scattered over the sequence under sequence parallelism, its gradient then all-gathered),
    a colwise input's gradient all-reduced (not when the input is a sequence gather's: that gather's
    reduce-scatter sums it), a colwise_rep output all-gathered."""
    t = split.size
    acts = split.activations
    # bytes per element: the profiled output's (its dtype), over the value's elements
    per_element = whole_out / split.numel[op] if split.numel.get(op) else 0.0
    x, grad = split.inputs.get(op, ("", False))
    in_bytes = split.numel.get(x, 0) * per_element
    if how.rowwise:
        # on the sequence: a reduce-scatter, whose backward all-gathers the output's gradient; else an all-reduce
        fwd, bwd, bwd_bytes = (link.reduce_scatter_seconds(whole_out, t), link.allgather_seconds(whole_out, t),
                               whole_out) if op in acts.rowwise_scatter else (link.allreduce_seconds(whole_out, t),
                                                                              0.0, 0.0)
        if grad and not how.reads_split:  # rowwise_rep: each rank's slice of the whole input's gradient gathered
            bwd, bwd_bytes = bwd + link.allgather_seconds(in_bytes, t), bwd_bytes + in_bytes
        return fwd, bwd, whole_out, bwd_bytes
    fwd, fwd_bytes = (0.0, 0.0) if how.makes_split else (link.allgather_seconds(whole_out, t), whole_out)
    if grad and x not in acts.sequence:
        return fwd, link.allreduce_seconds(in_bytes, t), fwd_bytes, in_bytes
    return fwd, 0.0, fwd_bytes, 0.0


def _sequence_collectives(split: TensorParallelSplit, link: Link) -> dict[str, tuple[float, ...]]:
    """Sequence parallelism's collectives between ops, by the fx node of the first reader that pays them (forward
    and backward seconds, their bytes, and the bytes its readers keep beyond the shard): a gather (forward
    all-gather of a sequence shard, which its readers keep whole for their backward; backward, for colwise
    readers, a reduce-scatter of their summed partial gradients, for whole readers nothing: each takes its chunk)
    and a scatter (forward each rank's chunk, free; backward an all-gather of the gradient)."""
    t = split.size
    acts = split.activations
    paid: dict[str, tuple[float, ...]] = {}
    order = {name: i for i, name in enumerate(split.reads)}  # program order: the first reader runs it

    def charge(reader: str, *costs: float) -> None:
        paid[reader] = tuple(a + b for a, b in zip(paid.get(reader, (0.0,) * 5), costs))

    for g in acts.gathers:
        nbytes = split.nbytes.get(g.value, 0)
        back = link.reduce_scatter_seconds(nbytes, t) if g.colwise else 0.0
        charge(min(g.readers, key=order.__getitem__), link.allgather_seconds(nbytes, t), back, nbytes,
               nbytes if g.colwise else 0, nbytes - nbytes // t)
    for s in acts.scatters:
        nbytes = split.nbytes.get(s.value, 0)
        charge(min(s.readers, key=order.__getitem__), 0.0, link.allgather_seconds(nbytes, t), 0, nbytes, 0)
    return paid
