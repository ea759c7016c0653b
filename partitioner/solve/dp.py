"""Exact minimum-bottleneck contiguous cuts of one topological order (banded DP + branch and bound).

Chain-on-chain partitioning is the classic problem behind this module (Bokhari 1988;
Iqbal & Bokhari 1995; Pinar & Aykanat 2004); PipeDream (Narayanan et al., SOSP 2019)
and Alpa (Zheng et al., OSDI 2022) use the same min-max DP over layer prefixes.

Our cost model makes a stage's time depend on more than its own segment: a tensor is
sent once per *consuming stage*, and a tensor skipping stages uses the slowest link in
between, so the exact cost of a segment depends on the other cuts. We therefore solve
in two steps:

1. **Lower DP.** ``best[s][j] = min_i max(best[s-1][i], lo_s(i, j))`` where ``lo_s`` is a
   per-segment *lower bound* on the stage time: exact compute and exact set of received
   tensors, each priced on the cheapest link it could have used (the one into this
   device), and each tensor with a consumer beyond the segment sent at least once over
   the link out of this device. Its optimum is a lower bound on the order's optimum, and
   equals it whenever no tensor is consumed by two later stages and links are uniform
   (always the case on chains). Segments whose compute alone exceeds a limit ``L`` are
   never better than ``L``, so the DP only scans a band of start positions (O(n·w·p)
   numpy work, w = ops per band); ``L`` grows until the optimum lies below it.
2. **Branch and bound.** If the exact cost of the DP's cuts (via the one cost model)
   is above the lower DP value, a depth-first search over cut positions, pruned by
   exact partial costs plus "at least one more copy" for tensors whose consumers are
   not yet placed, closes the gap within a deterministic work budget (the order lower
   bound is reported when it runs out), so the answer does not depend on machine load.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from partitioner.problem import Problem
from partitioner.recompute import CHOICES, OFFLOAD
from partitioner.solve.baselines import BASELINES, baseline_assign, cuts_to_assign, minmax_cuts
from partitioner.bounds import trivial_lower_bound

__all__ = ["DPResult", "dp_solve", "DP_SEARCH_WORK", "dp_search_work", "search_work", "link_prices", "least_memory",
           "LEAST_MEMORY_CELLS"]

_REL = 1e-12


@dataclass
class DPResult:
    """Best cuts of one order: ``assign`` (stage per position), exact ``value``, order bound."""

    assign: list[int]
    value: float
    order_lower_bound: float
    order_optimal: bool
    work: int
    wall_stopped: bool


def link_prices(prob: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per stage, the least a received and a sent tensor can cost: (in per byte, in per tensor,
    out per byte, out per tensor).

    A tensor into stage s from any earlier stage crosses the link s-1 -> s, and a multi-hop
    link is as slow as its slowest hop and as late as its latest, so that link's price is a
    lower bound; likewise s -> s+1 for a tensor leaving s.
    """
    p, k = prob.p, prob.directions
    in_b, in_l, out_b, out_l = (np.zeros(p) for _ in range(4))
    for s in range(1, p):
        in_b[s] = k / prob.bw[s - 1, s]
        in_l[s] = k * prob.lat[s - 1, s]
    for s in range(p - 1):
        out_b[s] = k / prob.bw[s, s + 1]
        out_l[s] = k * prob.lat[s, s + 1]
    return in_b, in_l, out_b, out_l


def node_runs(prob: Problem) -> list[range]:
    """The stages in runs joined by the fastest links (a cluster's nodes; one run on uniform links):
    a link slower than the fastest, by bandwidth or latency, leaves a node."""
    p = prob.p
    bandwidth = np.array([prob.bw[k - 1, k] for k in range(1, p)])
    latency = np.array([prob.lat[k - 1, k] for k in range(1, p)])
    slower = (bandwidth < bandwidth.max()) | (latency > latency.min()) if p > 1 else np.zeros(0, bool)
    starts = [0] + [k for k in range(1, p) if slower[k - 1]]
    return [range(a, b) for a, b in zip(starts, starts[1:] + [p])]


def _prefix(values: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(values)])


