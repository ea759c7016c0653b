"""A lower bound from the tensors every cut of a plan carries: the least crossing of an ideal in each cut's window.

Under a bottleneck B every stage t holds at most ``B × speed_t`` of work (least work, on one device of
speed 1), so the ops of the first s stages (an ideal ``D_s``: closed under producers) weigh between
``W - B Σ_{t>=s} speed_t`` and ``B Σ_{t<s} speed_t``: a window. A tensor made in ``D_s`` and read
after it crosses cut s, and brings that cut up to two transfer ends:

- stage s receives it, unless it skips stage s: then a consumer c lies beyond ``D_{s+1}``, and so do
  all c's descendants, whose work ``δ(c)`` is then at most ``B Σ_{t>s} speed_t``;
- stage s-1 sends it, unless it was made before stage s-1: then all its ancestors lie in ``D_{s-1}``,
  and their work ``α(u)`` is at most ``B Σ_{t<s-1} speed_t``.

A tensor whose ``δ`` and ``α`` rule an escape out pays that end, at least the least one end of a
transfer across the cut costs. Ends at different cuts are different (a receive by stage s, a send by
stage s-1), so with ``c_s`` the least such price over every ideal in the window of cut s (CP-SAT:
a min-cut with the ideal's work constrained, solved or bounded from below)::

    W + min speed × Σ_s c_s  <=  Σ_t speed_t × T_t  <=  B Σ_t speed_t

and where the left side is larger no plan has a bottleneck of B or less. The same holds for the stages on
either side of one cut: those before cut s pay every end counted at the cuts before it, those after it every
end counted at the cuts after it, so ``W(D_s) <= B Σ_{t<s} speed_t - min speed × Σ_{j<s} c_j`` and
``W(D_s) >= W - B Σ_{t>=s} speed_t + min speed × Σ_{j>s} c_j``: each window narrows by the others' ends, its
least crossing rises, and the cuts are weighed again until no window narrows (an empty window proves the
cap). The bound is the highest B so proven, by bisection between the bound so far and the plan. It is
the sum of what the stages pay, so it proves where plans are close to the work bound and every cut
carries tensors whatever its shape: the 1,000-op random layered DAG at 8 stages (7.748 -> 7.878 ms in
4.6 deterministic seconds, 7.892 in 10.0 with the windows narrowed; at 7.87 ms the windows are 1.3 ms
wide, a stage's work 7.7); where the windows are wider than a stage's work (a plan 40% above the work
bound, or 64 stages) an ideal in each window crosses little that must be paid, and it proves nothing
(docs/optimizer.md, "Cut crossings"). Memory and colocation are left out (a relaxation), and integers
round in the direction that keeps the bound valid: work and prices down, the windows and the thresholds
widened by a unit per op and a part per billion.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
from ortools.sat.python import cp_model

from partitioner.bounds import closures, masked_sum
from partitioner.problem import Problem
from partitioner.solve.cpsat_model import NS_PER_SECOND, least_end_price, proof_solver, weighted

__all__ = ["CrossingBound", "CutCrossings", "crossing_lower_bound", "closure_work"]

_FLOAT = 1e-9  # relative slack for float sums (a stage's time and its ops' work, summed in other orders)
#: Deterministic seconds one cut's least crossing may take (unfinished, its bound from below still counts).
CUT_BUDGET = 1.0
#: Rounds of narrowing the windows by the other cuts' ends and weighing the cuts whose window narrowed again (the
#: 1,000-op layered DAG at 8 stages: 1 to 4 rounds until no window narrows).
NARROWING_ROUNDS = 8
#: Stop once the caps left to try span less than this fraction of the plan.
RTOL = 1e-3


@dataclass
class CrossingBound:
    """The highest cap proven (``lower_bound``, the ``lower`` given when none), each cap tried with whether it
    was proven, and the deterministic seconds spent."""

    lower_bound: float
    tries: list[tuple[float, bool]] = field(default_factory=list)
    deterministic_seconds: float = 0.0
    wall_stopped: bool = False


def closure_work(prob: Problem, work: np.ndarray) -> tuple[list[int], list[int]]:
    """Per op, the summed ``work`` (integers) of its ancestors and of its descendants, itself included in both."""
    ancestors, descendants = closures(prob)
    return ([int(masked_sum(work, mask | (1 << v))) for v, mask in enumerate(ancestors)],
            [int(masked_sum(work, mask | (1 << v))) for v, mask in enumerate(descendants)])


class _Cuts:
    """One CP-SAT model of an ideal (the ops before a cut) and its crossing tensors, re-weighted per cut."""

    def __init__(self, prob: Problem, work: list[int], senders: list[int]):
        self.m = m = cp_model.CpModel()
        self.x = x = [m.new_bool_var(f"x{v}") for v in range(prob.n)]
        for u in range(prob.n):
            for c in prob.succ[u]:
                m.add_implication(x[c], x[u])  # a consumer before the cut: its producer too
        self.cross = []
        for u in senders:
            lit = m.new_bool_var(f"cross{u}")
            for c in prob.succ[u]:
                m.add_bool_or([x[u].Not(), x[c], lit])  # u before the cut, a consumer after it
            self.cross.append(lit)
        self.weight = m.new_int_var(0, sum(work), "work")
        m.add(weighted([(w, x[v]) for v, w in enumerate(work)] + [(-1, self.weight)]) == 0)
        real = [x[v] for v in range(prob.n) if not prob.is_output[v]]
        self.held = m.new_int_var(0, len(real), "held")  # every stage holds an op other than the output node
        m.add(weighted([(1, lit) for lit in real] + [(-1, self.held)]) == 0)

    def least(self, prices: list[int], lo: int, hi: int, ops: tuple[int, int], budget: float, wall_left: float,
              seed: int) -> tuple[int, float]:
        """The least Σ price x crossing over ideals of work in [lo, hi] holding ``ops`` (min, max) real ops, or
        a bound from below on it (-1: no such ideal); and the deterministic seconds it took."""
        if lo > hi or ops[0] > ops[1]:
            return -1, 0.0
        proto = self.m.proto
        for var, (a, b) in ((self.weight, (lo, hi)), (self.held, ops)):
            dom = proto.variables[var.index].domain
            dom[0], dom[1] = a, b
        self.m.minimize(weighted(list(zip(prices, self.cross))))
        solver = proof_solver(budget=budget, wall_left=wall_left, workers=1, seed=seed)
        # OR-Tools 9.15's probing, with the dual reductions after it, certified 8.0 ms "optimal" on this model
        # where an ideal in the window crosses 3.6 (tests/test_crossings.py); without it the least is right
        solver.parameters.cp_model_probing_level = 0
        status = solver.Solve(self.m)
        det = float(solver.response_proto.deterministic_time)
        if status == cp_model.INFEASIBLE:
            return -1, det
        if status == cp_model.MODEL_INVALID:  # a bug in the model, not an answer
            raise RuntimeError(f"cut crossings: CP-SAT rejected the model (work in [{lo}, {hi}], ops {ops})")
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return 0, det
        return max(0, math.floor(solver.BestObjectiveBound())), det


class CutCrossings:
    """The cut-crossings test of one problem: its windows, each tensor's ends at each cut, and the least crossings."""

    def __init__(self, prob: Problem):
        self.prob = prob
        p = prob.p
        self.speed = prob.speed.astype(float)
        self.before = [0.0, *np.cumsum(self.speed).tolist()]  # before[s]: the speeds of stages 0 .. s-1
        self.total = float(prob.least_work.sum())
        work = np.array([math.floor(float(w) * NS_PER_SECOND) for w in prob.least_work], dtype=np.int64)
        alpha, delta = closure_work(prob, work)
        self.senders = [u for u in range(prob.n) if prob.out_bytes[u] > 0 and prob.succ[u]]
        self.alpha = alpha
        self.least_delta = [min(delta[c] for c in prob.succ[u]) for u in self.senders]
        self.real = int(sum(not out for out in prob.is_output))
        # One end's least price across each cut (at least the least over its links, a < s <= t)
        self.prices = [[least_end_price(prob, u, slice(0, s), slice(s, p)) for u in self.senders] for s in range(1, p)]
        self.model = _Cuts(prob, work.tolist(), self.senders) if self.senders else None

    def window(self, s: int, cap: float) -> tuple[int, int]:
        """The integer work of the ops before cut s in any plan under ``cap``: at least W - cap x the speeds after
        it, at most cap x the speeds before (a unit per op below: the integers are rounded down)."""
        return self.narrowed(cap, [0] * (self.prob.p - 1))[s - 1]

    def ends(self, s: int, cap: float) -> list[int]:
        """Per sender (``senders``), what a plan under ``cap`` pays at least at cut s if it crosses it: one end's
        price for the receive by stage s unless the tensor may skip that stage, and one for the send by stage
        s - 1 unless it may have been made earlier."""
        return [r + q for r, q in zip(*self.ends_by_side(s, cap))]

    def ends_by_side(self, s: int, cap: float) -> tuple[list[int], list[int]]:
        """:meth:`ends` apart: per sender, the receive by stage s (0 where the tensor may skip it) and the send
        by stage s - 1 (0 where it may have been made earlier)."""
        before, p = self.before, self.prob.p
        # Descendants' work a skipped stage s leaves after it, ancestors' work a tensor made before stage s-1 fits
        # in; the last stage cannot be skipped, nothing is made before the first
        skips = cap * (before[p] - before[s + 1]) * NS_PER_SECOND * (1 + _FLOAT) + 1 if s < p - 1 else -math.inf
        earlier = cap * before[s - 1] * NS_PER_SECOND * (1 + _FLOAT) + 1 if s > 1 else -math.inf
        prices = self.prices[s - 1]
        return ([price * int(delta > skips) for price, delta in zip(prices, self.least_delta)],
                [price * int(self.alpha[u] > earlier) for price, u in zip(prices, self.senders)])

    def proves(self, cap: float, budget: float, wall_left: float, seed: int = 0) -> tuple[bool, float]:
        """Whether no plan has a bottleneck of ``cap`` or less (the work and the least ends over the cuts exceed
        what the stages hold, or some cut's window, narrowed by the others' ends, holds no ideal), and the
        deterministic seconds it took (at most ``budget``, plus the last solve's overrun below a step)."""
        p, t0 = self.prob.p, time.perf_counter()
        if self.model is None:
            return False, 0.0
        windows = [self.window(s, cap) for s in range(1, p)]
        leasts = [0] * (p - 1)  # per cut 1 .. p-1, the least ends found so far (0: not yet weighed)
        todo = list(range(1, p))
        spent = 0.0
        for rounds in range(NARROWING_ROUNDS + 1):
            for s in todo:
                wall = wall_left - (time.perf_counter() - t0)
                if wall <= 0:  # the caller sees the wall clock struck
                    return False, spent
                lo, hi = windows[s - 1]
                least, det = self.model.least(self.ends(s, cap), lo, hi, (s, self.real - (p - s)),
                                              min(budget - spent, CUT_BUDGET), wall, seed)
                spent += det
                if least < 0:  # no ideal fits the window: no plan under the cap has a cut s
                    return True, spent
                leasts[s - 1] = max(leasts[s - 1], least)  # a narrower window's least is no lower
                if self.exceeds(cap, leasts):
                    return True, spent
                if spent >= budget:
                    return False, spent
            if rounds == NARROWING_ROUNDS:
                break
            narrowed = self.narrowed(cap, leasts)
            todo = [s for s in range(1, p) if narrowed[s - 1] != windows[s - 1]]
            windows = narrowed  # an empty one is weighed next: no ideal fits it, the cap is proven
            if not todo:
                break
        return False, spent

    def narrowed(self, cap: float, ends: list[int]) -> list[tuple[int, int]]:
        """Each cut's window under ``cap`` narrowed by ``ends`` (integers, what a plan pays at least at each cut
        1 .. p-1): the stages before cut s pay every end counted at the cuts before it, and the stages after it
        every end counted at the cuts after it, so the ideal before cut s weighs at most cap x the speeds before
        less the first, and at least W - cap x the speeds after plus the second."""
        slowest, speeds, p = float(self.speed.min()), self.before, self.prob.p
        paid = np.concatenate([[0], np.cumsum(ends)]).tolist()  # paid[k]: the ends of cuts 1 .. k
        out = []
        for s in range(1, p):
            fewest = (self.total - cap * (speeds[p] - speeds[s])) * NS_PER_SECOND  # work before the cut, widened below
            lo = math.floor(fewest - abs(fewest) * _FLOAT) - self.prob.n - 1  # (whatever its sign)
            hi = math.ceil(cap * speeds[s] * NS_PER_SECOND * (1 + _FLOAT)) + 1
            out.append((max(0, lo + math.floor(slowest * (paid[-1] - paid[s]))),
                        max(0, hi - math.floor(slowest * paid[s - 1]))))
        return out

    def exceeds(self, cap: float, ends: list[int]) -> bool:
        """Whether the work and these ends (integers, at some of the cuts) exceed what the stages hold under
        ``cap``: Σ speed_t T_t >= W + min speed x the ends, and each T_t <= cap."""
        held = self.total * NS_PER_SECOND + float(self.speed.min()) * sum(ends)
        return held > cap * self.before[self.prob.p] * NS_PER_SECOND * (1 + _FLOAT)


