"""Colocation groups as blocks of the search: each group's convex closure, merged until the blocks form a DAG.

A valid assignment is monotone on every edge (``stage(u) <= stage(v)``), so ops ``a`` and
``c`` on one stage pull every op on a path between them onto that stage too: a group
really colocates its *convex closure* (descendants of a member that are also ancestors
of a member). Two closed blocks with edges both ways between them must share a stage as
well, so blocks on a cycle of the block graph merge. At the fixed point every valid
assignment that honours the groups puts each block on one stage, and every monotone
assignment of the block DAG is valid: the groups become a smaller problem, not a cut of
the program order. The DP then searches a topological order in which every block is
contiguous (cuts only between blocks); CP-SAT gets the groups as equalities.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np

from partitioner.errors import ColocationError

__all__ = ["Blocks", "colocation_blocks"]


@dataclass
class Blocks:
    """A topological order with every colocation block contiguous, and where cuts may fall."""

    order: list[Hashable]
    block_of: list[int]  # block id per position of ``order``
    groups: list[list[Hashable]]  # the groups as given (members of two or more)

    def allowed_cuts(self) -> np.ndarray:
        """``allowed[c]``: may a stage boundary fall just before position c (never inside a block)?"""
        b = np.asarray(self.block_of)
        allowed = np.zeros(len(b) + 1, dtype=bool)
        allowed[1:len(b)] = b[1:] != b[:-1]
        return allowed

    @property
    def count(self) -> int:
        return len(set(self.block_of))

    def single_order(self, succ: Sequence[Sequence[int]]) -> bool:
        """True when the block DAG has one topological order: each block feeds the next one.

        Then contiguous cuts between blocks are every valid assignment, and an order-exact
        method is globally exact.
        """
        n = len(self.block_of)
        feeds: set[tuple[int, int]] = {(self.block_of[u], self.block_of[v]) for u in range(n) for v in succ[u]
                                       if self.block_of[v] != self.block_of[u]}
        starts = [c for c in range(1, n) if self.block_of[c] != self.block_of[c - 1]]
        return all((self.block_of[c - 1], self.block_of[c]) in feeds for c in starts)

    def check_stages(self, stages: int, lonely: Sequence[int] = ()) -> None:
        """Raise when the blocks are fewer than the stages (every stage needs an op).

        ``lonely``: positions that can never be a stage on their own (the model's output
        node); a block of nothing else does not count.
        """
        alone = {self.block_of[i] for i in lonely if self.block_of.count(self.block_of[i]) == 1}
        if self.count - len(alone) >= stages:
            return
        sizes: dict[int, int] = {}
        for b in self.block_of:
            sizes[b] = sizes.get(b, 0) + 1
        biggest = max(sizes, key=lambda b: sizes[b])
        members = {v for v, b in zip(self.order, self.block_of) if b == biggest}
        named = [g for g in self.groups if members.issuperset(g)]
        raise ColocationError(
            f"colocating {_names(named)} puts {sizes[biggest]} ops on one stage (with every op on a path "
            f"between the members, which must share their stage), leaving {self.count - len(alone)} blocks for the "
            f"{stages} stages asked for; use at most {self.count - len(alone)} stages or colocate fewer ops")


def _names(groups: list[list[Hashable]]) -> str:
    shown = ", ".join("[" + ", ".join(repr(m) for m in g[:4]) + (", …" if len(g) > 4 else "") + "]"
                      for g in groups[:3])
    return shown + (f" and {len(groups) - 3} more groups" if len(groups) > 3 else "")


def colocation_blocks(g: nx.DiGraph, order: Sequence[Hashable],
                      colocate: Iterable[Iterable[Hashable]] = ()) -> Blocks:
    """The blocks the groups ``colocate`` force on ``g``, and an order of ``g`` keeping each contiguous.

    ``order`` is the graph's program order (topological); it is kept wherever the blocks
    allow, so without groups this returns it unchanged.
    """
    groups = [list(group) for group in colocate]
    for group in groups:
        unknown = [m for m in group if m not in g]
        if unknown:
            raise ColocationError(f"colocation group {_names([group])} names ops not in the graph: "
                                  f"{unknown[:5]}; use node names of the op graph")
    groups = [group for group in groups if len(set(group)) > 1]
    if not groups:
        return Blocks(list(order), list(range(len(order))), [])
    pos = {v: i for i, v in enumerate(order)}
    parent = {v: v for v in g}

    def find(v: Hashable) -> Hashable:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    def union(members: Iterable[Hashable]) -> bool:
        roots = {find(m) for m in members}
        if len(roots) < 2:
            return False
        first = min(roots, key=pos.__getitem__)
        for r in roots:
            parent[r] = first
        return True

    for group in groups:
        union(group)
    changed = True
    while changed:
        changed = False
        classes: dict[Hashable, list[Hashable]] = {}
        for v in g:
            classes.setdefault(find(v), []).append(v)
        for members in classes.values():
            if len(members) > 1:
                changed |= union([*members, *_convex_closure(g, members)])
        quotient = nx.DiGraph()
        quotient.add_nodes_from({find(v) for v in g})
        quotient.add_edges_from((find(u), find(v)) for u, v in g.edges if find(u) != find(v))
        for scc in nx.strongly_connected_components(quotient):
            if len(scc) > 1:
                changed |= union(scc)
    return _block_order(g, order, pos, find, groups)


def _convex_closure(g: nx.DiGraph, members: list[Hashable]) -> set[Hashable]:
    """Ops on some path between two members: descendants of a member that are ancestors of one."""
    below: set[Hashable] = set()
    above: set[Hashable] = set()
    for m in members:
        below |= nx.descendants(g, m)
        above |= nx.ancestors(g, m)
    return below & above


def _block_order(g: nx.DiGraph, order: Sequence[Hashable], pos: dict[Hashable, int], find,
                 groups: list[list[Hashable]]) -> Blocks:
    """Blocks in a topological order of the block DAG (earliest first member first), each in program order."""
    members: dict[Hashable, list[Hashable]] = {}
    for v in order:
        members.setdefault(find(v), []).append(v)
    quotient = nx.DiGraph()
    quotient.add_nodes_from(members)
    quotient.add_edges_from((find(u), find(v)) for u, v in g.edges if find(u) != find(v))
    new_order: list[Hashable] = []
    block_of: list[int] = []
    for b, root in enumerate(nx.lexicographical_topological_sort(quotient, key=lambda r: pos[members[r][0]])):
        new_order += members[root]
        block_of += [b] * len(members[root])
    return Blocks(new_order, block_of, groups)
