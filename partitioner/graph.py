"""OpGraph: the costed op graph every solver reads (a networkx DiGraph plus totals)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import networkx as nx

__all__ = ["OpGraph", "NODE_FIELDS", "GRAPH_SCHEMA_VERSION", "OUTPUT_OP", "MATMUL_FX", "SELECTIVE_FWD", "is_matmul"]

GRAPH_SCHEMA_VERSION = 1

#: Node attributes every OpGraph node carries, with their units. Solvers need only
#: ``fwd``, ``bwd``, ``params`` and ``out_bytes``; the rest explain a plan to people
#: and let the runtime map nodes back to the traced program.
NODE_FIELDS: dict[str, str] = {
    "fwd": "forward time, seconds",
    "bwd": "backward time (input + weight gradients), seconds",
    "params": "bytes of parameters first used by this node (a shared parameter counted once)",
    "buffers": "bytes of buffers first used by this node (BatchNorm running stats, ...)",
    "out_bytes": "bytes of all tensors the node outputs",
    "saved_bytes": "bytes autograd keeps for the backward that this op made (its outputs others save, its own "
                   "intermediates), each storage once; training graphs from the profiler",
    "saved_output_bytes": "the part of saved_bytes that is the op's own output (the rest of its output is "
                          "kept only when it is sent to another stage)",
    "storage_bytes": "bytes of the storages the op's output owns (a view owns none)",
    "view_of": "the op whose output storage this op's output views ('' when it owns its storage)",
    "kernel_bytes": "bytes of the storages the matmul kernels inside the op make (torch.utils.flop_counter's ops: "
                    "what selective recomputation keeps); absent on graphs that did not record it",
    "kernel_saved_bytes": "the part of saved_bytes that is storages made by those kernels",
    "kernel_output_bytes": "the part of storage_bytes that is storages made by those kernels",
    "flops": "forward floating-point operations (torch.utils.flop_counter)",
    "module": "module path the op came from, '' for the root module",
    "op": "what the op is: 'linear', 'aten.addmm.default', 'add', ...",
    "index": "position in the traced program's order (a topological order)",
    "param_names": "fully qualified names of the parameters this node uses",
    "buffer_names": "fully qualified names of the buffers this node uses",
    "shared_params": "names of parameters this node uses whose bytes were counted on an earlier node",
    "shared_bytes": "bytes of those shared parameters (a stage holding this node holds them too)",
    "shared_from": "for each shared parameter, the name it was first counted under (its owner reads it so)",
    "fx_nodes": "names of the fx nodes this node stands for (several after coarsening)",
}

#: What the profiler records of the matmul kernels inside each op (selective recomputation's exact price);
#: optional: a graph without them is priced by the op's output and saved bytes alone.
KERNEL_FIELDS = ("kernel_bytes", "kernel_saved_bytes", "kernel_output_bytes")

#: A folded group's fx nodes that are matmul-like (what selective recomputation keeps) and the forward seconds of
#: its other ops (what it reruns): an op's own FLOPs say so for an op, not for a group (:func:`is_matmul`).
MATMUL_FX = "matmul_fx"
SELECTIVE_FWD = "selective_fwd"

#: Per-microbatch times a node may carry besides fwd and bwd (all in seconds, all scale with the microbatch and add
#: up over a coarsened group): the weight-gradient part of bwd (split-backward schedules), a tensor-parallel
#: priced graph's collectives and unsplit times (partitioner/tensor_parallel.py TP_COST_FIELDS), and what a folded
#: group reruns under selective recomputation.
OPTIONAL_TIMES = ("bwd_w", "tp_fwd_comm", "tp_bwd_comm", "tp_whole_fwd", "tp_whole_bwd", SELECTIVE_FWD)
PER_MICROBATCH_TIMES = ("fwd", "bwd", *OPTIONAL_TIMES)
#: ... and per-microbatch bytes: what a tensor-parallel priced graph's collectives move.
OPTIONAL_BYTES = ("tp_fwd_bytes", "tp_bwd_bytes")


def is_matmul(flops: float) -> bool:
    """Whether an op with this forward FLOP count is matmul-like (docs/memory.md: selective recomputation keeps
    its output and reruns the others)."""
    return flops > 0


#: ``op`` of the node that stands for the model's output: it costs nothing, and its in-edges
#: are the values the model returns, which must reach the stage that returns them.
OUTPUT_OP = "output"

_DEFAULTS: dict[str, Any] = {
    "fwd": 0.0,
    "bwd": 0.0,
    "params": 0,
    "buffers": 0,
    "out_bytes": 0,
    "saved_bytes": 0,
    "saved_output_bytes": 0,
    "storage_bytes": 0,
    "view_of": "",
    "flops": 0,
    "shared_bytes": 0,
    "module": "",
    "op": "",
    "param_names": (),
    "buffer_names": (),
    "shared_params": (),
    "shared_from": (),
}


class OpGraph:
    """A DAG of ops with their costs; ``.nx`` is the underlying ``networkx.DiGraph``.

    Node names are the fx node names of the traced program. An edge u -> v means v
    consumes u's output. ``meta`` records how the graph was made (model, batch, timing
    method, device) so that a plan can say what it was planned from.
    """

    def __init__(self, graph: nx.DiGraph | None = None, meta: Mapping[str, Any] | None = None):
        self.nx: nx.DiGraph = graph if graph is not None else nx.DiGraph()
        self.meta: dict[str, Any] = dict(meta or {})
        for i, (name, data) in enumerate(self.nx.nodes(data=True)):
            for key, default in _DEFAULTS.items():
                data.setdefault(key, default)
            data.setdefault("index", i)
            data.setdefault("fx_nodes", (name,))
        if not nx.is_directed_acyclic_graph(self.nx):
            cycle = nx.find_cycle(self.nx)
            raise ValueError(f"an OpGraph must be acyclic; found the cycle {cycle}")

    # ---------------------------------------------------------------- structure

    def __len__(self) -> int:
        """The number of ops (the output node is not one)."""
        return sum(1 for _, d in self.nx.nodes(data=True) if d["op"] != OUTPUT_OP)

    def __iter__(self):
        return iter(self.topological_order())

    def __contains__(self, name: object) -> bool:
        return name in self.nx

    def __getitem__(self, name: str) -> dict[str, Any]:
        return self.nx.nodes[name]

    def __repr__(self) -> str:
        return (
            f"OpGraph({len(self)} ops, {self.nx.number_of_edges()} edges, "
            f"params={self.total_params:,} B, fwd={self.total_fwd * 1e3:.3f} ms, "
            f"bwd={self.total_bwd * 1e3:.3f} ms)"
        )

    def topological_order(self) -> list[str]:
        """Nodes in program order (``index``), which is always a topological order."""
        return sorted(self.nx.nodes, key=lambda n: self.nx.nodes[n]["index"])

    def is_chain(self) -> bool:
        """True when every node has at most one producer and one consumer on a single path."""
        order = self.topological_order()
        return all(self.nx.has_edge(a, b) for a, b in zip(order, order[1:])) and (
            self.nx.number_of_edges() == max(len(order) - 1, 0)
        )

    # ---------------------------------------------------------------- totals

    def _sum(self, key: str) -> float:
        return sum(d[key] for _, d in self.nx.nodes(data=True))

    @property
    def total_fwd(self) -> float:
        return self._sum("fwd")

    @property
    def total_bwd(self) -> float:
        return self._sum("bwd")

    @property
    def total_params(self) -> int:
        return int(self._sum("params"))

    @property
    def total_buffers(self) -> int:
        return int(self._sum("buffers"))

    @property
    def total_out_bytes(self) -> int:
        return int(self._sum("out_bytes"))

    @property
    def total_flops(self) -> int:
        return int(self._sum("flops"))

    def heaviest(self, k: int = 10, key: str = "fwd") -> list[tuple[str, dict[str, Any]]]:
        """The ``k`` nodes with the largest ``key`` (ties broken by program order)."""
        nodes = sorted((nd for nd in self.nx.nodes(data=True) if nd[1]["op"] != OUTPUT_OP),
                       key=lambda nd: (-nd[1][key], nd[1]["index"]))
        return nodes[:k]

    # ---------------------------------------------------------------- (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for name in self.topological_order():
            data = dict(self.nx.nodes[name])
            for key in ("param_names", "buffer_names", "shared_params", "shared_from", "fx_nodes"):
                data[key] = list(data[key])
            nodes.append({"name": name, **data})
        edges = [[u, v, dict(d)] if d else [u, v] for u, v, d in self.nx.edges(data=True)]
        return {"schema": GRAPH_SCHEMA_VERSION, "kind": "smp.OpGraph", "meta": self.meta,
                "nodes": nodes, "edges": edges}

    def to_json(self, path: str | Path | None = None, *, indent: int | None = 1) -> str:
        """The graph as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OpGraph:
        if data.get("kind") != "smp.OpGraph":
            raise ValueError("not an smp op graph: the JSON has no \"kind\": \"smp.OpGraph\" "
                             "(write one with `smp profile MODEL -o graph.json`)")
        if data.get("schema", 0) > GRAPH_SCHEMA_VERSION:
            raise ValueError(
                f"this op graph uses schema {data['schema']}, newer than this smp "
                f"understands ({GRAPH_SCHEMA_VERSION}); upgrade smp or re-profile the model")
        g = nx.DiGraph()
        for node in data["nodes"]:
            attrs = dict(node)
            name = attrs.pop("name")
            for key in ("param_names", "buffer_names", "shared_params", "shared_from", "fx_nodes"):
                if key in attrs:
                    attrs[key] = tuple(attrs[key])
            g.add_node(name, **attrs)
        for edge in data["edges"]:
            g.add_edge(edge[0], edge[1], **(edge[2] if len(edge) > 2 else {}))
        return cls(g, data.get("meta", {}))

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> OpGraph:
        """Read JSON text, or a path to a JSON file written by ``to_json``."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            path = Path(text)
            if not path.exists():
                raise FileNotFoundError(f"no op graph file at {path}")
            text = path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"the op graph file is not valid JSON ({err}); re-profile the model") from None
        return cls.from_dict(data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpGraph) and self.to_dict() == other.to_dict()

    def scaled(self, factor: float) -> OpGraph:
        """The same graph with per-microbatch costs times ``factor`` (times, output bytes, FLOPs).

        Going from m to m' microbatches of one batch scales a microbatch by m / m'; weights do not change.
        """
        data = self.to_dict()
        for node in data["nodes"]:
            for key in PER_MICROBATCH_TIMES:
                if key in node:
                    node[key] *= factor
            for key in ("out_bytes", "saved_bytes", "saved_output_bytes", "storage_bytes", "flops", *KERNEL_FIELDS,
                        *OPTIONAL_BYTES):
                if key in node:
                    node[key] = int(round(node[key] * factor))
        return OpGraph.from_dict(data)

    # ---------------------------------------------------------------- coarsening

    def coarsen(
        self,
        *,
        depth: int | None = None,
        fold_free: bool = True,
        fold_chains: bool = False,
        free_threshold: float = 0.0,
    ) -> OpGraph:
        """A smaller graph whose nodes are groups of this graph's nodes; costs add up.

        Groups are runs of consecutive nodes in program order (a topological order), and
        such a run is always convex: any path between two of its nodes stays inside it, so
        the coarse graph is acyclic by construction and coarsening is linear in the graph.
        A node joins the run before it when:

        - ``depth``: both come from modules with the same first ``depth`` path components
          (``layers.3.attn.q`` at depth 2 is ``layers.3``);
        - ``fold_free``: it costs nothing (no time above ``free_threshold``, no
          parameters: views, reshapes, getattr) and reads only from that run; a free
          node that starts the graph joins the run after it instead;
        - ``fold_chains``: its only input is the previous node, which feeds nothing else.

        The new node keeps the first member's name; ``fx_nodes`` lists all members, so
        every fx node still maps to exactly one coarse node.
        """
        order = self.topological_order()
        position = {n: i for i, n in enumerate(order)}
        run_of: list[int] = []  # run id of each node, by position

        def prefix(n: str) -> str | None:
            module = self.nx.nodes[n]["module"]
            return ".".join(module.split(".")[:depth]) if (depth is not None and module) else None

        def is_free(n: str) -> bool:
            d = self.nx.nodes[n]
            return d["fwd"] + d["bwd"] <= free_threshold and d["params"] == 0 and d["buffers"] == 0

        run_prefix: list[str | None] = []
        for i, n in enumerate(order):
            joins = False
            if i > 0:
                prev = run_of[i - 1]
                preds = list(self.nx.predecessors(n))
                p = prefix(n)
                if p is not None and p == run_prefix[prev]:
                    joins = True
                elif fold_free and is_free(n) and preds and all(run_of[position[q]] == prev for q in preds):
                    joins = True
                elif (fold_chains and len(preds) == 1 and position[preds[0]] == i - 1
                      and self.nx.out_degree(preds[0]) == 1):
                    joins = True
            if joins:
                run_of.append(run_of[i - 1])
                if run_prefix[run_of[i]] is None:
                    run_prefix[run_of[i]] = prefix(n)
            else:
                run_of.append(len(run_prefix))
                run_prefix.append(prefix(n))
        if fold_free:
            # Free nodes with no inputs (constants, arange, ...) join the run after them.
            for i in range(len(order) - 2, -1, -1):
                n = order[i]
                if (run_of[i] != run_of[i + 1] and not any(True for _ in self.nx.predecessors(n))
                        and is_free(n) and (i == 0 or run_of[i - 1] != run_of[i])):
                    run_of[i] = run_of[i + 1]
        return self._contract(lambda n: str(run_of[position[n]]))

    def contract(self, group_of: Mapping[str, str] | Callable[[str], str]) -> OpGraph:
        """Merge nodes that map to the same group; raises if the result has a cycle."""
        fn = group_of if callable(group_of) else group_of.__getitem__
        return self._contract(fn)

    def _contract(self, group_of: Callable[[str], str]) -> OpGraph:
        members: dict[str, list[str]] = {}
        for n in self.topological_order():
            members.setdefault(group_of(n), []).append(n)
        g = nx.DiGraph()
        for rep, group in members.items():
            datas = [self.nx.nodes[m] for m in group]
            first = datas[0]
            modules = [d["module"] for d in datas if d["module"]]
            g.add_node(
                group[0],
                fwd=sum(d["fwd"] for d in datas),
                bwd=sum(d["bwd"] for d in datas),
                params=sum(d["params"] for d in datas),
                buffers=sum(d["buffers"] for d in datas),
                flops=sum(d["flops"] for d in datas),
                saved_bytes=sum(d["saved_bytes"] for d in datas),
                saved_output_bytes=sum(d["saved_output_bytes"] for d, m in zip(datas, group)
                                       if any(group_of(s) != rep for s in self.nx.successors(m))),
                # what leaves the group: the storages of members read outside it that are not views
                storage_bytes=sum(d["storage_bytes"] for d, m in zip(datas, group)
                                  if not d["view_of"] and any(group_of(s) != rep for s in self.nx.successors(m))),
                # a tied parameter's bytes once per group: a member's share of it is dropped when the group
                # holds the parameter's owner too
                shared_bytes=sum(d.get("shared_bytes", 0) for d in datas
                                 if not set(d["shared_from"]) <= {p for e in datas for p in e["param_names"]}),
                **{key: sum(d[key] for d in datas) for key in (*OPTIONAL_TIMES, *OPTIONAL_BYTES)
                   if all(key in d for d in datas)},
                **({MATMUL_FX: tuple(f for d in datas for f in (d[MATMUL_FX] if MATMUL_FX in d else
                                                                d["fx_nodes"] if is_matmul(d["flops"]) else ())),
                    SELECTIVE_FWD: sum(d.get(SELECTIVE_FWD, 0.0 if is_matmul(d["flops"]) else d["fwd"])
                                       for d in datas)} if len(group) > 1 else {}),
                **({"kernel_bytes": sum(d["kernel_bytes"] for d in datas),
                    "kernel_saved_bytes": sum(d["kernel_saved_bytes"] for d in datas),
                    "kernel_output_bytes": sum(d["kernel_output_bytes"] for d, m in zip(datas, group)
                                               if not d["view_of"]
                                               and any(group_of(s) != rep for s in self.nx.successors(m)))}
                   if all(all(k in d for k in KERNEL_FIELDS) for d in datas) else {}),
                view_of=next((members[group_of(d["view_of"])][0] for d in datas if d["view_of"]
                              and d["view_of"] in self.nx and group_of(d["view_of"]) != rep), ""),
                # The group's output is what leaves it: bytes of members read outside.
                out_bytes=sum(
                    d["out_bytes"] for m, d in zip(group, datas)
                    if any(group_of(s) != rep for s in self.nx.successors(m))
                    or self.nx.out_degree(m) == 0
                ),
                module=_common_prefix(modules) if modules else first["module"],
                op=first["op"] if len(group) == 1 else f"group({len(group)})",
                index=first["index"],
                param_names=tuple(p for d in datas for p in d["param_names"]),
                buffer_names=tuple(b for d in datas for b in d["buffer_names"]),
                shared_params=tuple(p for d in datas for p in d["shared_params"]),
                shared_from=tuple(p for d in datas for p in d["shared_from"]),
                fx_nodes=tuple(f for d in datas for f in d["fx_nodes"]),
            )
        for u, v in self.nx.edges:
            # A coarse node is named after its group's first member.
            gu, gv = members[group_of(u)][0], members[group_of(v)][0]
            if gu != gv:
                g.add_edge(gu, gv)
        if not nx.is_directed_acyclic_graph(g):
            raise ValueError("contracting these groups makes the op graph cyclic; "
                             "groups must be convex (no path leaves a group and comes back)")
        # Re-number so that ``index`` stays a dense topological order.
        for i, n in enumerate(sorted(g.nodes, key=lambda n: g.nodes[n]["index"])):
            g.nodes[n]["index"] = i
        meta = dict(self.meta)
        meta["coarsened_from"] = len(self)
        return OpGraph(g, meta)


def _common_prefix(modules: list[str]) -> str:
    parts = [m.split(".") for m in modules]
    prefix: list[str] = []
    for column in zip(*parts):
        if all(c == column[0] for c in column):
            prefix.append(column[0])
        else:
            break
    return ".".join(prefix)
