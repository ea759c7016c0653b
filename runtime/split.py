"""Cut the traced program into per-stage fx GraphModules along a Plan, and derive what crosses between them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from partitioner.trace import is_inplace, node_state_names, op_nodes

__all__ = [
    "SplitError",
    "StageProgram",
    "SplitProgram",
    "LeafMeta",
    "ValueMeta",
    "split_program",
    "propagate_meta",
    "local_tensor_ids",
]

#: Key of the model output in a stage program's result dict (fx names never start with "__").
OUTPUT_KEY = "__output__"


class SplitError(ValueError):
    """The traced program cannot be cut along the Plan; the message says why and what to do."""


@dataclass
class StageProgram:
    """One stage: its GraphModule and how to feed it and read it.

    ``gm(*inputs)`` takes the model inputs it reads (``input_names``, placeholders of
    the traced program) followed by the values computed on earlier stages
    (``external``), and returns ``{value name: value}`` for every value a later stage
    reads, plus ``OUTPUT_KEY`` -> the model output on the output stage.
    """

    stage: int
    gm: fx.GraphModule
    input_names: list[str]            # model placeholders read here, in placeholder order
    input_index: list[int]            # their positions among the traced program's placeholders
    external: list[str]               # values made on earlier stages, in graph order
    produces: list[str]               # values sent to later stages, in graph order
    has_output: bool
    mutated_inputs: set[str] = field(default_factory=set)  # inputs some op here changes in place
    tensor_ids: set[int] = field(default_factory=set)       # ids of the parameters/buffers it reads


@dataclass
class SplitProgram:
    """All stage programs of a traced program under a Plan, and the table of what crosses where.

    ``edge_values[(src, dst, tensor)]`` lists the fx values a schedule edge carries, in
    graph order (several when a tuple-returning op is cut after its getitems).
    ``value_src[v]`` is the stage that makes value ``v``.
    """

    stages: dict[int, StageProgram]
    edge_values: dict[tuple[int, int, str], list[str]]
    value_src: dict[str, int]
    output_stage: int
    out_spec: Any = None  # pytree spec rebuilding an export program's output
    no_edge: dict[str, tuple[int, int]] = field(default_factory=dict)  # values crossing without a plan edge
    dropped_outputs: list[str] = field(default_factory=list)  # model outputs made off the output stage, not moved


@dataclass(frozen=True)
class LeafMeta:
    """One leaf of a cut value: a tensor (shape, dtype) or a Python constant derived from shapes."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    const: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None


