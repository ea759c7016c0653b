"""A lower bound over every valid assignment (not one order): the banded DP over the ideals of the DAG.

Stages 0..s of a valid assignment hold an *ideal* I_s (a set closed under producers),
so a p-stage plan is a chain ∅ ⊂ I_0 ⊂ … ⊂ I_{p-1} = V and stage s is I_s \\ I_{s-1}.
dp.py's lower DP over the prefixes of one order is the special case of a chain of
prefixes; here the same per-segment lower cost (exact compute and memory, each received
tensor priced on the link into the stage, one copy of each tensor leaving the ideal on
the link out, see :func:`~partitioner.solve.dp.link_prices`) is minimised over chains of
*all* ideals. Its optimum is therefore a lower bound on the best bottleneck of any valid
assignment, and its chain is a plan, proven optimal when its exact cost meets the bound.

A tensor read by a chain of consumers (an encoder output read by every decoder layer) is
sent once per reading stage: a segment sending one pays for the fewest copies its readers'
span allows within the band, on the cheapest links out of its stage; and a bisection over a
copy-budget DP (:meth:`_ChainDP.feasible`) counts the copies of the costliest such tensor
exactly, priced from the node that holds its maker.
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

from partitioner.bounds import cheapest_links, consumer_chains, ConsumerChains, trivial_lower_bound
from partitioner.problem import Problem
from partitioner.recompute import OFFLOAD
from partitioner.solve.dp import link_prices, node_runs

__all__ = ["IdealResult", "ideal_dp", "MAX_IDEALS", "MAX_PAIRS"]

#: Ideals enumerated at most; wider graphs are left to CP-SAT.
MAX_IDEALS = 20_000
#: (sub-ideal, ideal) segment pairs visited at most, over all band widenings (~3-5 us each here).
MAX_PAIRS = 1_500_000
#: Give up once the searches so far, extrapolated to all, would visit this many times MAX_PAIRS pairs.
_PACE = 3
#: Budget DPs the bisection on the watched tensor's copies runs at most, and the relative width
#: of the interval it stops at (counts, not seconds: the same bound on any machine).
_MAKER_PASSES = 40
_MAKER_PRECISION = 1e-3
#: Bottlenecks between that bound and the plan already found at which the budget DP is run again
#: for plans only, each for every node not yet shown infeasible there (a count).
_PLAN_SWEEP = 12
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
    #: The min-max DP's value, before the copies of ``watched`` were counted exactly.
    min_max: float = math.nan
    #: The tensor (position) whose copies the bisection counted, if any.
    watched: int | None = None
    #: The chain found feasible at the least B with the copies counted: balanced where the bound
    #: is, though its exact cost is higher where the lower model is loose; a start for the moves
    #: (:mod:`partitioner.solve.moves`), which repair what the model missed.
    tightest: list[int] | None = None


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
    segment receives from J), ``sb``/``sc`` (of tensors it sends beyond I, once each, but
    those read by a chain of consumers), ``bc`` (an index into ``broadcasts``: those, with
    their fewest copies) and ``rx`` (1 when the segment receives the watched tensor).
    """

    KEYS = ("j", "i", "rb", "rc", "sb", "sc", "bc", "rx")

    def __init__(self, lattice: _Lattice, band: float, budget: int, chains: ConsumerChains):
        self.lattice, self.band, self.left, self.chains = lattice, band, budget, chains
        self.chain_of = {u: k for k, u in enumerate(chains.tensors)}
        self.out_bytes = [float(b) for b in lattice.prob.out_bytes]
        self.need: dict[int, int] = {}
        self.rows: list[tuple[int, int, float, int, float, int, int, int]] = []  # one per pair, in KEYS order
        # ``bc`` indexes these: the (tensor, copies) sent by a segment whose tensors are read by a
        # chain of consumers, priced per stage by the chain DP (0: none).
        self.broadcasts: dict[tuple[tuple[int, int], ...], int] = {(): 0}
        # ``rx``: whether the segment receives the tensor whose copies cost most within the band
        # (the most bytes times stages its readers must span; None when none must span two).
        spans = [(float(lattice.prob.out_bytes[u]) * (chains.groups(k, band) - 1), -k) for k, u in enumerate(chains.tensors)]
        top = max(range(len(spans)), key=spans.__getitem__, default=None)
        self.costliest_tensor = None if top is None or spans[top][0] <= 0 else chains.tensors[top]
        self.watched = 0 if self.costliest_tensor is None else 1 << self.costliest_tensor
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
        if all(prob.is_output[v] for v in _bits(ideal)):
            return  # a stage of nothing but the output node is empty
        outside = ((1 << prob.n) - 1) & ~ideal
        copies = self._copies(ideal)
        sent = [v for v in _bits(ideal) if prob.out_bytes[v] > 0 and lat.succ[v] & outside]
        plain = [float(prob.out_bytes[v]) for v in sent if copies(v) is None]
        spread = tuple((v, copies(v)) for v in sent if copies(v) is not None)
        self.rows.append((0, i, 0.0, 0, sum(plain), len(plain), self._broadcast_id(spread), 0))

    def _down_from(self, i: int, room: int) -> bool:
        """Depth-first from ideal I: remove one maximal op v of J at a time (J stays an ideal),
        keeping the received set and the sent tensors incrementally; record the pairs whose J
        fits in ``room`` stages. False once over budget (every J visited counts)."""
        lat, prob = self.lattice, self.lattice.prob
        sums, down, band = lat.sums["work"], lat.down(), self.band
        ob, pred = self.out_bytes, lat.pred
        outside = ((1 << prob.n) - 1) & ~lat.masks[i]
        copies = self._copies(lat.masks[i])
        watched = self.watched
        add = self.rows.append
        # Stages the ideals below may need (the same for every I: computed once, on first use).
        need = self.need
        output = prob.is_output
        # (J's index, received set, rb, rc, sb, sc, work of I \ J, (chain tensor, copies) it sends,
        # whether I \ J holds an op other than the model's output node: a stage of nothing else is empty)
        stack = [(i, 0, 0.0, 0, 0.0, 0, 0.0, (), False)]
        seen = {i}
        while stack:
            sub, recv, rb, rc, sb, sc, done, spread, real = stack.pop()
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
                nsb, nsc, nspread = sb, sc, spread
                if b > 0 and lat.succ[v] & outside:
                    sent = copies(v)
                    if sent is None:
                        nsb, nsc = sb + b, sc + 1
                    else:
                        nspread = spread + ((v, sent),)
                stages = need.get(below)
                if stages is None:
                    stages = need[below] = _stages_for(sums[below], band, below == 0)
                nreal = real or not output[v]
                if stages <= room and nreal:
                    add((below, i, nrb, nrc, nsb, nsc, self._broadcast_id(nspread) if nspread else 0,
                         1 if ((recv & ~(1 << v)) | pred[v]) & watched else 0))
                self.left -= 1
                if self.left < 0:
                    return False
                stack.append((below, (recv & ~(1 << v)) | pred[v], nrb, nrc, nsb, nsc, seg_work, nspread, nreal))
        return True

    def _copies(self, ideal: int):
        """v -> for a tensor read by a chain of consumers, the fewest copies of it sent beyond
        ``ideal``: the stages its consumers outside the ideal span within the band (at least 1);
        None for any other tensor (one copy)."""
        cache: dict[int, int] = {}

        def copies(v: int) -> int | None:
            k = self.chain_of.get(v)
            if k is None:
                return None
            if v not in cache:
                chain = self.chains.chains[k]
                first = sum(1 for c in chain if ideal >> c & 1)  # the chain's consumers inside: a prefix
                cache[v] = max(1, self.chains.groups(k, self.band, first))
            return cache[v]
        return copies

    def _broadcast_id(self, spread: tuple[tuple[int, int], ...]) -> int:
        return self.broadcasts.setdefault(tuple(sorted(spread)), len(self.broadcasts))

    def arrays(self) -> dict[str, np.ndarray]:
        cols = np.array(self.rows, dtype=float).reshape(-1, len(self.KEYS)).T
        return {k: cols[c].astype(np.int64) if k in ("j", "i", "bc", "rx") else cols[c] for c, k in enumerate(self.KEYS)}