def _choice_sums(prob: Problem) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per recomputation choice any stage may take: prefix sums of kept, remade and recomputed-seconds
    per op, and which stages allow it."""
    out = {}
    for c in CHOICES:
        allowed = np.array([c in opts for opts in prob.choices])
        if allowed.any():
            out[c] = (_prefix(prob.rec.kept[c]), _prefix(prob.rec.remade[c]), _prefix(prob.rec.seconds[c]), allowed)
    return out


def _band_starts(prob: Problem, cw: np.ndarray, limit: float) -> np.ndarray:
    """Per end j, the first start i of a segment [i, j) whose compute (prefix sums ``cw``) is at most
    ``limit`` on the fastest device: the band the lower DP scans."""
    fastest = float(prob.speed.max())
    return np.maximum.accumulate(np.searchsorted(cw, cw - limit * fastest * (1 + 1e-9), side="left"))


def _lower_dp(prob: Problem, allowed: np.ndarray, limit: float, minimise: str = "time",
              keep: list[tuple[int, int, np.ndarray]] | None = None) -> tuple[float, list[int] | None]:
    """Min over cuts of max segment lower cost, scanning only segments with compute <= limit.

    Each segment costs what its stage pays under its fastest recomputation choice that fits
    (in this lower model's memory): the choice changes nothing on other stages. With
    ``minimise="memory"`` a segment costs its least memory over the choices instead (pass
    ``limit=inf``: every segment is scanned). ``keep`` collects (end, first start, costs per
    stage and start) of every end, for :func:`_completion_bounds`.
    """
    n, p = prob.n, prob.p
    cw = _prefix(prob.work)
    cf = _prefix(prob.fixed_mem)
    cstep = _prefix(prob.step_mem)
    sums = _choice_sums(prob)
    lo = _band_starts(prob, cw, limit)
    b = prob.out_bytes
    nz = (b > 0).astype(float)
    mc = np.array([s[-1] if s else -1 for s in prob.succ])
    inv_speed = 1.0 / prob.speed
    in_b, in_l, out_b, out_l = link_prices(prob)
    infl = np.array(prob.in_flight, dtype=float)
    rinfl = np.array(prob.recomputing, dtype=float)
    lim = np.array([math.inf if x is None else x * (1 + 1e-12) for x in prob.mem_limit])
    has_limit = bool(np.isfinite(lim).any())
    # What a stage keeps for its cut (Problem.kept_for_sending): the tensors it receives (rb,
    # exact) and the storages it sends beyond what it keeps anyway, counted only for ops that
    # own their storage, so a view sent without its base is missed: memory is never
    # overcounted here, which keeps the DP a relaxation (its value a lower bound) where it is not exact.
    own = {c: np.array([prob.rec.sent[c][u] if prob.root[u] == u else 0.0 for u in range(n)]) for c in sums}
    own_row = {c: 2 + k for k, c in enumerate(own)}
    suffixed = np.vstack([b, nz, *own.values()])  # rows summed from each segment start (below)
    # incoming[v]: (first start position, bytes) of each tensor first consumed at v from
    # a segment starting at or after that position (see R(i, j) in the module doc).
    incoming: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for u, succ in enumerate(prob.succ):
        if b[u] <= 0:
            continue
        prev = u
        for v in succ:
            incoming[v].append((prev + 1, float(b[u])))
            prev = v
    inv_speed_c, in_b_c, in_l_c, out_b_c, out_l_c, infl_c, rinfl_c = (
        x[:, None] for x in (inv_speed, in_b, in_l, out_b, out_l, infl, rinfl))
    lim_c = lim[:, None]
    allowed_c = {c: ok[:, None] for c, (*_, ok) in sums.items()}
    rb = np.zeros(n + 1)
    rc = np.zeros(n + 1)
    best = np.full((p, n + 1), math.inf)
    arg = np.zeros((p, n + 1), dtype=np.int64)
    for j in range(1, n + 1):
        v = j - 1
        lj = int(lo[j])
        for start, bu in incoming[v]:
            a = max(start, lj)
            if a <= v:
                rb[a:v + 1] += bu
                rc[a:v + 1] += 1.0
        if lj >= j:
            continue
        ii = np.arange(lj, j)
        live = mc[lj:j] >= j
        # From each start i to j: the bytes and count of the outputs still needed at or after j, and
        # (per choice) the storages kept for sending; one suffix sum over the stacked rows.
        sent = np.cumsum((suffixed[:, lj:j] * live)[:, ::-1], axis=1)[:, ::-1]
        sb, sc = sent[0], sent[1]
        comp = cw[j] - cw[lj:j]
        # (columns: per-stage prices; broadcasting is np.outer without its per-call checks, ~10^6 calls a search)
        base = (inv_speed_c * comp + in_b_c * rb[lj:j] + in_l_c * rc[lj:j] + out_b_c * sb + out_l_c * sc)
        cost = np.full_like(base, math.inf)
        taken = np.zeros(base.shape, dtype=bool)
        # The optimizer step's memory (state + workspace), the same under every choice.
        step = (cstep[j] - cstep[lj:j])[None, :]
        step_fits = step <= lim_c if has_limit and minimise != "memory" else True
        for c, (ck, cr, cs, ok) in sums.items():  # recomputing fastest first: the first that fits is taken
            if c != OFFLOAD and taken.all():
                continue  # every (stage, start) has its fastest recomputing choice: the slower ones cannot win
            fits = allowed_c[c]  # broadcast against the (stage, start) grid
            if has_limit or minimise == "memory":
                kept = ck[j] - ck[lj:j] + sent[own_row[c]]
                if prob.rec.received[c]:
                    kept = kept + rb[lj:j]
                mem = (cf[j] - cf[lj:j])[None, :] + infl_c * kept + rinfl_c * (cr[j] - cr[lj:j])
                if minimise == "memory":
                    cost = np.where(fits, np.minimum(cost, np.maximum(mem, step)), cost)
                    continue
                fits = fits & (mem <= lim_c) & step_fits
            if c == OFFLOAD:  # weighed by time against the recomputing choice taken (see Problem.stage_report)
                cost = np.where(fits, np.minimum(cost, base + inv_speed_c * (cs[j] - cs[lj:j])), cost)
                continue
            take = fits & ~taken
            if take.any():
                cost[take] = (base + inv_speed_c * (cs[j] - cs[lj:j]))[take]
                taken |= take
        if keep is not None:
            keep.append((j, lj, cost))  # every stage's lower cost of every segment [i, j) in the band
        if lj == 0:
            best[0, j] = cost[0, 0]
        if p > 1:
            cand = np.maximum(best[:p - 1, lj:j], cost[1:, :])
            pick = np.argmin(cand, axis=1)
            best[1:, j] = cand[np.arange(p - 1), pick]
            arg[1:, j] = ii[pick]
        if j < n and not allowed[j]:
            best[:, j] = math.inf
    value = float(best[p - 1, n])
    if not math.isfinite(value):
        return value, None
    cuts = []
    j = n
    for s in range(p - 1, 0, -1):
        j = int(arg[s, j])
        cuts.append(j)
    return value, cuts[::-1]


class _Budget:
    """A deterministic work budget (search nodes plus ops scanned) under a wall-clock safety limit."""

    def __init__(self, work: int, deadline: float):
        self.left, self.deadline = work, deadline
        self.used = self.calls = 0
        self.wall_stopped = False

    def spend(self, units: int) -> bool:
        """Charge ``units``; False once the work is spent or (checked every so often) the wall limit passed."""
        self.used += units
        self.left -= units
        self.calls += 1
        if self.left < 0:
            return False
        if self.calls & 255 == 0 and time.perf_counter() > self.deadline:
            self.wall_stopped = True
            return False
        return True


def _branch_and_bound(prob: Problem, allowed: np.ndarray, assign0: list[int], value0: float,
                      lower: float, budget: _Budget,
                      completion: np.ndarray | None = None) -> tuple[list[int], float, bool]:
    """Exact search over cut positions; returns (assign, value, finished). ``completion``
    (:func:`_completion_bounds`) bounds the stages not placed yet."""
    n, p, k = prob.n, prob.p, prob.directions
    # Python lists, not arrays: the search reads them one element at a time (same values, same arithmetic)
    speed = prob.speed.tolist()
    ob = prob.out_bytes.tolist()
    mc = [s[-1] if s else -1 for s in prob.succ]
    cw = _prefix(prob.work).tolist()
    speed_left = np.cumsum(prob.speed[::-1])[::-1].tolist()  # Σ speed over stages s..p-1
    cf = _prefix(prob.fixed_mem).tolist()
    cstep = _prefix(prob.step_mem).tolist()
    sums = {c: (ck.tolist(), cr.tolist(), cs.tolist()) for c, (ck, cr, cs, _) in _choice_sums(prob).items()}
    lim = [math.inf if x is None else x * (1 + 1e-12) for x in prob.mem_limit]
    bw, lat = prob.bw.tolist(), prob.lat.tolist()
    needed: dict[int, list[int]] = {}  # frontier -> the positions before it whose output is read at or after it
    best_assign, best_val = list(assign0), value0
    assign = [0] * n
    exact = [0.0] * p
    sent: set[tuple[int, int]] = set()
    finished = True

    def segment(s: int, i: int, j: int) -> float | None:
        """Seconds stage s recomputes (or offloads) at least with positions [i, j) (the fastest choice whose
        memory without the cut fits: the cut only adds); None when no choice fits even so."""
        if cstep[j] - cstep[i] > lim[s]:  # the optimizer step's memory
            return None
        least = None
        for c in prob.choices[s]:
            ck, cr, cs = sums[c]
            if cf[j] - cf[i] + prob.in_flight[s] * (ck[j] - ck[i]) + prob.recomputing[s] * (cr[j] - cr[i]) <= lim[s]:
                seconds = (cs[j] - cs[i]) / speed[s]
                if least is None or c == OFFLOAD and seconds < least:
                    least = seconds  # the first recomputing choice, or offloading where faster
        return least

    def place(s: int, i: int, j: int, recompute: float) -> list[tuple[int, int, float]]:
        """Put positions [i, j) on stage s; return the transfers added (for undo)."""
        added = []
        exact[s] += (cw[j] - cw[i]) / speed[s] + recompute
        for v in range(i, j):
            assign[v] = s
            for u in prob.pred[v]:
                a = assign[u]
                if a < s and ob[u] > 0 and (u, s) not in sent:
                    c = k * (ob[u] / bw[a][s] + lat[a][s])
                    sent.add((u, s))
                    exact[a] += c
                    exact[s] += c
                    added.append((u, a, c))
        return added

    def unplace(s: int, i: int, j: int, added: list[tuple[int, int, float]], recompute: float) -> None:
        exact[s] -= (cw[j] - cw[i]) / speed[s] + recompute
        for u, a, c in added:
            sent.discard((u, s))
            exact[a] -= c
            exact[s] -= c

    def bound(s_next: int, frontier: int) -> float:
        """Max over placed stages of exact cost + one more copy of each still-needed tensor."""
        extra = [0.0] * s_next
        live = needed.get(frontier)
        if live is None:
            live = needed[frontier] = [u for u in range(frontier) if mc[u] >= frontier and ob[u] > 0]
        for u in live:
            a = assign[u]
            extra[a] += k * (ob[u] / bw[a][s_next] + lat[a][s_next])
        return max(exact[a] + extra[a] for a in range(s_next))

    def search(s: int, i: int) -> None:
        nonlocal best_val, best_assign, finished
        if best_val <= lower * (1 + _REL):
            return
        if not budget.spend(1):
            finished = False
            return
        if s == p - 1:
            recompute = segment(s, i, n)
            if recompute is None:
                return
            added = place(s, i, n, recompute)
            promising = max(exact) < best_val * (1 - _REL)  # every stage's time, at least
            unplace(s, i, n, added, recompute)
            if not promising:
                return
            if not budget.spend(n):  # pricing a leaf scans every op
                finished = False
                return
            times, mem = prob.stage_costs(assign)  # exact: the cut tensors a stage keeps included
            if not prob.fits(mem):
                return
            val = max(times)
            if val < best_val * (1 - _REL):
                best_val, best_assign = val, list(assign)
            return
        # Compute only grows with j, so the ends worth trying are a prefix of the range; try them
        # nearest the balanced share first (the stage's speed times the mean remaining work per unit
        # of speed), so the first leaves are balanced plans and best_val falls early.
        last = min(n - (p - 1 - s), bisect.bisect_left(cw, cw[i] + best_val * speed[s] * (1 - _REL)) - 1)
        target = cw[i] + (cw[n] - cw[i]) * speed[s] / speed_left[s]
        for j in sorted(range(i + 1, last + 1), key=lambda j: abs(cw[j] - target)):
            if (cw[j] - cw[i]) / speed[s] >= best_val * (1 - _REL):
                continue  # best_val fell since the ends were listed
            if (cw[n] - cw[j]) / speed_left[s + 1] >= best_val * (1 - _REL):
                continue  # the later stages share the rest: one of them computes at least its mean
            if completion is not None and completion[s + 1, j] >= best_val * (1 - _REL):
                continue  # no cuts of the rest into the later stages can beat the incumbent
            recompute = segment(s, i, j) if allowed[j] else None
            if recompute is None:
                continue
            added = place(s, i, j, recompute)
            if not budget.spend(j):  # bound() scans the j placed positions
                finished = False
            elif bound(s + 1, j) < best_val * (1 - _REL):
                search(s + 1, j)
            unplace(s, i, j, added, recompute)
            if not finished:
                return

    search(0, 0)
    return best_assign, best_val, finished


def _banded_lower_dp(prob: Problem, allowed: np.ndarray) -> tuple[float, list[int] | None]:
    """The lower DP's optimum, widening the band until it provably covers the optimum.

    The first band reaches a balanced baseline's bottleneck when one fits (every segment
    of that plan lies inside it, so the lower optimum does, and one pass suffices), up to
    2.5x the trivial bound; else 1.25x the trivial bound.
    """
    trivial = max(trivial_lower_bound(prob), 1e-300)
    _, seed = _best_seed(prob, allowed, [], math.inf)
    limit = min(seed, 2.5 * trivial) if math.isfinite(seed) else 1.25 * trivial
    total = float(prob.work.sum()) / float(prob.speed.min())
    while True:
        value, cuts = _lower_dp(prob, allowed, limit)
        if cuts is not None and value <= limit:
            return value, cuts  # segments outside the band cost more than the optimum found
        if limit > total:
            return value, cuts  # the band already covered every segment
        limit = value if cuts is not None else limit * 4


#: Segment costs (stages x segments in the band) kept for the completion bounds; above this the
#: branch and bound goes without them.
COMPLETION_CELLS = 20_000_000


def _completion_bounds(prob: Problem, allowed: np.ndarray, limit: float) -> np.ndarray | None:
    """``lower[s, j]``: the least any cuts of positions j..n-1 into stages s..p-1 can cost, at least.

    The lower DP run backwards over the same per-segment lower costs (exact compute and
    received tensors, the cheapest links, every needed output sent once), so it bounds the
    stages the branch and bound has not placed yet. Only segments whose compute is at most
    ``limit`` are scanned: a completion using a longer one costs more than ``limit``, so
    with ``limit`` the incumbent's value the bound is exact for pruning. None when the
    segments in the band exceed :data:`COMPLETION_CELLS`.
    """
    n, p = prob.n, prob.p
    lo = _band_starts(prob, _prefix(prob.work), limit)
    if int(np.sum(np.arange(n + 1) - np.minimum(lo, np.arange(n + 1)))) * p > COMPLETION_CELLS:
        return None
    keep: list[tuple[int, int, np.ndarray]] = []
    _lower_dp(prob, allowed, limit, keep=keep)
    lower = np.full((p + 1, n + 1), math.inf)
    lower[p, n] = 0.0
    for s in range(p - 1, 0, -1):
        after = lower[s + 1]
        for j, lj, cost in keep:
            if j < n and not allowed[j]:
                continue  # no stage may end here
            if math.isfinite(after[j]):
                np.minimum(lower[s, lj:j], np.maximum(cost[s], after[j]), out=lower[s, lj:j])
    return lower


def _seeds(prob: Problem, allowed: np.ndarray, lower: list[int] | None = None) -> list[tuple[list[int], float]]:
    """The lower DP's cuts (when given) and the comm-blind balanced cuts of the baselines that fit
    memory with p stages, each with its exact bottleneck, in a fixed order."""
    out = []
    for cand in [*([lower] if lower is not None else []), *(baseline_assign(prob, b, allowed) for b in BASELINES)]:
        if len(set(cand)) != prob.p:
            continue
        t, mem = prob.stage_costs(cand)
        if prob.fits(mem):
            out.append((cand, max(t)))
    return out


def _best_seed(prob: Problem, allowed: np.ndarray, assign: list[int], value: float) -> tuple[list[int], float]:
    """The lower DP's cuts or the comm-blind balanced cuts of the baselines, whichever really costs least."""
    for cand, cand_value in _seeds(prob, allowed):
        if cand_value < value * (1 - _REL):
            assign, value = cand, cand_value
    return assign, value


