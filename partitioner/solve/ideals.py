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
#: (sub-ideal, ideal) segment pairs visited at most, over all band widenings (~3-5 us each here).
MAX_PAIRS = 1_500_000
#: Give up once the searches so far, extrapolated to all, would visit this many times MAX_PAIRS pairs.
_PACE = 3
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
        self._down: list[list[tuple[int, float, int]]] | None = None

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

    def down(self) -> list[list[tuple[int, float, int]]]:
        """Per ideal, (v, work of v, index of the ideal without v) for each of its maximal ops v:
        the edges a search from an ideal down to its sub-ideals walks (built once)."""
        if self._down is None:
            work = [float(w) for w in self.prob.work]
            self._down = [[(v, work[v], self.index[mask & ~(1 << v)]) for v in _bits(self.maximal[k])]
                          for k, mask in enumerate(self.masks)]
        return self._down

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
        self.out_bytes = [float(b) for b in lattice.prob.out_bytes]
        self.need: dict[int, int] = {}
        self.rows: list[tuple[int, int, float, int, float, int]] = []  # one per pair, in KEYS order
        self.complete = True
        rooms = [_room_below(lattice, band, i) for i in range(len(lattice.masks))]
        deep = sum(room > 0 for room in rooms[1:])
        searched = 0
        for i in range(1, len(lattice.masks)):
            room = rooms[i]
            if room == 0:
                self._from_nothing(i)
            elif room > 0:
                searched += 1
                if not self._down_from(i, room) or self._hopeless(budget, searched, deep):
                    self.complete = False
                    return

    def _hopeless(self, budget: int, searched: int, deep: int) -> bool:
        """After 0.5% of the searches (at least 16), whether their pace would need over _PACE x the
        budget: GPT-2-base on 4 stages stops after 29 of 5,853 searches instead of after the whole
        budget (on course for 26 million pairs); a count, so deterministic."""
        if searched < max(16, deep // 200):
            return False
        return (budget - self.left) * deep > _PACE * budget * searched

    def _from_nothing(self, i: int) -> None:
        """The one useful pair of ideal I when only ∅ may lie below it: the first stage holds all of I."""
        lat, prob = self.lattice, self.lattice.prob
        self.left -= 1
        if lat.sums["work"][i] > self.band * (1 + 1e-9):  # the DFS's own sums may round the other way
            return
        ideal = lat.masks[i]
        outside = ((1 << prob.n) - 1) & ~ideal
        sent = [float(prob.out_bytes[v]) for v in _bits(ideal) if prob.out_bytes[v] > 0 and lat.succ[v] & outside]
        self.rows.append((0, i, 0.0, 0, sum(sent), len(sent)))

    def _down_from(self, i: int, room: int) -> bool:
        """Depth-first from ideal I: remove one maximal op v of J at a time (J stays an ideal),
        keeping the received set and the sent tensors incrementally; record the pairs whose J
        fits in ``room`` stages. False once over budget (every J visited counts)."""
        lat, prob = self.lattice, self.lattice.prob
        sums, down, band = lat.sums["work"], lat.down(), self.band
        ob, pred = self.out_bytes, lat.pred
        outside = ((1 << prob.n) - 1) & ~lat.masks[i]
        add = self.rows.append
        # Stages the ideals below may need (the same for every I: computed once, on first use).
        need = self.need
        # (J's index, received set, rb, rc, sb, sc, work of I \ J)
        stack = [(i, 0, 0.0, 0, 0.0, 0, 0.0)]
        seen = {i}
        while stack:
            sub, recv, rb, rc, sb, sc, done = stack.pop()
            for v, seg, below in down[sub]:
                seg_work = done + seg
                if seg_work > band or below in seen:
                    continue
                seen.add(below)
                b = ob[v]
                nrb, nrc = (rb - b, rc - 1) if recv >> v & 1 and b > 0 else (rb, rc)  # v moves inside
                fresh = pred[v] & ~recv
                while fresh:  # v's producers not yet received become received
                    low = fresh & -fresh
                    u = low.bit_length() - 1
                    fresh ^= low
                    if ob[u] > 0:
                        nrb, nrc = nrb + ob[u], nrc + 1
                nsb, nsc = (sb + b, sc + 1) if b > 0 and lat.succ[v] & outside else (sb, sc)
                stages = need.get(below)
                if stages is None:
                    stages = need[below] = _stages_for(sums[below], band, below == 0)
                if stages <= room:
                    add((below, i, nrb, nrc, nsb, nsc))
                self.left -= 1
                if self.left < 0:
                    return False
                stack.append((below, (recv & ~(1 << v)) | pred[v], nrb, nrc, nsb, nsc, seg_work))
        return True

    def arrays(self) -> dict[str, np.ndarray]:
        cols = np.array(self.rows, dtype=float).reshape(-1, len(self.KEYS)).T
        return {k: cols[c].astype(np.int64) if k in ("j", "i") else cols[c] for c, k in enumerate(self.KEYS)}


def _chain_dp(prob: Problem, lattice: _Lattice, pairs: dict[str, np.ndarray]) -> tuple[float, list[int] | None]:
    """min over chains of ideals of the max segment lower cost; the chain as a stage per position."""
    p, k_ideals = prob.p, len(lattice.masks)
    if not len(pairs["j"]):
        return math.inf, None
    order = np.lexsort((pairs["j"], pairs["i"]))  # group pairs by their ideal I (ties: smallest J first)
    pairs = {key: values[order] for key, values in pairs.items()}
    j, i = pairs["j"], pairs["i"]
    sums = {key: np.asarray(values) for key, values in lattice.sums.items()}

    def seg(key: str) -> np.ndarray:
        return sums[key][i] - sums[key][j]

    comp, fixed, step = seg("work"), seg("fixed"), seg("step")
    union = {c for opts in prob.choices for c in opts}  # each choice's segment sums, once for every stage
    kept_of = {c: seg(f"kept:{c}") + (pairs["rb"] if prob.rec.received[c] else 0.0) for c in union}
    remade_of, seconds_of = {c: seg(f"remade:{c}") for c in union}, {c: seg(f"seconds:{c}") for c in union}
    in_b, in_l, out_b, out_l = link_prices(prob)
    costs: dict[tuple, np.ndarray] = {}
    # Memory binds nowhere when every segment fits the smallest limit at the most microbatches
    # in flight: then stages priced alike (one node's devices) share one cost array.
    tightest = min((x for x in prob.mem_limit if x is not None), default=math.inf)
    binds = math.isfinite(tightest) and any(
        float(np.max(np.maximum(fixed + max(prob.in_flight) * kept_of[c] + max(prob.recomputing) * remade_of[c],
                                step))) > tightest for c in union)

    def priced(s: int, part: slice) -> np.ndarray:
        """The lower cost on stage s of the pairs in ``part`` (memory-infeasible pairs at inf)."""
        lim = math.inf if prob.mem_limit[s] is None else prob.mem_limit[s] * (1 + 1e-12)
        base = (comp[part] / prob.speed[s] + in_b[s] * pairs["rb"][part] + in_l[s] * pairs["rc"][part]
                + out_b[s] * pairs["sb"][part] + out_l[s] * pairs["sc"][part])
        # The fastest recomputation choice whose memory fits: what the segment keeps (with the
        # tensors it receives, exact; what it sends is left out, so memory is a relaxation).
        cost = np.full_like(base, math.inf)
        for c in reversed(prob.choices[s]):
            mem = fixed[part] + prob.in_flight[s] * kept_of[c][part] + prob.recomputing[s] * remade_of[c][part]
            cost = np.where((mem <= lim) & (step[part] <= lim), base + seconds_of[c][part] / prob.speed[s], cost)
        return np.where(j[part] == 0, cost, math.inf) if s == 0 else cost

    def stage_cost(s: int, part: slice = slice(None)) -> np.ndarray:
        """``priced``, shared by the stages priced alike when memory binds nowhere (one array per
        kind of stage; where it binds, the stages differ in microbatches in flight and each
        array is used once: not kept)."""
        if binds or s == 0:
            return priced(s, part)
        key = (prob.speed[s], in_b[s], in_l[s], out_b[s], out_l[s], tuple(prob.choices[s]))
        if key not in costs:
            costs[key] = priced(s, slice(None))
        return costs[key][part]

    starts = np.flatnonzero(np.r_[True, i[1:] != i[:-1]])
    ends = np.r_[starts[1:], len(i)]
    targets = i[starts]
    best = np.full((p, k_ideals), math.inf)
    for s in range(p):
        cand = stage_cost(s) if s == 0 else np.maximum(best[s - 1][j], stage_cost(s))
        best[s, targets] = np.minimum.reduceat(cand, starts)
    top = lattice.index[(1 << prob.n) - 1]
    value = float(best[p - 1, top])
    if not math.isfinite(value):
        return value, None
    group_of = dict(zip(targets.tolist(), range(len(targets))))
    assign = [0] * prob.n
    ideal = top
    for s in range(p - 1, -1, -1):  # back along the chain: the first pair of I that attains its best
        g = group_of[ideal]
        lo, hi = int(starts[g]), int(ends[g])
        cost = stage_cost(s, slice(lo, hi))
        cand = cost if s == 0 else np.maximum(best[s - 1][j[lo:hi]], cost)
        below = int(j[lo + int(np.flatnonzero(cand == best[s, ideal])[0])])
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


def ideal_dp(prob: Problem, *, upper: float = math.inf, max_ideals: int = MAX_IDEALS,
             max_pairs: int = MAX_PAIRS) -> IdealResult | None:
    """The ideal DP's bound and plan; None when the DAG has more than ``max_ideals`` ideals,
    the pairs exceed ``max_pairs`` or nothing fits memory.

    ``upper``, the bottleneck of a plan already found, narrows the first band: the lower
    model's optimum is at most the true one, so every segment of its chain has compute below
    ``upper`` and one pass within that band finds it.
    """
    lattice = _Lattice(prob)
    if not lattice.enumerate(max_ideals):
        return None
    fastest = float(prob.speed.max())
    limit = max(min(max(trivial_lower_bound(prob), 1e-300) * 1.25, upper), 1e-300)  # a band of 0 divides by 0
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