class _ChainDP:
    """The searches over chains of ideals on one band's pairs: each pair's lower cost on each stage
    (shared by the stages priced alike), the min-max DP and the maker's copy-budget DP."""

    def __init__(self, prob: Problem, lattice: _Lattice, pairs: _Pairs):
        self.prob, self.lattice = prob, lattice
        cols = pairs.arrays()
        order = np.lexsort((cols["j"], cols["i"]))  # group pairs by their ideal I (ties: smallest J first)
        cols = {key: values[order] for key, values in cols.items()}
        self.cols, self.j, self.i = cols, cols["j"], cols["i"]
        self.starts = np.flatnonzero(np.r_[True, self.i[1:] != self.i[:-1]]) if len(self.i) else np.empty(0, int)
        self.ends = np.r_[self.starts[1:], len(self.i)]
        self.targets = self.i[self.starts]
        self.group_of = dict(zip(self.targets.tolist(), range(len(self.targets))))
        self.top = lattice.index[(1 << prob.n) - 1]
        sums = {key: np.asarray(values) for key, values in lattice.sums.items()}
        self.seg = {key: values[self.i] - values[self.j] for key, values in sums.items()}
        union = {c for opts in prob.choices for c in opts}
        self.kept_of = {c: self.seg[f"kept:{c}"] + (cols["rb"] if prob.rec.received[c] else 0.0) for c in union}
        self.links = link_prices(prob)
        self.per_byte, self.per_tensor = cheapest_links(prob)
        self.broadcasts = list(pairs.broadcasts)
        self.watched: int | None = pairs.costliest_tensor
        self._kinds: dict[tuple, np.ndarray] = {}
        self._spread: dict[tuple[int, int], np.ndarray] = {}
        # Memory binds nowhere when every segment fits the smallest limit at the most microbatches
        # in flight: then stages priced alike (one node's devices) share one cost array.
        tightest = min((x for x in prob.mem_limit if x is not None), default=math.inf)
        fixed, step = self.seg["fixed"], self.seg["step"]
        self.binds = math.isfinite(tightest) and any(
            float(np.max(np.maximum(fixed + max(prob.in_flight) * self.kept_of[c]
                                    + max(prob.recomputing) * self.seg[f"remade:{c}"], step), initial=0.0)) > tightest
            for c in union)

    def _priced(self, s: int, part: slice) -> np.ndarray:
        """The lower cost on stage s of the pairs in ``part`` but the multi-copy sends
        (memory-infeasible pairs at inf)."""
        prob, cols, seg = self.prob, self.cols, self.seg
        in_b, in_l, out_b, out_l = self.links
        lim = math.inf if prob.mem_limit[s] is None else prob.mem_limit[s] * (1 + 1e-12)
        base = (seg["work"][part] / prob.speed[s] + in_b[s] * cols["rb"][part] + in_l[s] * cols["rc"][part]
                + out_b[s] * cols["sb"][part] + out_l[s] * cols["sc"][part])
        # The fastest recomputation choice whose memory fits: what the segment keeps (with the
        # tensors it receives, exact; what it sends is left out, so memory is a relaxation).
        # Recomputing choices fastest first (the first that fits is taken), offloading where it is faster.
        cost = np.full_like(base, math.inf)
        recomputing = [c for c in prob.choices[s] if c != OFFLOAD]
        for c in reversed(recomputing):
            cost = np.where(self._fits(s, c, part, lim), base + seg[f"seconds:{c}"][part] / prob.speed[s], cost)
        if OFFLOAD in prob.choices[s]:
            cost = np.where(self._fits(s, OFFLOAD, part, lim),
                            np.minimum(cost, base + seg[f"seconds:{OFFLOAD}"][part] / prob.speed[s]), cost)
        return np.where(self.j[part] == 0, cost, math.inf) if s == 0 else cost

    def _fits(self, s: int, c: str, part: slice, lim: float) -> np.ndarray:
        """Which pairs in ``part`` fit stage s's memory under choice ``c`` (and at the optimizer's step)."""
        prob, seg = self.prob, self.seg
        mem = seg["fixed"][part] + prob.in_flight[s] * self.kept_of[c][part] + prob.recomputing[s] * seg[f"remade:{c}"][part]
        return (mem <= lim) & (seg["step"][part] <= lim)

    def _spread_cost(self, s: int, without: int) -> np.ndarray:
        """Per set of multi-copy sends (``bc``), what stage s pays at least to send them but tensor
        ``without``: each tensor's g copies on the g cheapest links out of s, and at least one copy
        on the link s -> s+1 (see link_prices); inf where fewer than g stages follow s."""
        key = (s, without)
        if key not in self._spread:
            out_b, out_l = self.links[2], self.links[3]
            nbytes = self.prob.out_bytes

            def one(u: int, g: int) -> float:
                if g >= self.prob.p:
                    return math.inf
                return max(nbytes[u] * out_b[s] + out_l[s], nbytes[u] * self.per_byte[s, g] + self.per_tensor[s, g])
            self._spread[key] = np.array([sum(one(u, g) for u, g in spread if u != without)
                                          for spread in self.broadcasts])
        return self._spread[key]

    def cost(self, s: int, part: slice = slice(None), without: int = -1) -> np.ndarray:
        """Each pair's lower cost on stage s (the copies of ``without`` left to the caller)."""
        prob = self.prob
        if self.binds or s == 0:
            base = self._priced(s, part)  # where memory binds the stages differ in microbatches in flight
        else:
            key = (prob.speed[s], *(float(x[s]) for x in self.links), tuple(prob.choices[s]))
            if key not in self._kinds:
                self._kinds[key] = self._priced(s, slice(None))
            base = self._kinds[key][part]
        if len(self.broadcasts) > 1:
            base = base + self._spread_cost(s, without)[self.cols["bc"][part]]
        return base

    def _trace(self, last: np.ndarray, step) -> list[int]:
        """The plan of the chain ending at V: back from stage p-1, at each ideal the first pair whose
        ``step(s, part)`` reproduces the stored ``last[s, I]``."""
        assign, ideal = [0] * self.prob.n, self.top
        for s in range(self.prob.p - 1, -1, -1):
            g = self.group_of[ideal]
            lo, hi = int(self.starts[g]), int(self.ends[g])
            below = int(self.j[lo + int(np.flatnonzero(step(s, slice(lo, hi)) == last[s, ideal])[0])])
            for v in _bits(self.lattice.masks[ideal] & ~self.lattice.masks[below]):
                assign[v] = s
            ideal = below
        return assign

    def least_bottleneck(self) -> tuple[float, list[int] | None]:
        """min over chains of ideals of the max segment lower cost; the chain as a stage per position."""
        p, j = self.prob.p, self.j
        if not len(j):
            return math.inf, None
        best = np.full((p, len(self.lattice.masks)), math.inf)

        def step(s: int, part: slice) -> np.ndarray:
            cost = self.cost(s, part)
            return cost if s == 0 else np.maximum(best[s - 1][j[part]], cost)
        for s in range(p):
            best[s, self.targets] = np.minimum.reduceat(step(s, slice(None)), self.starts)
        value = float(best[p - 1, self.top])
        return (value, self._trace(best, step)) if math.isfinite(value) else (value, None)

    def feasible(self, bound: float, senders: range) -> list[int] | None:
        """A chain whose every segment costs <= ``bound`` with the maker of the watched tensor u
        on one of ``senders`` and paying for each copy of u, or None when there is none.

        Every valid plan whose maker of u is on ``senders`` and whose bottleneck is <= ``bound``
        is such a chain: its stage holding u computes it and sends one copy to each later stage
        reading it, each on a link from a stage of ``senders`` (priced at its cheapest), and the
        stage receiving a copy pays for the same link. Per (stage, ideal) the DP keeps the most
        that the maker has left for copies (inf before u is made), so the copies of u are
        counted exactly, where the min-max DP counts the fewest its readers' span allows.
        """
        prob, p, j, u = self.prob, self.prob.p, self.j, self.watched
        if not len(j):
            return None
        holds = np.array([m >> u & 1 for m in self.lattice.masks], dtype=bool)
        makes, reads = holds[self.i] & ~holds[j], self.cols["rx"] == 1
        in_b, in_l = self.links[0], self.links[1]
        nbytes = float(prob.out_bytes[u])
        left = np.full((p, len(self.lattice.masks)), -math.inf)

        def step(s: int, part: slice) -> np.ndarray:
            cost = self.cost(s, part, without=u)
            if s not in senders:
                cost = np.where(makes[part], math.inf, cost)
            links = [prob.directions * (nbytes / prob.bw[a, s] + prob.lat[a, s]) for a in senders if a < s]
            copy = min(links, default=math.inf)  # one end of one copy of u into s
            # The receiving end: above the link s-1 -> s already priced unless s-1 is a sender.
            cost = np.where(reads[part], cost + max(0.0, copy - (nbytes * in_b[s] + in_l[s])), cost)
            prev = np.where(j[part] == 0, math.inf, -math.inf) if s == 0 else left[s - 1][j[part]]
            with np.errstate(invalid="ignore"):  # inf - inf before u is made: no copy to pay then
                kept = np.where(makes[part], np.where(prev > -math.inf, bound - cost, -math.inf),
                                np.where(reads[part], prev - copy, prev))
            kept[~((kept >= 0) & (cost <= bound))] = -math.inf
            return kept
        for s in range(p):
            left[s, self.targets] = np.maximum.reduceat(step(s, slice(None)), self.starts)
        return self._trace(left, step) if left[p - 1, self.top] >= 0 else None


