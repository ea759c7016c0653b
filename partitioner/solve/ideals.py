"""A lower bound over every valid assignment (not one order): the banded DP over the ideals of the DAG.

Stages 0..s of a valid assignment hold an *ideal* I_s (a set closed under producers),
so a p-stage plan is a chain ∅ ⊂ I_0 ⊂ … ⊂ I_{p-1} = V and stage s is I_s \\ I_{s-1}.
dp.py's lower DP over the prefixes of one order is the special case of a chain of
prefixes; here the same per-segment lower cost (exact compute and memory, each received
tensor priced on the link into the stage, one copy of each tensor leaving the ideal on
the link out, see :func:`~partitioner.solve.dp.link_prices`) is minimised over chains of
*all* ideals. Its optimum is therefore a lower bound on the best bottleneck of any valid
assignment, and its chain is a plan, proven optimal when its exact cost meets the bound.
This is the ideal (prefix) formulation of pipeline partitioning used for lower bounds by
Archer et al., "Practical Performance Guarantees for Pipelined DNN Inference" (2023),
solved here exactly by dynamic programming where the ideals are few: narrow graphs such
as encoder-decoders, Inception and ResNet blocks, transformers with parallel q/k/v.

Work is bounded by counts (ideals and segment pairs), never by time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partitioner.bounds import trivial_lower_bound
from partitioner.cost import Problem
from partitioner.solve.dp import link_prices

__all__ = ["IdealResult", "ideal_dp", "MAX_IDEALS", "MAX_PAIRS"]

#: Ideals enumerated at most; wider graphs are left to CP-SAT.
MAX_IDEALS = 20_000
#: (sub-ideal, ideal) segment pairs visited at most, over all band widenings (~10 us each).
MAX_PAIRS = 400_000
#: Skip without generating when even this many times MAX_PAIRS ideal pairs lie within the
#: band (an over-count: it ignores that J must be a subset of I), e.g. wide graphs on 3 or 4 stages.
_HOPELESS = 30


@dataclass
class IdealResult:
    """The DP's value (a lower bound on every valid assignment) and the plan of its chain."""

    lower_bound: float
    assign: list[int]
    value: float
    pairs: int


class _Lattice:
    """The ideals of ``prob``'s DAG as bitmasks over positions, with their work, memory and activation sums."""

    def __init__(self, prob: Problem):
        self.prob = prob
        self.pred = [sum(1 << u for u in prob.pred[v]) for v in range(prob.n)]
        self.succ = [sum(1 << w for w in prob.succ[v]) for v in range(prob.n)]
        self.masks: list[int] = []
        self.index: dict[int, int] = {}
        self.maximal: list[int] = []  # per ideal, its ops with no consumer inside it
        self._values = {"work": prob.work, "fixed": prob.fixed_mem, "step": prob.step_mem}
        for c in {c for opts in prob.choices for c in opts}:  # per recomputation choice a stage may take
            self._values.update({f"kept:{c}": prob.rec.kept[c], f"remade:{c}": prob.rec.remade[c],
                                 f"seconds:{c}": prob.rec.seconds[c]})
        self.sums: dict[str, list[float]] = {key: [] for key in self._values}

    def enumerate(self, cap: int) -> bool:
        """Breadth-first from ∅, adding one available op at a time; False past ``cap`` ideals."""
        prob = self.prob
        sources = [v for v in range(prob.n) if not prob.pred[v]]
        frontier = [(0, sources)]
        self._add(0, -1, None)
        while frontier:
            nxt = []
            for ideal, available in frontier:
                for v in available:
                    grown = ideal | (1 << v)
                    if grown in self.index:
                        continue
                    if len(self.masks) >= cap:
                        return False
                    self._add(grown, v, self.index[ideal])
                    opened = [w for w in prob.succ[v] if self.pred[w] & ~grown == 0]
                    nxt.append((grown, [a for a in available if a != v] + opened))
            frontier = nxt
        return True

    def _add(self, mask: int, v: int, parent: int | None) -> None:
        """Record ideal ``mask`` = ideal ``parent`` plus op ``v``, with its sums."""
        self.index[mask] = len(self.masks)
        self.masks.append(mask)
        self.maximal.append(0 if parent is None else (self.maximal[parent] & ~self.pred[v]) | (1 << v))
        for key, values in self._values.items():
            self.sums[key].append(0.0 if parent is None else self.sums[key][parent] + float(values[v]))


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _stages_for(work: float, band: float, empty: bool) -> int:
    """The fewest segments of work <= ``band`` that can hold a set of ops with this work: 0 for
    none, at least 1 otherwise. Rounded down by a relative 1e-9 so that float sums never
    overstate it (overstating would drop a pair a chain needs)."""
    return 0 if empty else max(1, math.ceil(work / band * (1 - 1e-9)))