def crossing_lower_bound(prob: Problem, *, lower: float, upper: float, budget: float, wall_limit: float,
                         rtol: float = RTOL, seed: int = 0) -> CrossingBound:
    """Raise ``lower`` (a proven bound) towards ``upper`` (a plan's bottleneck) by bisection on caps the
    crossing sums prove (see the module docstring), within ``budget`` deterministic seconds."""
    t0 = time.perf_counter()
    res = CrossingBound(lower)
    p = prob.p
    if p < 2 or not 0 < lower < upper or not math.isfinite(upper):
        return res
    total = float(prob.least_work.sum())
    # Caps whose windows span more than a stage's share of the work leave every tensor free to skip a stage
    # (the 1,000-op layered DAG at 64 stages: nothing proven even just above its bound)
    hi = min(upper, total * (1 + 1 / p) / float(prob.speed.sum()))
    if hi - lower <= rtol * upper or budget <= 0:
        return res
    test = CutCrossings(prob)
    lo = lower
    # The lowest cap worth proving first: where it is not proven, no higher cap is (the windows only widen,
    # and fewer ends count, as the cap rises)
    cap = lo + rtol * upper
    left = budget
    while hi - lo > rtol * upper and left > 0 and cap < hi:
        wall_left = wall_limit - (time.perf_counter() - t0)
        if wall_left <= 0:
            res.wall_stopped = True
            break
        proven, det = test.proves(cap, left, wall_left, seed)
        if time.perf_counter() - t0 > wall_limit:  # a solve cut short: this cap may differ on another machine
            res.wall_stopped = True
            break
        left -= det
        res.deterministic_seconds += det
        res.tries.append((cap, proven))
        if proven:
            lo = cap
        elif len(res.tries) == 1:
            break
        elif left > 0:  # (budget spent: unproven, not disproven)
            hi = cap
        cap = (lo + hi) / 2
    res.lower_bound = lo
    return res