def _node_aligned_seed(prob: Problem, allowed: np.ndarray, incumbent: list[int]) -> tuple[list[int], float] | None:
    """The cheapest plan found that sends a broadcast tensor from the first device of a node, or None.

    A tensor read on many stages (an encoder output read by every decoder layer, a position
    bias read by every attention) is sent once per reading stage by the stage that makes it;
    from the first device of a node most of those copies stay on the node's fast links,
    from its last device they all cross the network. The lower DP prices one copy per
    tensor on the link out of its stage and cannot see this, and the branch and bound
    seldom revisits the cuts that decide it. So for each of the ``NODE_SEED_SENDERS`` tensors
    whose copies cost most in the ``incumbent`` plan and each node boundary ``k``, the maker
    ``u`` gets stage ``k`` to itself, the ops before it are cut into ``k`` stages and those
    after it into the rest, both balanced by work (Pinar & Aykanat's min-max cuts), and
    the candidate is priced exactly, within ``NODE_SEED_WORK`` (n per candidate): deterministic.
    """
    n, p = prob.n, prob.p
    if p < 3:
        return None
    boundaries = [run.start for run in node_runs(prob)[1:] if run.start < p - 1]
    if not boundaries:
        return None  # one kind of link: no node boundary to align to
    work = prob.work.astype(float)
    best: tuple[list[int], float] | None = None
    left = NODE_SEED_WORK
    for u in _costliest_senders(prob, incumbent):
        for k in boundaries:
            if not (k <= u and p - k - 1 <= n - u - 1 and allowed[u] and allowed[u + 1]):
                continue
            if left < n:
                return best
            left -= n
            before = minmax_cuts(work[:u], k, allowed[:u + 1]) if k > 1 else []
            after = minmax_cuts(work[u + 1:], p - k - 1, allowed[u + 1:]) if p - k - 1 > 1 else []
            if len(before) != k - 1 or len(after) != max(0, p - k - 2):
                continue
            assign = cuts_to_assign([*before, u, u + 1, *(u + 1 + c for c in after)], n)
            times, mem = prob.stage_costs(assign)
            if prob.fits(mem) and (best is None or max(times) < best[1] * (1 - _REL)):
                best = (assign, max(times))
    return best


