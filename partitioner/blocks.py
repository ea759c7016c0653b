"""Repeated blocks: the list of layers a transformer is, found in an op graph and folded to one node per layer.

A model of L identical layers (``model.layers.0`` ... ``model.layers.79``) traces to L copies of
the same ops; a pipeline cut inside a layer rarely pays (its activations are as large as the
layer's output, and the layers are the unit Megatron-LM and torchtitan split by), so the shape
search solves each shape on the graph with one node per layer — the layer priced once as the sum
of its ops, not partitioned op by op 80 times. The solvers then see tens of nodes where the trace
has thousands (the Llama-3-70B trace with torch's fused attention: 4,861 ops, 86 nodes). Its lower
bounds stay those of the op graph, so the gap reported is against any partition, not only the
layer-aligned ones; a shape refused on the folded graph may fit with a cut inside a layer, so its
bound still counts in the search's (partitioner/shapes.py). A folded layer records what selective
recomputation reruns and keeps of it (partitioner/graph.py ``selective_fwd``, ``matmul_fx``).
"""

from __future__ import annotations

import re
from collections import Counter

from partitioner.graph import OpGraph

__all__ = ["MIN_BLOCKS", "MIN_OPS", "block_prefix", "block_graph"]

#: A module list counts as repeated blocks from this many members on ...
MIN_BLOCKS = 4
#: ... and a graph is folded to them only from this many ops on (a smaller one solves fast op by op and keeps the
#: finer cuts).
MIN_OPS = 1000

_INDEXED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def block_prefix(graph: OpGraph) -> str | None:
    """The module path of the list whose numbered members hold the most ops (``model.layers``), among those with
    :data:`MIN_BLOCKS` members that trace to the same ops (a Sequential of different layers is no such list), or
    None."""
    ops: Counter[str] = Counter()
    signature: dict[str, dict[str, list[str]]] = {}  # list -> member -> its ops, in program order
    for v in graph.topological_order():
        match = _INDEXED.match(graph[v]["module"])
        if match:
            ops[match.group(1)] += 1
            signature.setdefault(match.group(1), {}).setdefault(match.group(2), []).append(graph[v]["op"])
    for prefix, _ in ops.most_common():
        alike = Counter(tuple(member) for member in signature[prefix].values())
        if alike.most_common(1)[0][1] >= MIN_BLOCKS:
            return prefix
    return None


def block_graph(graph: OpGraph, *, min_ops: int | None = None) -> OpGraph:
    """``graph`` with each member of its repeated blocks one node (and the ops outside them grouped by their
    module at the same depth, free ops folded into their neighbours); ``graph`` itself when it has fewer than
    ``min_ops`` (default :data:`MIN_OPS`) ops or no repeated blocks. Costs add up (:meth:`OpGraph.coarsen`);
    ``meta["blocks"]`` names the list."""
    prefix = block_prefix(graph) if len(graph) >= (MIN_OPS if min_ops is None else min_ops) else None
    if prefix is None:
        return graph
    coarse = graph.coarsen(depth=len(prefix.split(".")) + 1, fold_free=True)
    coarse.meta["blocks"] = prefix
    return coarse