def _room_below(lattice: _Lattice, band: float, i: int) -> int:
    """How many stages may hold the ops below a segment ending at ideal I: p - 1 less the
    stages the ops after I need; -1 when no p-segment chain within the band passes through I.

    A pair (J, I) at position s of a chain has J in s segments and V \\ I in p - 1 - s, each
    within the band, so it can be in a chain only if stages(J) <= room. Pairs that cannot are
    never recorded, so the chain DP's answer is unchanged; on 2 stages this leaves the pairs
    (∅, I) and (J, V) alone, and the DP's work linear in the ideals instead of quadratic.
    """
    prob, work = lattice.prob, lattice.sums["work"]
    whole = (1 << prob.n) - 1
    after = max(work[lattice.index[whole]] - work[i], 0.0)
    room = prob.p - 1 - _stages_for(after, band, lattice.masks[i] == whole)
    if room <= 0:
        return room if room == 0 else -1
    if work[i] <= band:
        return room  # J = ∅ is within reach
    return room if _stages_for(work[i] - band, band, False) <= room else -1  # every J keeps >= W(I) - band


class _Pairs:
    """Every (sub-ideal J, ideal I) whose segment I \\ J has compute <= a band, with its comm terms.

    Columns: ``j``, ``i`` (ideal indices), ``rb``/``rc`` (bytes and count of tensors the
    segment receives from J), ``sb``/``sc`` (of tensors it sends beyond I).
    """

    KEYS = ("j", "i", "rb", "rc", "sb", "sc")

    def __init__(self, lattice: _Lattice, band: float, budget: int):
        self.lattice, self.band, self.left = lattice, band, budget
        self.cols: dict[str, list] = {k: [] for k in self.KEYS}
        self.complete = True
        for i in range(1, len(lattice.masks)):
            room = _room_below(lattice, band, i)
            if room == 0:
                self._from_nothing(i)
            elif room > 0 and not self._down_from(i, room):
                self.complete = False
                return

    def _from_nothing(self, i: int) -> None:
        """The one useful pair of ideal I when only ∅ may lie below it: the first stage holds all of I."""
        lat, prob = self.lattice, self.lattice.prob
        self.left -= 1
        if lat.sums["work"][i] > self.band * (1 + 1e-9):  # the DFS's own sums may round the other way
            return
        ideal = lat.masks[i]
        outside = ((1 << prob.n) - 1) & ~ideal
        sent = [float(prob.out_bytes[v]) for v in _bits(ideal) if prob.out_bytes[v] > 0 and lat.succ[v] & outside]
        for key, value in zip(self.KEYS, (0, i, 0.0, 0, sum(sent), len(sent))):
            self.cols[key].append(value)

    def _down_from(self, i: int, room: int) -> bool:
        """Depth-first from ideal I: remove one maximal op v of J at a time (J stays an ideal),
        keeping the received set and the sent tensors incrementally; record the pairs whose J
        fits in ``room`` stages. False once over budget (every J visited counts)."""
        lat, prob = self.lattice, self.lattice.prob
        sums = lat.sums["work"]
        work, ob = prob.work, prob.out_bytes
        ideal = lat.masks[i]
        outside = ((1 << prob.n) - 1) & ~ideal
        add = [self.cols[k].append for k in self.KEYS]
        # (J, its maximal ops, received set, rb, rc, sb, sc, work of I \ J)
        stack = [(ideal, lat.maximal[i], 0, 0.0, 0, 0.0, 0, 0.0)]
        seen = {ideal}
        while stack:
            sub, tops, recv, rb, rc, sb, sc, done = stack.pop()
            for v in _bits(tops):
                seg_work = done + float(work[v])
                smaller = sub & ~(1 << v)
                if seg_work > self.band or smaller in seen:
                    continue
                seen.add(smaller)
                b = float(ob[v])
                nrb, nrc = (rb - b, rc - 1) if recv >> v & 1 and b > 0 else (rb, rc)  # v moves inside
                for u in _bits(lat.pred[v] & ~recv):
                    if ob[u] > 0:
                        nrb, nrc = nrb + float(ob[u]), nrc + 1
                nsb, nsc = (sb + b, sc + 1) if b > 0 and lat.succ[v] & outside else (sb, sc)
                below = lat.index[smaller]
                if _stages_for(sums[below], self.band, below == 0) <= room:
                    for append, value in zip(add, (below, i, nrb, nrc, nsb, nsc)):
                        append(value)
                self.left -= 1
                if self.left < 0:
                    return False
                freed = 0
                for u in _bits(lat.pred[v]):
                    if not lat.succ[u] & smaller:
                        freed |= 1 << u
                stack.append((smaller, (tops & ~(1 << v)) | freed, (recv & ~(1 << v)) | lat.pred[v],
                              nrb, nrc, nsb, nsc, seg_work))
        return True

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in self.cols.items()}