def _costliest_senders(prob: Problem, incumbent: list[int]) -> list[int]:
    """The ``NODE_SEED_SENDERS`` tensors sent to two or more stages whose copies cost most in ``incumbent``."""
    spent = {}
    for u, readers in enumerate(prob.succ):
        src, stages = incumbent[u], {incumbent[v] for v in readers} - {incumbent[u]}
        if prob.out_bytes[u] > 0 and len(stages) > 1:
            spent[u] = sum(prob.transfer_seconds(src, t, float(prob.out_bytes[u])) for t in stages)
    return sorted(spent, key=lambda u: (-spent[u], u))[:NODE_SEED_SENDERS]


def _copy_weighted_seed(prob: Problem, allowed: np.ndarray, incumbent: list[int]) -> tuple[list[int], float] | None:
    """The cheapest plan found by min-max cuts of work with a broadcast tensor's maker made heavier
    by what its copies may cost, or None.

    The maker's stage pays for every copy, which balanced cuts of compute cannot see: they give
    it as much compute as any other stage, and it becomes the bottleneck (the 9,003-op
    encoder-decoder on 64 stages: 75.4 ms). Weighting the maker by the copies it would send
    from the first stage to every other (C, an over-estimate: how many stages read it depends
    on the cuts) times ``COPY_SEED_SCALES`` leaves its stage room for them (66.8 ms at 1 to 1.25
    C, where dp's other starts shift to 69.4 ms). For each of the ``NODE_SEED_SENDERS`` tensors
    whose copies cost most in the ``incumbent`` plan; priced exactly, within ``NODE_SEED_WORK``
    ops priced (n per candidate): deterministic.
    """
    n, p = prob.n, prob.p
    if p < 2:
        return None
    best: tuple[list[int], float] | None = None
    left = NODE_SEED_WORK
    for u in _costliest_senders(prob, incumbent):
        copies = sum(prob.transfer_seconds(0, t, float(prob.out_bytes[u])) for t in range(1, p))
        for scale in COPY_SEED_SCALES:
            if left < n:
                return best
            left -= n
            work = prob.work.astype(float)
            work[u] += scale * copies * float(prob.speed.max())
            cuts = minmax_cuts(work, p, allowed)
            if len(cuts) != p - 1:
                continue
            assign = cuts_to_assign(cuts, n)
            times, mem = prob.stage_costs(assign)
            if prob.fits(mem) and (best is None or max(times) < best[1] * (1 - _REL)):
                best = (assign, max(times))
    return best