def _raise_by_copies(dp: _ChainDP, low: float, high: float) -> tuple[float, list[tuple[float, list[int]]]]:
    """Bisection on B in (low, high]: the largest B shown infeasible for every node that may hold the
    watched tensor's maker (a lower bound on every valid plan), and the chains found feasible
    (plans), each with the B it was found at. At most _MAKER_PASSES budget DPs, to a relative _MAKER_PRECISION: counts.

    Then, for plans only, _PLAN_SWEEP values of B spread evenly over (bound, high], from the top: a chain that
    is feasible in the lower model costs more in exact terms where the model is loose (a tensor
    received from many stages back, priced on the link from the previous one), and a larger B
    admits other chains. On the 903-op encoder-decoder at 64 stages the bisection's chains cost
    8.386 ms, the sweep's best 8.176 ms."""
    nodes = node_runs(dp.prob)
    floor = {node: low for node in nodes}  # per node, a B at which it is infeasible
    plans, passes, top = [], 0, high
    while high - low > _MAKER_PRECISION * high and passes < _MAKER_PASSES:
        mid, found = 0.5 * (low + high), None
        for node in nodes:
            if mid <= floor[node] or passes == _MAKER_PASSES:
                continue
            passes += 1
            found = dp.feasible(mid, node)
            if found is not None:
                break
            floor[node] = mid
        if found is None and passes < _MAKER_PASSES:
            low = mid
        elif found is not None:
            high = mid
            plans.append((mid, found))
    for k in range(_PLAN_SWEEP, 0, -1):  # downwards: a node infeasible at one B is at every lower one
        bound = low + (top - low) * k / _PLAN_SWEEP
        for node in nodes:
            if bound > floor[node]:
                found = dp.feasible(bound, node)
                if found is None:
                    floor[node] = bound
                else:
                    plans.append((bound, found))
    return low, plans


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
    chains = consumer_chains(prob)
    limit = max(min(max(trivial_lower_bound(prob), 1e-300) * 1.25, upper), 1e-300)  # a band of 0 divides by 0
    # Past this every segment is in the band and every consumer chain's hull fits it (the chains
    # weigh least_work, recomputation included): a wider band changes nothing.
    total = float(prob.least_work.sum()) / float(prob.speed.min())
    used = 0
    while True:
        band = limit * fastest * (1 + 1e-9)
        # The count over-counts pairs whose J is not inside I; on a chain of ideals (one
        # topological order) every smaller ideal is inside, so there it is exact.
        chain = len(lattice.masks) == prob.n + 1
        if _pairs_within(lattice, band) > ((max_pairs - used) if chain else _HOPELESS * max_pairs):
            return None  # the search below would run out of pairs: do not start it
        pairs = _Pairs(lattice, band, max_pairs - used, chains)
        used = max_pairs - pairs.left
        if not pairs.complete:
            return None
        dp = _ChainDP(prob, lattice, pairs)
        value, assign = dp.least_bottleneck()
        if assign is not None and value <= limit:
            break  # segments outside the band cost more than the optimum found
        if assign is None and limit > total:
            break  # every segment is in the band and no chain fits memory
        # Widen the band to the value found (or 4x when none): with every segment already in it
        # (limit > total) the next pass still counts copies at the wider band, fewer or as many,
        # so its value is at most this one and the loop ends. Stopping here instead would count
        # copies for stages no larger than a band below the optimum: more than a plan must send.
        limit = value if assign is not None else limit * 4
    if assign is None:
        return None
    bound, plans, tightest = value, [assign], None
    if dp.watched is not None and value < min(upper, limit):
        # Every B up to the band has all its segment pairs: infeasible there is proven.
        bound, found = _raise_by_copies(dp, value, min(upper, limit))
        plans += [plan for _, plan in found]
        tightest = min(found, key=lambda bp: bp[0])[1] if found else None
    # The lower model's memory is a relaxation (it leaves out the cut tensors a stage keeps for
    # sending): prefer the plans that fit, then the fastest.
    best = min(plans, key=lambda a: (not prob.fits(prob.stage_costs(a)[1]), prob.bottleneck(a)))
    return IdealResult(bound, best, prob.bottleneck(best), used, value, dp.watched, tightest)
