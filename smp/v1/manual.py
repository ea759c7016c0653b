"""Manual partitioning: ``with smp.partition(i):`` around module creation, and the plan that follows that assignment."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import replace

from torch import nn
from torch.nn.modules import module as torch_module

from partitioner.cost import evaluate
from partitioner.graph import OUTPUT_OP, OpGraph
from partitioner.plan import Plan, schedule_for, simulate_partition
from partitioner.problem import graph_order
from smp.v1.errors import V1Error
from smp.v1.state import current, is_initialized

__all__ = ["partition", "stage_of_ops", "manual_plan"]

#: Module -> the partition it was created (or attached) in; weak, so a dead module's id is never reused here.
_assigned: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_stack: list[int] = []
_hooks: list[object] = []


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Place every module created (or attached to its parent) inside the block on partition ``index``.

    The innermost block wins; modules made outside every block go to ``default_partition``.
    Honoured when the configuration says ``"auto_partition": false`` (v1's rule).
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise V1Error(f"smp.partition({index!r}): a partition index, an integer >= 0")
    if is_initialized() and index >= current().config.partitions:
        raise V1Error(f"smp.partition({index}): there are {current().config.partitions} partitions "
                      f"(0..{current().config.partitions - 1})")
    if not _stack:
        _hooks.extend([torch_module.register_module_module_registration_hook(_on_module),
                       torch_module.register_module_parameter_registration_hook(_on_state),
                       torch_module.register_module_buffer_registration_hook(_on_state)])
    _stack.append(index)
    try:
        yield
    finally:
        _stack.pop()
        if not _stack:
            for handle in _hooks:
                handle.remove()  # type: ignore[attr-defined]
            _hooks.clear()


def _on_module(parent: nn.Module, name: str, sub: nn.Module | None) -> None:
    if sub is not None:
        _assigned.setdefault(sub, _stack[-1])  # the partition it was made in wins over where it is attached


def _on_state(module: nn.Module, name: str, tensor: object) -> None:
    _assigned.setdefault(module, _stack[-1])


def stage_of_ops(model: nn.Module, graph: OpGraph, partitions: int, default: int) -> dict[str, int]:
    """Every op's partition under the manual assignment.

    An op inside an assigned module (by its module path, innermost first) goes there; an
    op reading a parameter or buffer goes where that tensor's module is assigned, else to
    ``default``; any other op (a functional op of an unassigned forward) runs where its
    inputs are ready, or, with no input, where its first reader runs. The output follows
    what it returns.
    """
    assigned = {path: _assigned[mod] for path, mod in model.named_modules(remove_duplicate=False)
                if mod in _assigned}
    if not assigned:
        raise V1Error("\"auto_partition\": false, but no module was created inside `with smp.partition(i):`; "
                      "create the model's modules inside such blocks, or set \"auto_partition\": true")
    for path, index in assigned.items():
        if index >= partitions:
            raise V1Error(f"module {path or '(the model)'} was created in smp.partition({index}), but there are "
                          f"{partitions} partitions")

    def innermost(path: str) -> int | None:
        parts = path.split(".") if path else []
        for k in range(len(parts), -1, -1):
            found = assigned.get(".".join(parts[:k]))
            if found is not None:
                return found
        return None

    g, order = graph_order(graph)
    stage: dict[str, int | None] = {}
    for node in order:
        if node == OUTPUT_OP:
            continue
        data = graph[node]
        s = innermost(data["module"])
        if s is None and (data["param_names"] or data["buffer_names"]):
            owner = (list(data["param_names"]) + list(data["buffer_names"]))[0].rpartition(".")[0]
            s = innermost(owner)
            s = default if s is None else s
        if s is None:
            ready = [stage[p] for p in g.predecessors(node) if stage.get(p) is not None]
            s = max(ready) if ready else None
        stage[node] = s
    for node in reversed(order):
        if node != OUTPUT_OP and stage[node] is None:
            readers = [stage[x] for x in g.successors(node) if x != OUTPUT_OP and stage.get(x) is not None]
            stage[node] = min(readers) if readers else default
    result = {str(n): int(s) for n, s in stage.items() if s is not None}
    result[OUTPUT_OP] = max(result[str(p)] for p in g.predecessors(OUTPUT_OP))
    empty = sorted(set(range(partitions)) - {s for n, s in result.items() if n != OUTPUT_OP})
    if empty:
        raise V1Error(f"partition{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} would run no op: "
                      "create a module that the forward uses inside `with smp.partition(i):` for each, or use "
                      "fewer partitions")
    for u, v in g.edges:
        if result[str(u)] > result[str(v)]:
            raise V1Error(f"manual partitioning: {_describe(graph, u)} on partition {result[str(u)]} feeds "
                          f"{_describe(graph, v)} on partition {result[str(v)]}. smp runs the partitions as a "
                          "pipeline, so data may only flow to the same or a later partition: create the later "
                          "module in a higher smp.partition, or set \"auto_partition\": true")
    return result


def _describe(graph: OpGraph, node: object) -> str:
    if node == OUTPUT_OP:
        return "the model's output"
    module = graph[node]["module"]
    return f"op {node} of module {module!r}" if module else f"op {node} of the model's own forward"


def manual_plan(base: Plan, stage_of: dict[str, int], memory_limit: float | None) -> Plan:
    """``base`` (a plan of the same model, batch and schedule) with its ops on the stages of ``stage_of``,
    priced by the one cost model and scheduled and simulated like any plan."""
    ranks = base.pipeline_ranks
    # the base plan's settings on free links, the user's stages priced without recomputation
    part = evaluate(base.graph, stage_of, base.partition.settings(ranks), method="manual (smp.partition)",
                    stages=ranks, cluster=None, training=True, memory_limit=memory_limit, recompute="none")
    sched = schedule_for(base.schedule_name, part, base.microbatches, ranks, base.data_parallel)
    return replace(base, partition=part, schedule=sched, simulated=simulate_partition(sched, part, base.dp_link))