#: Senders tried by :func:`_node_aligned_seed` and :func:`_copy_weighted_seed`, and ops priced (n per
#: candidate) over all of them, by each.
NODE_SEED_SENDERS = 4
NODE_SEED_WORK = 200_000
#: Multiples of the copies' estimate the maker is weighted by in :func:`_copy_weighted_seed`.
COPY_SEED_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


#: Work units (branch-and-bound nodes plus ops scanned per node, n per leaf priced in full) dp
#: may spend closing its order gap: a count, not seconds, so the same input gets the same plan
#: and proof on any machine (about 2 s at most on one core of this 2-core machine; 2,000,000
#: before pricing was vectorised).
DP_SEARCH_WORK = 5_000_000

#: The budget :func:`dp_solve` spends when none is passed: DP_SEARCH_WORK, unless a caller set a smaller one for
#: what it runs within (:func:`dp_search_work`: the shape search's screen).
_search_work: contextvars.ContextVar[int] = contextvars.ContextVar("dp_search_work", default=DP_SEARCH_WORK)


def search_work() -> int:
    """The branch and bound's work budget in this context."""
    return _search_work.get()


@contextlib.contextmanager
def dp_search_work(work: int) -> Iterator[None]:
    """Within the block (this thread), :func:`dp_solve` spends at most ``work`` units closing its order gap."""
    token = _search_work.set(work)
    try:
        yield
    finally:
        _search_work.reset(token)