@dataclass(frozen=True)
class ValueMeta:
    """A cut value as a pytree: its structure and leaves."""

    spec: Any
    leaves: tuple[LeafMeta, ...]

    def tensor_leaves(self) -> list[LeafMeta]:
        return [leaf for leaf in self.leaves if leaf.is_tensor]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The value from its tensor leaves (in order) and its recorded constants."""
        it = iter(tensors)
        leaves = [next(it) if leaf.is_tensor else leaf.const for leaf in self.leaves]
        return pytree.tree_unflatten(leaves, self.spec)

    @staticmethod
    def tensors_of(value: Any) -> list[torch.Tensor]:
        return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


_CALL_OPS = ("call_module", "call_function", "call_method")


def _args_nodes(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def _stage_tensor_names(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> set[str]:
    """Parameter/buffer/constant names the given nodes read (via modules or get_attr)."""
    names: set[str] = set()
    for node in nodes:
        params, buffers = node_state_names(node)
        names.update(params)
        names.update(buffers)
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            names.update(f"{node.target}.{n}" for n, _ in sub.named_parameters(remove_duplicate=False))
            names.update(f"{node.target}.{n}" for n, _ in sub.named_buffers(remove_duplicate=False))
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                names.add(str(arg.target))
    return names


def _resolve(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def split_program(gm: fx.GraphModule, fx_stage_of: Mapping[str, int], num_stages: int,
                  edges: Sequence[tuple[int, int, str]], stages: Sequence[int],
                  fx_to_op: Mapping[str, str] | None = None) -> SplitProgram:
    """Build the GraphModules of ``stages`` (this rank's) from the traced program.

    ``fx_stage_of`` is the Plan's map from call-node name to stage; ``edges`` the
    schedule's cut edges ``(src, dst, op name)``. A value read on a later stage crosses
    under the edge named by the op that makes it (``op_nodes`` ownership); a value
    read on a stage with no such edge in the Plan is an error (the Plan does not
    describe this program). Non-tensor values (sizes, dtypes) are never sent: they are
    derived from shapes on every rank (see ``propagate_meta``).
    """
    _, owner = op_nodes(gm)
    fx_to_op = dict(fx_to_op or {})

    def edge_name(node: fx.Node) -> str:
        # the plan names an edge by its OpGraph node (an op, or the first op of a coarsened group)
        return fx_to_op.get(node.name, fx_to_op.get(owner[node].name, owner[node].name))

    nodes = list(gm.graph.nodes)
    stage_of: dict[fx.Node, int] = {}
    missing = []
    for node in nodes:
        if node.op in _CALL_OPS:
            s = fx_stage_of.get(node.name)
            if s is None:
                missing.append(node.name)
            else:
                stage_of[node] = int(s)
    if missing:
        raise SplitError(f"the plan assigns no stage to {len(missing)} op(s) of this program "
                         f"(e.g. {missing[:3]}): it was made for another model or another trace; re-plan")
    for node, s in stage_of.items():
        if not 0 <= s < num_stages:
            raise SplitError(f"the plan puts op {node.name} on stage {s}, outside 0..{num_stages - 1}")
    output_node = next(n for n in nodes if n.op == "output")
    out_producers = [n for n in output_node.all_input_nodes if n in stage_of]
    output_stage = max((stage_of[n] for n in out_producers), default=num_stages - 1)

    # Who reads what: value -> stages that read it (other than its own)
    readers: dict[fx.Node, set[int]] = {}
    for node in nodes:
        if node.op in _CALL_OPS:
            s = stage_of[node]
            for arg in node.all_input_nodes:
                if arg in stage_of and stage_of[arg] != s:
                    if stage_of[arg] > s:
                        raise SplitError(
                            f"op {node.name} (stage {s}) reads {arg.name} from the later stage {stage_of[arg]}: "
                            "stages must form a pipeline (data flows to higher stages); the plan is inconsistent "
                            "with this program, re-plan")
                    readers.setdefault(arg, set()).add(s)
    edge_set = set(edges)
    dropped: set[str] = set()
    for arg in out_producers:
        if stage_of[arg] != output_stage:
            if (stage_of[arg], output_stage, edge_name(arg)) in edge_set or arg in readers:
                readers.setdefault(arg, set()).add(output_stage)
            else:
                # an extra output made elsewhere (e.g. HF's encoder_last_hidden_state) that the plan does
                # not move: the output stage returns None in its place rather than ship it
                dropped.add(arg.name)

    edge_values: dict[tuple[int, int, str], list[str]] = {e: [] for e in edges}
    value_src: dict[str, int] = {}
    no_edge: dict[str, tuple[int, int]] = {}
    for node in nodes:  # graph order keeps every edge's value list identical on every rank
        for dst in sorted(readers.get(node, ())):
            src = stage_of[node]
            key = (src, dst, edge_name(node))
            value_src[node.name] = src
            if key in edge_set:
                edge_values[key].append(node.name)
            else:
                # No edge: only legal for values without tensors (sizes...), which the
                # plan drops because they have no bytes. Checked against shapes later.
                no_edge[node.name] = (src, dst)

    programs: dict[int, StageProgram] = {}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for s in stages:
        programs[s] = _build_stage(gm, nodes, placeholders, stage_of, readers, s, s == output_stage, output_node,
                                   dropped)
    out_spec = None
    codegen = gm.graph._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):
        out_spec = codegen.pytree_info.out_spec
    return SplitProgram(programs, edge_values, value_src, output_stage, out_spec, no_edge, sorted(dropped))


def _build_stage(gm: fx.GraphModule, nodes: list[fx.Node], placeholders: list[fx.Node],
                 stage_of: Mapping[fx.Node, int], readers: Mapping[fx.Node, set[int]], s: int,
                 has_output: bool, output_node: fx.Node, dropped: set[str]) -> StageProgram:
    mine = [n for n in nodes if stage_of.get(n) == s]
    needed: list[fx.Node] = []
    for n in mine:
        needed.extend(n.all_input_nodes)
    if has_output:
        needed.extend(n for n in output_node.all_input_nodes if n.name not in dropped)
    needed_set = set(needed)
    inputs = [p for p in placeholders if p in needed_set]
    external = [n for n in nodes if n in needed_set and n in stage_of and stage_of[n] != s]

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in inputs:
        env[p] = graph.placeholder(p.name)
    for n in external:
        env[n] = graph.placeholder(n.name)

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:
            if n.op == "get_attr":
                env[n] = graph.get_attr(str(n.target))
            else:  # cannot happen for a consistent split: say so rather than KeyError
                raise SplitError(f"stage {s}: value {n.name} is neither made here nor received")
        return env[n]

    for n in mine:
        env[n] = graph.node_copy(n, lookup)
    produces = [n for n in mine if any(r > s for r in readers.get(n, ()))]
    result: dict[str, Any] = {n.name: env[n] for n in produces}
    if has_output:
        result[OUTPUT_KEY] = fx.node.map_arg(output_node.args[0],
                                             lambda n: None if n.name in dropped else lookup(n))  # type: ignore[arg-type,return-value]
    graph.output(result)
    graph.lint()
    stage_gm = fx.GraphModule(gm, graph, f"{type(gm).__name__}Stage{s}")
    mutated = {n.name for n in inputs + external
               if any(is_inplace(u, gm) and u.args and u.args[0] is n for u in n.users if stage_of.get(u) == s)}
    tensor_names = _stage_tensor_names(gm, mine)
    ids = set()
    for name in tensor_names:
        try:
            t = _resolve(gm, name)
        except AttributeError:
            continue
        if isinstance(t, torch.Tensor):
            ids.add(id(t))
    idx = {p: i for i, p in enumerate(placeholders)}
    return StageProgram(s, stage_gm, [p.name for p in inputs], [idx[p] for p in inputs], [n.name for n in external],
                        [n.name for n in produces], has_output, mutated, ids)


def local_tensor_ids(program: SplitProgram) -> set[int]:
    """Ids of every parameter/buffer the given stage programs read."""
    ids: set[int] = set()
    for prog in program.stages.values():
        ids |= prog.tensor_ids
    return ids


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, wanted: set[str]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.wanted = wanted
        self.seen: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.wanted:
            self.seen[n.name] = out
        return out


class _Holder(nn.Module):
    """Lets torch.func.functional_call swap every parameter and buffer of the traced program."""

    def __init__(self, gm: fx.GraphModule, wanted: set[str]) -> None:
        super().__init__()
        self.gm = gm
        self.wanted = wanted

    def forward(self, *flat: Any) -> dict[str, Any]:
        rec = _Recorder(self.gm, self.wanted)
        rec.run(*flat)
        return rec.seen


def propagate_meta(gm: fx.GraphModule, flat_inputs: Sequence[Any], wanted: set[str],
                   state_meta: Mapping[str, tuple[tuple[int, ...], torch.dtype, torch.device]]) -> dict[str, ValueMeta]:
    """Shapes/dtypes of the wanted values for one microbatch, without computing anything.

    Runs the whole traced program under FakeTensorMode with every parameter and buffer
    replaced by a fake tensor of its recorded shape (``state_meta``), so it works on a
    rank that no longer holds other stages' weights. Deterministic: every rank derives
    the same shapes from the same batch, so no shape handshake is needed, and a batch
    of another shape is simply re-derived. Values with no tensors (``x.size(0)``) are
    recorded as constants and fed to their readers instead of being sent.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.random.fork_rng(devices=[]), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state = {f"gm.{name}": torch.empty(shape, dtype=dtype, device=device)
                 for name, (shape, dtype, device) in state_meta.items()}
        fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
        holder = _Holder(gm, wanted)
        seen = torch.func.functional_call(holder, state, tuple(fake_inputs), strict=False, tie_weights=False)
        out: dict[str, ValueMeta] = {}
        for name, value in seen.items():
            leaves, spec = pytree.tree_flatten(value)
            metas = []
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    metas.append(LeafMeta(tuple(int(d) for d in leaf.shape), leaf.dtype))
                else:
                    metas.append(LeafMeta(None, None, leaf))
            out[name] = ValueMeta(spec, tuple(metas))
    return out


def state_meta_of(gm: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype, torch.device]]:
    """Shape, dtype and device of every parameter and buffer (by every name), recorded before weights are dropped."""
    out = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        out[name] = (tuple(t.shape), t.dtype, t.device)
    return out