def _chain_dp(prob: Problem, lattice: _Lattice, pairs: dict[str, np.ndarray]) -> tuple[float, list[int] | None]:
    """min over chains of ideals of the max segment lower cost; the chain as a stage per position."""
    p, k_ideals = prob.p, len(lattice.masks)
    j, i = pairs["j"], pairs["i"]
    if not len(j):
        return math.inf, None
    sums = {key: np.asarray(values) for key, values in lattice.sums.items()}
    def seg(key: str) -> np.ndarray:
        return sums[key][i] - sums[key][j]

    comp, fixed, step = seg("work"), seg("fixed"), seg("step")
    in_b, in_l, out_b, out_l = link_prices(prob)
    order = np.lexsort((j, i))  # group pairs by their ideal I
    i_sorted = i[order]
    starts = np.flatnonzero(np.r_[True, i_sorted[1:] != i_sorted[:-1]])
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(order)]))
    positions = np.arange(len(order))
    best = np.full((p, k_ideals), math.inf)
    arg = np.full((p, k_ideals), -1, dtype=np.int64)
    for s in range(p):
        base = (comp / prob.speed[s] + in_b[s] * pairs["rb"] + in_l[s] * pairs["rc"]
                + out_b[s] * pairs["sb"] + out_l[s] * pairs["sc"])
        # The fastest recomputation choice whose memory fits: what the segment keeps (with the
        # tensors it receives, exact; what it sends is left out, so memory is a relaxation).
        lim = math.inf if prob.mem_limit[s] is None else prob.mem_limit[s] * (1 + 1e-12)
        cost = np.full_like(base, math.inf)
        for c in reversed(prob.choices[s]):
            kept = seg(f"kept:{c}") + (pairs["rb"] if prob.rec.received[c] else 0.0)
            mem = fixed + prob.in_flight[s] * kept + prob.recomputing[s] * seg(f"remade:{c}")
            cost = np.where((mem <= lim) & (step <= lim), base + seg(f"seconds:{c}") / prob.speed[s], cost)
        cand = np.where(j == 0, cost, math.inf) if s == 0 else np.maximum(best[s - 1][j], cost)
        cand_sorted = cand[order]
        mins = np.minimum.reduceat(cand_sorted, starts)
        first = np.minimum.reduceat(np.where(cand_sorted == mins[group], positions, len(order)), starts)
        targets = i_sorted[starts]
        best[s, targets] = mins
        arg[s, targets] = order[first]
    top = lattice.index[(1 << prob.n) - 1]
    value = float(best[p - 1, top])
    if not math.isfinite(value):
        return value, None
    assign = [0] * prob.n
    ideal = top
    for s in range(p - 1, -1, -1):
        pair = int(arg[s, ideal])
        below = int(j[pair])
        for v in _bits(lattice.masks[ideal] & ~lattice.masks[below]):
            assign[v] = s
        ideal = below
    return value, assign


def _pairs_within(lattice: _Lattice, band: float) -> int:
    """Σ over the ideals I searched below (see :func:`_room_below`) of the ideals J with
    W(I) - band <= W(J) < W(I): at least the sub-ideals the search visits."""
    work = np.asarray(lattice.sums["work"])
    deep = np.asarray([_room_below(lattice, band, i) > 0 for i in range(len(work))])
    ranked = np.sort(work)
    tops = work[deep]
    return int((np.searchsorted(ranked, tops, side="left") - np.searchsorted(ranked, tops - band, side="left")).sum())


def ideal_dp(prob: Problem, *, max_ideals: int = MAX_IDEALS, max_pairs: int = MAX_PAIRS) -> IdealResult | None:
    """The ideal DP's bound and plan; None when the DAG has more than ``max_ideals`` ideals,
    the pairs exceed ``max_pairs`` or nothing fits memory."""
    lattice = _Lattice(prob)
    if not lattice.enumerate(max_ideals):
        return None
    fastest = float(prob.speed.max())
    limit = max(trivial_lower_bound(prob), 1e-300) * 1.25
    total = float(prob.work.sum()) / float(prob.speed.min())
    used = 0
    while True:
        band = limit * fastest * (1 + 1e-9)
        # The count over-counts pairs whose J is not inside I; on a chain of ideals (one
        # topological order) every smaller ideal is inside, so there it is exact.
        chain = len(lattice.masks) == prob.n + 1
        if _pairs_within(lattice, band) > ((max_pairs - used) if chain else _HOPELESS * max_pairs):
            return None  # the search below would run out of pairs: do not start it
        pairs = _Pairs(lattice, band, max_pairs - used)
        used = max_pairs - pairs.left
        if not pairs.complete:
            return None
        value, assign = _chain_dp(prob, lattice, pairs.arrays())
        if (assign is not None and value <= limit) or limit > total:
            break  # segments outside the band cost more than the optimum found (or there are none)
        limit = value if assign is not None else limit * 4
    if assign is None:
        return None
    return IdealResult(value, assign, prob.bottleneck(assign), used)