def dp_solve(prob: Problem, allowed: np.ndarray, *, work: int | None = None,
             wall_limit: float = 60.0) -> DPResult | None:
    """Best contiguous cuts of ``prob.order`` cutting only where ``allowed``; None when no cuts fit memory.

    ``work`` (default :func:`search_work`) bounds the branch and bound deterministically; ``wall_limit`` (seconds) is
    only a safety net, and ``DPResult.wall_stopped`` says when it, not the work, ended
    the search.
    """
    value, cuts = _banded_lower_dp(prob, allowed)
    if cuts is None:
        return None
    assign = lower = cuts_to_assign(cuts, prob.n)
    times, mem = prob.stage_costs(assign)
    exact = max(times) if prob.fits(mem) else math.inf  # a view's storage the lower DP did not count
    if exact <= value * (1 + 1e-9):
        return DPResult(assign, exact, value, True, 0, False)
    # The lower model undercounts tensors sent to several stages: search the cuts exactly.
    assign, exact = _best_seed(prob, allowed, assign, exact)
    aligned = [seed for seed in (_node_aligned_seed(prob, allowed, assign), _copy_weighted_seed(prob, allowed, assign))
               if seed is not None]
    for seed in aligned:
        if seed[1] < exact * (1 - _REL):
            assign, exact = seed
    budget = _Budget(search_work() if work is None else work, time.perf_counter() + wall_limit)
    completion = _completion_bounds(prob, allowed, exact) if math.isfinite(exact) else None
    assign, exact, finished = _branch_and_bound(prob, allowed, assign, exact, value, budget, completion)
    if finished and not math.isfinite(exact):
        return None  # the lower model's cuts fit only in its relaxed memory; no cut of the order fits
    wall_stopped = budget.wall_stopped
    if not finished and math.isfinite(exact) and not wall_stopped:
        # Shift the cuts of the search's plan and of every seed: the search's plan is seldom the
        # best start (on T5-small at 16 stages the uniform cuts shift to 0.54 ms, the search's to 0.91).
        # The search's plan gets a third of the work, the other starts share the rest.
        starts = {tuple(a): v for a, v in [(assign, exact), *_seeds(prob, allowed, lower), *aligned]}
        for k, (start, start_value) in enumerate(starts.items()):
            share = SHIFT_WORK // 3 if k == 0 or len(starts) == 1 else 2 * SHIFT_WORK // (3 * (len(starts) - 1))
            shifting = _Budget(share, budget.deadline)
            shifted, shifted_value = _shift_cuts(prob, allowed, list(start), start_value, shifting)
            wall_stopped = wall_stopped or shifting.wall_stopped
            if shifted_value < exact * (1 - _REL):
                assign, exact = shifted, shifted_value
    return DPResult(assign, exact, exact if finished else value, finished, budget.used, wall_stopped)


