"""Cut the traced program into per-stage fx GraphModules along a Plan, and derive what crosses between them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from partitioner.program import is_inplace, node_state_names, op_nodes

__all__ = [
    "SplitError",
    "StageProgram",
    "SplitProgram",
    "LeafMeta",
    "ValueMeta",
    "split_program",
    "propagate_meta",
    "stage_state_names",
    "cut_edges",
    "carry_stages",
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


def stage_state_names(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> set[str]:
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


def split_program(gm: fx.GraphModule, fx_stage_of: Mapping[str, int], num_stages: int,
                  edges: Sequence[tuple[int, int, str]], stages: Sequence[int],
                  fx_to_op: Mapping[str, str] | None = None) -> SplitProgram:
    """Build the GraphModules of ``stages`` (this rank's) from the traced program.

    ``fx_stage_of`` maps every call node (and the output node, when the plan has one)
    to its stage; ``edges`` are the schedule's cut edges ``(src, dst, op name)``. A value
    read on a later stage crosses under the edge named by the op that makes it
    (``op_nodes`` ownership); a value read on a stage with no such edge in the plan is an
    error (the plan does not describe this program). Non-tensor values (sizes, dtypes)
    are never sent: they are derived from shapes on every rank (see ``propagate_meta``).
    """
    _, owner = op_nodes(gm)
    fx_to_op = dict(fx_to_op or {})

    def edge_name(node: fx.Node) -> str:
        # the plan names an edge by its OpGraph node (an op, or the first op of a coarsened group)
        return fx_to_op.get(node.name, fx_to_op.get(owner[node].name, owner[node].name))

    nodes = list(gm.graph.nodes)
    stage_of = _stages_of_calls(nodes, fx_stage_of, num_stages)
    output_node = next(n for n in nodes if n.op == "output")
    out_producers = [n for n in output_node.all_input_nodes if n in stage_of]
    # The output's stage is the plan's (its own node, which the cost model prices moving
    # every returned value to); a plan without one returns where the last value is made.
    output_stage = int(fx_stage_of.get(output_node.name, max((stage_of[n] for n in out_producers),
                                                             default=num_stages - 1)))
    readers = _readers(nodes, stage_of)
    for arg in out_producers:
        if stage_of[arg] > output_stage:
            raise SplitError(f"the model output reads {arg.name} from stage {stage_of[arg]}, after the output's "
                             f"stage {output_stage}: the plan is inconsistent with this program; re-plan")
        if stage_of[arg] != output_stage:
            readers.setdefault(arg, set()).add(output_stage)

    edge_set = set(edges)
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
        programs[s] = _build_stage(gm, nodes, placeholders, stage_of, readers, s, s == output_stage, output_node)
    out_spec = None
    codegen = gm.graph._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):
        out_spec = codegen.pytree_info.out_spec
    return SplitProgram(programs, edge_values, value_src, output_stage, out_spec, no_edge)


def _stages_of_calls(nodes: Sequence[fx.Node], fx_stage_of: Mapping[str, int], num_stages: int
                     ) -> dict[fx.Node, int]:
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
    return stage_of


def _readers(nodes: Sequence[fx.Node], stage_of: Mapping[fx.Node, int]) -> dict[fx.Node, set[int]]:
    """Value -> the other stages whose ops read it."""
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
    return readers


def cut_edges(gm: fx.GraphModule, fx_stage_of: Mapping[str, int]) -> list[tuple[int, int, str]]:
    """The cut edges ``(src, dst, producer op)`` a stage assignment of ``gm`` implies, output included."""
    _, owner = op_nodes(gm)
    nodes = list(gm.graph.nodes)
    stage_of = {n: int(fx_stage_of[n.name]) for n in nodes if n.op in _CALL_OPS}
    output_node = nodes[-1] if nodes and nodes[-1].op == "output" else next(n for n in nodes if n.op == "output")
    readers = _readers(nodes, stage_of)
    out_stage = fx_stage_of.get(output_node.name)
    if out_stage is not None:
        for arg in output_node.all_input_nodes:
            if arg in stage_of and stage_of[arg] != out_stage:
                readers.setdefault(arg, set()).add(int(out_stage))
    return sorted({(stage_of[v], dst, owner[v].name) for v, dsts in readers.items() for dst in dsts})


def carry_stages(source: fx.GraphModule, source_stage_of: Mapping[str, int], target: fx.GraphModule,
                 num_stages: int) -> dict[str, int]:
    """A stage for every node of ``target`` (the same model traced in another mode) that keeps state in place.

    An op that reads a parameter or buffer goes to a stage that holds it under the source
    assignment; another op keeps its source stage when the source has a node of that name,
    else follows its inputs; every op then runs no earlier than its inputs. Raises
    SplitError when that would move a parameter to a stage that does not hold it.
    """
    holders: dict[str, set[int]] = {}
    for node in source.graph.nodes:
        if node.name in source_stage_of and node.op in _CALL_OPS:
            for name in stage_state_names(source, [node]):
                holders.setdefault(name, set()).add(int(source_stage_of[node.name]))
    out: dict[str, int] = {}
    for node in target.graph.nodes:
        if node.op not in _CALL_OPS and node.op != "output":
            continue
        earliest = max((out[a.name] for a in node.all_input_nodes if a.name in out), default=0)
        state = stage_state_names(target, [node]) if node.op != "output" else set()
        allowed = set.intersection(*(holders.get(n, set(range(num_stages))) for n in state)) if state else None
        if node.op == "output":
            stage = int(source_stage_of.get(node.name, max(earliest, num_stages - 1)))
        elif allowed is not None:
            fits = sorted(s for s in allowed if s >= earliest)
            if not fits:
                raise SplitError(f"op {node.name} reads {sorted(state)[:3]}, held on stage(s) "
                                 f"{sorted(allowed)}, but its inputs are made on stage {earliest}: this mode's "
                                 "program cannot run on the training plan's stages; make a separate "
                                 "smp.partition for it")
            stage = fits[0]
        else:
            stage = max(int(source_stage_of.get(node.name, earliest)), earliest)
        out[node.name] = stage
    return out


def _build_stage(gm: fx.GraphModule, nodes: list[fx.Node], placeholders: list[fx.Node],
                 stage_of: Mapping[fx.Node, int], readers: Mapping[fx.Node, set[int]], s: int,
                 has_output: bool, output_node: fx.Node) -> StageProgram:
    mine = [n for n in nodes if stage_of.get(n) == s]
    needed: list[fx.Node] = []
    for n in mine:
        needed.extend(n.all_input_nodes)
    if has_output:
        needed.extend(output_node.all_input_nodes)
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
        result[OUTPUT_KEY] = fx.node.map_arg(output_node.args[0], lookup)  # type: ignore[arg-type]
    graph.output(result)
    graph.lint()
    stage_gm = fx.GraphModule(gm, graph, f"{type(gm).__name__}Stage{s}")
    mutated = {n.name for n in inputs + external
               if any(is_inplace(u, gm) and u.args and u.args[0] is n for u in n.users if stage_of.get(u) == s)}
    idx = {p: i for i, p in enumerate(placeholders)}
    return StageProgram(s, stage_gm, [p.name for p in inputs], [idx[p] for p in inputs], [n.name for n in external],
                        [n.name for n in produces], has_output, mutated)


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
                   state_meta: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                   device: torch.device) -> dict[str, ValueMeta]:
    """Shapes/dtypes of the wanted values for one microbatch, without computing anything.

    Runs the whole traced program under FakeTensorMode with every parameter and buffer
    replaced by a fake tensor of its recorded shape (``state_meta``) on ``device`` (where
    the stages run, whatever device the model's tensors are on: meta, or this rank's own
    and other ranks' dropped ones), so it works on a rank that no longer holds, or never
    held, other stages' weights. Deterministic: every rank derives
    the same shapes from the same batch, so no shape handshake is needed, and a batch
    of another shape is simply re-derived. Values with no tensors (``x.size(0)``) are
    recorded as constants and fed to their readers instead of being sent.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.random.fork_rng(devices=[]), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state = {f"gm.{name}": torch.empty(shape, dtype=dtype, device=device)
                 for name, (shape, dtype) in state_meta.items()}
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


def state_meta_of(gm: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every parameter and buffer (by every name), recorded before weights are dropped."""
    out = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        out[name] = (tuple(t.shape), t.dtype)
    return out