#: Ops priced (n per candidate) by cut shifting after an unfinished branch and bound, over all its
#: starts: about 5,500 candidates on a 550-op graph, 300 on 10,000 ops (at most about 1.6 s here
#: since pricing is vectorised; it was 750,000 before).
SHIFT_WORK = 3_000_000
_SHIFTS = (1, 2, 4, 8, 16, 32, 64, -1, -2, -4, -8, -16, -32, -64)


def _shift_cuts(prob: Problem, allowed: np.ndarray, assign: list[int], value: float,
                budget: _Budget) -> tuple[list[int], float]:
    """Move one cut (or two neighbouring ones) at a time while the stage times, largest first, fall.

    A local search on the plan the branch and bound left unproven (its depth-first search
    revisits the last cuts and seldom the first ones, which the tensors broadcast across the
    model, such as T5's position bias and encoder output, make expensive). Comparing the sorted
    times lexicographically accepts a move that relieves the second-slowest stage, so the
    search crosses plateaus of the bottleneck; the bottleneck never rises. The cuts beside the
    slowest stages are tried first (single cuts before pairs at equal times), the moves in a
    fixed order under a count of ops priced: deterministic, like the rest of dp.
    """
    n, p = prob.n, prob.p
    cuts = [s for s in range(1, n) if assign[s] != assign[s - 1]]

    def price(candidate: list[int]) -> tuple[tuple[float, ...], list[float]] | None:
        times, mem = prob.stage_costs(cuts_to_assign(candidate, n))
        return (tuple(sorted(times, reverse=True)), list(times)) if prob.fits(mem) else None

    current = price(cuts)
    if current is None or len(cuts) != p - 1:
        return assign, value  # nothing to shift from (a plan with an empty stage, or one over memory)
    # One cut, or two neighbouring cuts together (a stage slid whole: on a plateau, where
    # moving either of its cuts alone only trades the bottleneck between two stages).
    moves = [(k, 1) for k in range(p - 1)] + [(k, 2) for k in range(p - 2)]
    while True:
        best, times = current
        for k, width in sorted(moves, key=lambda m: -max(times[m[0]:m[0] + m[1] + 1])):
            low, high = cuts[k - 1] if k else 0, cuts[k + width] if k + width < p - 1 else n
            for shift in _SHIFTS:
                moved = [c + shift for c in cuts[k:k + width]]
                if not (low < moved[0] and moved[-1] < high and all(allowed[c] for c in moved)):
                    continue
                if not budget.spend(n):
                    return cuts_to_assign(cuts, n), best[0]
                candidate = [*cuts[:k], *moved, *cuts[k + width:]]
                got = price(candidate)
                if got is not None and got[0] < best:
                    cuts, current = candidate, got
                    break
            if current[0] is not best:
                break  # improved: rank the cuts again by the new times
        else:
            return cuts_to_assign(cuts, n), best[0]


#: ``least_memory`` scans every segment of every stage (n²·p/2 cells); above this it is skipped.
LEAST_MEMORY_CELLS = 40_000_000


def least_memory(prob: Problem, allowed: np.ndarray) -> tuple[float, float, list[int]] | None:
    """The least peak memory over contiguous cuts of ``prob.order``: (lower bound, a plan's peak, its cuts).

    The min-max DP of :func:`_lower_dp` with memory as the cost (each stage its least-memory
    recomputation choice); its value bounds every cut of this order from below, and its cuts,
    priced exactly, give a peak at which a plan exists. None above :data:`LEAST_MEMORY_CELLS`.
    """
    if prob.n * prob.n * prob.p / 2 > LEAST_MEMORY_CELLS:
        return None
    lower, cuts = _lower_dp(prob, allowed, math.inf, minimise="memory")
    if cuts is None:
        return None
    assign = cuts_to_assign(cuts, prob.n)
    per_choice = {c: prob.stage_report(assign, [c] * prob.p) for c in CHOICES}
    peak = max(min(per_choice[c][s].memory for c in prob.choices[s]) for s in range(prob.p))
    return lower, peak, assign
