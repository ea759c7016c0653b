"""CP-SAT's model of the whole problem, and the pieces every CP-SAT model of the solver is built from.

The model follows Tarnawski et al., "Efficient Algorithms for Device Placement of DNN
Graph Operators" (NeurIPS 2020): a 0/1 variable per (op, stage), stage(u) <= stage(v)
on every edge (which makes every stage convex), and per-stage time and memory as linear
sums. Communication is exact under our cost model: ``r[u,t]`` says stage t receives u's
output (some consumer of u is on t and u is not). The transfer's price on the link from
u's stage a to t is paid by both ends. Rather than a Boolean per (tensor, sender,
receiver) (their model's ``y[u,a,t] = x[u,a] ∧ r[u,t]``, p(p-1)/2 per tensor), the receiver's
price is written as a step function of a: the price from stage t - 1, plus one term per stage
j at which the link price changes, ``[a < j]`` (or ``[a >= j]``) read off the order encoding
``z[u][j]`` and forced only where ``r[u,t]`` is; on a cluster of nodes that is at most one
Boolean per (tensor, receiver). The sender pays the sum of those prices: one integer per
(tensor, stage), at least the sum wherever u is on that stage. Fewer variables (33,267
against 72,369 on T5-small at 16 stages), and checks under a cap decided faster (1.7-7x on
T5-small; caps the per-link model left undecided after 150 deterministic seconds decided in
6-24: docs/optimizer.md, "Bisection"); CP-SAT's optimisation proves the same, in about as many
deterministic seconds, but often more wall seconds per deterministic second.

Integers, in the direction that never cuts off a plan: times are scaled and rounded
*down*, so every integer stage time is at most the float time times the scale and the
solver's bound divided by the scale is a valid lower bound on the float optimum. Memory
is scaled *exactly* (by the power of two that makes every byte count an integer) when
that fits in 64 bits, else rounded down as well; either way every plan that fits in
floats fits the integer model, and a plan it returns is checked in floats by the one
cost model. The relaxations (:mod:`partitioner.solve.groups`, :mod:`partitioner.solve.crossings`) count
in integer nanoseconds (:data:`NS_PER_SECOND`, :func:`least_end_price`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
from ortools.sat.python import cp_model
from ortools.sat.python.cp_model import LinearExpr

from partitioner.problem import Problem

__all__ = ["PlacementModel", "BUILD_LOCK", "NS_PER_SECOND", "cpsat_size", "least_end_price", "proof_solver",
           "weighted"]

#: Integer units per op the reference bottleneck is scaled to (at least 1e9 in all): a plan's
#: rounding, under one unit per term, stays below 1e-6 of it (``OPTIMAL_RTOL``). Much larger
#: coefficients make CP-SAT's LP numerically fragile (seen: searches that stall for minutes).
_UNITS_PER_OP = 1e6
#: Largest magnitude a stage's integer sum may reach: exact in the LP's doubles.
_INT_MAX = 2.0**53
#: The relaxations' integer unit: seconds to integer nanoseconds.
NS_PER_SECOND = 1e9

#: Building a model is Python that holds the GIL throughout; solving runs without it. Threads
#: that solve at once (the shape search's finalists) build one at a time, so the first solve
#: starts after one build, not after all of them interleaved.
BUILD_LOCK = threading.Lock()


def _comm_nodes(prob: Problem) -> list[int]:
    """Ops whose output can cost anything to send (none when the links are free)."""
    free = bool(np.isinf(prob.bw).all() and not prob.lat.any())
    if free:
        return []
    return [u for u in range(prob.n) if prob.out_bytes[u] > 0 and prob.succ[u]]


def cpsat_size(prob: Problem) -> int:
    """Rough count of model variables; the dispatcher skips CP-SAT when this is too large."""
    p = prob.p
    # Per sending tensor: r and the sender's sum per stage, and a Boolean per step of each receiver's link prices
    bw, lat = prob.bw, prob.lat
    steps = sum(int(np.count_nonzero((bw[1:t, t] != bw[:t - 1, t]) | (lat[1:t, t] != lat[:t - 1, t])))
                for t in range(2, p))
    return prob.n * p + len(_comm_nodes(prob)) * (2 * (p - 1) + steps)


def _dyadic_exponent(values: np.ndarray) -> int:
    """Smallest k such that every value times 2**k is an integer (floats are dyadic rationals)."""
    nz = values[(values != 0) & np.isfinite(values)]
    if not nz.size:
        return 0
    mant, exp = np.frexp(nz)
    ints = np.abs(mant * 2.0**53).astype(np.int64)
    trailing = np.log2((ints & -ints).astype(float)).astype(int)
    return max(0, int((53 - exp - trailing).max()))


def weighted(terms: Sequence[tuple[int, cp_model.IntVar]]) -> cp_model.LinearExpr:
    """Σ coef x lit over the nonzero terms, built in one call (a Python sum of expressions nests one
    node per term: seconds on a model of 10^5 variables)."""
    kept = [(coef, lit) for coef, lit in terms if coef]
    return LinearExpr.weighted_sum([lit for _, lit in kept], [coef for coef, _ in kept])


def least_end_price(prob: Problem, u: int, frm: slice, to: slice) -> int:
    """The least a transfer of u's output between those stages costs one end, in integer nanoseconds."""
    bw = float(prob.bw[frm, to].max())
    lat = float(prob.lat[frm, to].min())
    return math.floor(prob.directions * (float(prob.out_bytes[u]) / bw + lat) * NS_PER_SECOND)


def proof_solver(*, budget: float, wall_left: float, workers: int, seed: int) -> cp_model.CpSolver:
    """A CP-SAT solver whose answers are the same on any machine and whose bounds can be trusted."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = workers
    solver.parameters.interleave_search = workers > 1  # parallel yet reproducible
    solver.parameters.random_seed = seed
    # OR-Tools 9.15's inclusion presolve can certify a wrong optimum (google/or-tools#5293): on a
    # 7-op graph over a heterogeneous chain of links it proved 0.0392 s where 0.0385 s exists
    # (tests/test_solve.py). Off, the same model is solved right; the proof is our promise.
    solver.parameters.presolve_inclusion_work_limit = 0
    solver.parameters.max_deterministic_time = max(0.01, budget)
    solver.parameters.max_time_in_seconds = max(0.05, wall_left)
    return solver


#: A term of a linear sum: (integer coefficient, literal)
_Term = tuple[int, cp_model.IntVar]
#: A step of a receiver's link price: (stage j, whether it is forced by [a < j] or by [a >= j], Boolean)
_Step = tuple[int, bool, cp_model.IntVar]


class PlacementModel:
    """The CP-SAT model of one :class:`Problem`: variables, per-stage load terms, bottleneck."""

    def __init__(self, prob: Problem, groups: Sequence[Sequence[int]]):
        self.prob = prob
        self.m = cp_model.CpModel()
        self.notes: list[str] = []
        self._assignment()
        for group in groups:
            self._colocate(group)
        # (seconds, literal) per stage, turned into integers once the scale is known.
        self.load: list[list[tuple[float, cp_model.IntVar]]] = [[] for _ in range(prob.p)]
        self._compute()
        self.r: dict[tuple[int, int], cp_model.IntVar] = {}
        # Per (tensor, receiver): the prices from each earlier stage (seconds), r, and its steps' (j, less, w)
        self.transfers: list[tuple[int, int, list[float], cp_model.IntVar, list[_Step]]] = []
        self._communication()
        # Per stage with several recomputation choices: a Boolean per choice, and the
        # (seconds, literal) terms each choice recomputes, priced once the scale is known.
        self.choice: list[dict[str, cp_model.IntVar]] = [{} for _ in range(prob.p)]
        self.rec_terms: list[dict[str, list[tuple[float, cp_model.IntVar]]]] = [{} for _ in range(prob.p)]
        self.rec_var: list[cp_model.IntVar | None] = [None] * prob.p
        self._recompute()
        self._memory()

    def _assignment(self) -> None:
        prob, m = self.prob, self.m
        n, p = prob.n, prob.p
        self.x = [[m.new_bool_var(f"x{v}_{s}") for s in range(p)] for v in range(n)]
        for v in range(n):
            m.add_exactly_one(self.x[v])
        # Order encoding: z[v][s] = [stage(v) >= s]; an edge u -> v is z[u][s] <= z[v][s] for
        # every s, which propagates far better than comparing two weighted sums.
        self.z = z = [[None] + [m.new_bool_var(f"z{v}_{s}") for s in range(1, p)] for v in range(n)]
        for v in range(n):
            for s in range(1, p):
                m.add(z[v][s] == LinearExpr.sum(self.x[v][s:]))
        for u in range(n):
            for v in prob.succ[u]:
                for s in range(1, p):
                    m.add_implication(z[u][s], z[v][s])
        for s in range(p):
            m.add(LinearExpr.sum([self.x[v][s] for v in range(n) if not prob.is_output[v]]) >= 1)  # a real op: the output is none

    def _colocate(self, group: Sequence[int]) -> None:
        first = group[0]
        for g in group[1:]:
            for s in range(self.prob.p):
                self.m.add(self.x[g][s] == self.x[first][s])

    def _compute(self) -> None:
        prob = self.prob
        for v in range(prob.n):
            for s in range(prob.p):
                c = float(prob.work[v] / prob.speed[s])
                if c > 0:
                    self.load[s].append((c, self.x[v][s]))

    def _received(self, u: int, t: int) -> cp_model.IntVar:
        """r[u,t]: stage t receives u's output (forced to 1 when a consumer of u is on t and u is not)."""
        if (u, t) not in self.r:
            rt = self.m.new_bool_var(f"r{u}_{t}")
            self.r[u, t] = rt
            for v in self.prob.succ[u]:
                self.m.add(rt >= self.x[v][t] - self.x[u][t])
        return self.r[u, t]

    def _sends(self, r: int, a: int) -> cp_model.IntVar:
        """snd[r,a]: stage a holds the storage of op r and sends it (r itself, or a view of it on a,
        has a consumer on a later stage): the stage keeps that storage for the backward."""
        if (r, a) not in self.snd:
            prob, m = self.prob, self.m
            var = m.new_bool_var(f"snd{r}_{a}")
            self.snd[r, a] = var
            for u in self.views[r]:
                for w in prob.succ[u]:
                    lits = [self.x[r][a], self.z[w][a + 1]] + ([self.x[u][a]] if u != r else [])
                    m.add_bool_or([lit.Not() for lit in lits] + [var])
        return self.snd[r, a]

    def _communication(self) -> None:
        """Each receiver's price as a step function of the sender's stage (priced in integers, and the
        sender's sum built, in :meth:`objective`, once the scale is known)."""
        prob, m, k = self.prob, self.m, self.prob.directions
        for u in _comm_nodes(prob):
            b = float(prob.out_bytes[u])
            for t in range(1, prob.p):
                # k x Problem.transfer_seconds(a, t, b) for every a < t, as one column (the same floats)
                col = (k * (b / prob.bw[:t, t] + prob.lat[:t, t])).tolist()
                if not any(c > 0 for c in col):
                    continue
                rt = self._received(u, t)
                steps = []
                for j in range(1, t):
                    if col[j - 1] != col[j]:
                        # price(a) = price(t-1) + Σ_{j > a} (price(j-1) - price(j)): a step up towards the
                        # sender is [a < j]; a step down is rewritten on [a >= j], so every step costs >= 0
                        less = col[j - 1] > col[j]
                        w = m.new_bool_var(f"w{u}_{t}_{j}")
                        # r ∧ (a < j) ⇒ w, i.e. r ∧ ¬z[u][j] ⇒ w; or r ∧ z[u][j] ⇒ w
                        m.add_bool_or([rt.Not(), self.z[u][j] if less else self.z[u][j].Not(), w])
                        steps.append((j, less, w))
                self.transfers.append((u, t, col, rt, steps))

    def _int_transfers(self) -> tuple[list[list[_Term]], dict[int, list[_Term]]]:
        """Per receiving stage and per sending tensor, the (units, literal) terms of the transfers' prices:
        each price from stage a rounded down once, P[a] = floor(price(a) x scale), and its steps integer
        differences of P, so the terms forced by a plan sum to exactly P[a] (no rounding per step)."""
        received: list[list[_Term]] = [[] for _ in range(self.prob.p)]
        sent: dict[int, list[_Term]] = {}
        for u, t, col, rt, steps in self.transfers:
            units = [math.floor(c * self.scale) for c in col]
            drops = {j: units[j - 1] - units[j] for j, _, _ in steps}
            base = units[t - 1] + sum(d for d in drops.values() if d < 0)  # < 0 only where a far link is cheaper
            terms = [(base, rt)] + [(abs(drops[j]), w) for j, _, w in steps]
            terms = [(c, lit) for c, lit in terms if c]
            received[t].extend(terms)
            sent.setdefault(u, []).extend(terms)
        return received, sent

    def _recompute(self) -> None:
        """Each stage's recomputation choice (AdaPipe's per-stage decision, made with the assignment):
        one Boolean per allowed choice; a forced choice's recomputed seconds go straight into the load."""
        prob = self.prob
        for s in range(prob.p):
            options = prob.choices[s]
            for c in options:
                terms = [(float(prob.rec.seconds[c][v] / prob.speed[s]), self.x[v][s]) for v in range(prob.n)
                         if prob.rec.seconds[c][v] > 0]
                if len(options) == 1:
                    self.load[s].extend(terms)
                else:
                    self.choice[s][c] = self.m.new_bool_var(f"c{s}_{c}")
                    self.rec_terms[s][c] = terms
            if len(options) > 1:
                self.m.add_exactly_one(self.choice[s].values())

    def _memory(self) -> None:
        """Per-stage memory within the limit under the stage's choice, in integers that keep every plan
        fitting in floats; the cut's part exactly as the cost model counts it: the tensors a stage
        receives (``r``) and the storages it keeps because it sends them (``snd``)."""
        prob = self.prob
        limited = [s for s in range(prob.p) if prob.mem_limit[s] is not None]
        if not limited:
            return
        senders = [u for u in range(prob.n) if prob.out_bytes[u] > 0 and prob.succ[u]]
        self.views: dict[int, list[int]] = {}
        for u in senders:
            self.views.setdefault(prob.root[u], []).append(u)
        self.snd: dict[tuple[int, int], cp_model.IntVar] = {}
        roots = sorted(self.views)
        # (stage, choice) -> (per op, per sender received, per root sent)
        rows: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for s in limited:
            for c in prob.choices[s]:
                per_op = np.array([prob.node_memory(v, s, c) for v in range(prob.n)])
                recv = prob.in_flight[s] * prob.out_bytes[senders] if prob.rec.received[c] and s > 0 else np.zeros(0)
                sent = prob.in_flight[s] * prob.rec.sent[c][roots] if s < prob.p - 1 else np.zeros(0)
                rows[s, c] = per_op, recv, sent
            # At the optimizer's step: the state and the step's workspace (no activations, no cut).
            rows[s, "step"] = prob.step_mem, np.zeros(0), np.zeros(0)
        limits = {s: prob.mem_limit[s] * (1 + 1e-12) for s in limited}  # the float check's tolerance
        limit_values = np.array(list(limits.values()))
        exact_k = _dyadic_exponent(np.concatenate([limit_values, *(a for row in rows.values() for a in row)]))
        largest = max(max(float(sum(a.sum() for a in row)) for row in rows.values()), float(limit_values.max()), 1.0)
        k = min(exact_k, int(math.floor(math.log2(_INT_MAX / largest))))
        if k < exact_k:
            self.notes.append(f"cpsat: memory in units of 2^{-k} bytes, rounded down (a relaxation; "
                              "the plan is checked in floats)")
        q = 2.0**k
        for (s, c), (per_op, recv, sent) in rows.items():
            terms = [(int(math.floor(per_op[v] * q)), self.x[v][s]) for v in range(prob.n)]
            terms += [(int(math.floor(b * q)), self._received(u, s)) for u, b in zip(senders, recv) if b > 0]
            terms += [(int(math.floor(b * q)), self._sends(r, s)) for r, b in zip(roots, sent) if b > 0]
            cap = math.floor(Fraction(limits[s]) * Fraction(2) ** k)
            ct = self.m.add(weighted(terms) <= cap)
            if c in self.choice[s]:
                ct.only_enforce_if(self.choice[s][c])

    def objective(self, ref: float, upper: float | None, lower_bound: float) -> None:
        """B >= every stage's integer load, minimised; ``upper``/``lower_bound`` (seconds) narrow B.

        Scale: ``ref`` (a plan's bottleneck) becomes 1e6 units per op (at least 1e9), unless
        a stage's largest possible load would then pass 2^53. Each term is rounded down, so a plan's integer load
        is its float load times the scale minus less than one unit per term: ``scale *
        lower_bound - terms`` is a valid floor for B, and ``scale * upper + 1`` a cap that keeps
        every plan at least as good as ``upper``.
        """
        def most(terms: dict[str, list[tuple[float, cp_model.IntVar]]]) -> float:
            return max((sum(c for c, _ in t) for t in terms.values()), default=0.0)

        # Transfers: at most every price on the stage's receiving side, and every tensor's on its sending side;
        # a transfer's terms weigh at most its nearest price plus twice the steps (|base| and the steps)
        weigh = [col[-1] + 2 * sum(abs(x - y) for x, y in zip(col, col[1:])) for _, _, col, _, _ in self.transfers]
        priced = [0.0] * self.prob.p
        for (_, t, _, _, _), w in zip(self.transfers, weigh):
            priced[t] += w
        sending = sum(weigh)
        widest = max((sum(c for c, _ in terms) + most(rec) + price
                      for terms, rec, price in zip(self.load, self.rec_terms, priced)), default=0.0) + sending
        target = _UNITS_PER_OP * max(1000, self.prob.n)
        self.scale = min(target / max(ref, 1e-300), _INT_MAX / max(widest, 1e-300))
        self.int_load = [[(int(math.floor(c * self.scale)), lit) for c, lit in terms] for terms in self.load]
        received, self.int_sent = self._int_transfers()
        for s, terms in enumerate(received):
            self.int_load[s].extend(terms)
        self._senders()
        self.int_rec = [{c: [(int(math.floor(sec * self.scale)), lit) for sec, lit in t] for c, t in rec.items()}
                        for rec in self.rec_terms]
        # A stage's recomputed seconds under its choice: R_s >= the chosen choice's terms.
        for s, rec in enumerate(self.int_rec):
            if not rec:
                continue
            cap = max(sum(c for c, _ in t) for t in rec.values())
            self.rec_var[s] = var = self.m.new_int_var(0, cap, f"rec{s}")
            for c, t in rec.items():
                if any(coef for coef, _ in t):
                    # var - terms >= 0 (not var >= terms: the same constraint, and the very proto as before)
                    self.m.add(weighted([(1, var), *((-coef, lit) for coef, lit in t)]) >= 0).only_enforce_if(
                        self.choice[s][c])
        tops = [sum(c for c, _ in terms) + (max(sum(c for c, _ in t) for t in rec.values()) if rec else 0)
                + sum(self.sa_top[u] for u, _ in sends)
                for terms, rec, sends in zip(self.int_load, self.int_rec, self.send_load)]
        top = max(tops, default=0)
        # Rounding: under a unit per term (a transfer's terms sum to its one rounded price: counted per term,
        # more than that), the transfers inside a stage's sending integers included
        rounded = sum(len(t) for t in self.int_sent.values())
        terms = max((len(t) + max((len(r) for r in rec.values()), default=0)
                     for t, rec in zip(self.int_load, self.int_rec)), default=0) + rounded
        lo = max(0, min(top, int(math.floor(lower_bound * self.scale)) - terms))
        hi = top if upper is None else max(lo, min(top, int(math.floor(upper * self.scale)) + 1))
        self.bneck = self.m.new_int_var(lo, hi, "bottleneck")
        for total in self.stage_loads():
            if total:
                self.m.add(weighted([*total, (-1, self.bneck)]) <= 0)
        self.m.minimize(self.bneck)

    def stage_loads(self) -> list[list[tuple[int, cp_model.IntVar]]]:
        """Per stage, the (coefficient, variable) terms of its integer load (after :meth:`objective`): its
        compute and receives, its recomputation, and what it sends."""
        loads = []
        for terms_s, rec_var, sends in zip(self.int_load, self.rec_var, self.send_load):
            total = [(c, lit) for c, lit in terms_s if c] + ([(1, rec_var)] if rec_var is not None else [])
            loads.append(total + [(1, var) for _, var in sends])
        return loads

    def cut_sums(self) -> None:
        """Redundant constraints on B (after :meth:`objective`): the first s stages together, and the last
        p - s, each within that many bottlenecks, for every cut s.

        An op placed before cut s (``z[v][s]`` false) but on no stage yet weighs on no stage's sum, so
        CP-SAT's propagation sees it only once its stage is fixed; the sums over the stages before and after
        each cut weigh it at once: the work of the ops on that side (on the fastest stage there), and a
        transfer for each tensor that crosses the cut (``cross[u][s]``: made before it, read after), priced
        at the least any link across it costs one end, in the very integers the stages are charged (the
        sender's side pays every copy it sends, the receivers' side every copy received: one is counted).
        Every term is at most what those stages pay, so no plan the model holds is cut off. With equal
        speeds this is the stage-groups relaxation (:mod:`partitioner.solve.groups`) with two groups at each
        cut, inside the exact model (the groups weigh work on a group's summed speed, these sums on its
        fastest stage).
        """
        prob, m, z = self.prob, self.m, self.z
        p, n = prob.p, prob.n
        # One end's price of a copy from stage a to t per tensor, rounded down once as _int_transfers rounds
        # it (0 where no transfer is priced; only a < s <= t is read below).
        units: dict[int, np.ndarray] = {}
        for u, t, col, _, _ in self.transfers:
            units.setdefault(u, np.zeros((p, p)))[:t, t] = [math.floor(c * self.scale) for c in col]
        for s in range(1, p):
            crossings = []
            for u, price_of in units.items():
                price = int(price_of[:s, s:].min())
                if price <= 0:
                    continue
                cross = m.new_bool_var(f"cross{u}_{s}")
                for w in prob.succ[u]:
                    m.add_bool_or([z[w][s].Not(), z[u][s], cross])  # w after the cut and u before it
                crossings.append((price, cross))
            for side, width in ((slice(0, s), s), (slice(s, p), p - s)):
                fastest = float(prob.speed[side].max())
                work = [(math.floor(float(prob.work[v]) / fastest * self.scale), z[v][s]) for v in range(n)]
                work = [(coef, lit) for coef, lit in work if coef]
                if side.start == 0:  # Σ work (1 - z) + crossings <= s B
                    m.add(weighted([*crossings, *((-coef, lit) for coef, lit in work), (-width, self.bneck)])
                          <= -sum(coef for coef, _ in work))
                else:  # Σ work z + crossings <= (p - s) B
                    m.add(weighted([*crossings, *work, (-width, self.bneck)]) <= 0)

    def _senders(self) -> None:
        """sa[u,a] >= the scaled sum of u's transfer prices wherever u is on stage a: what u's stage pays."""
        self.send_load: list[list[tuple[int, cp_model.IntVar]]] = [[] for _ in range(self.prob.p)]
        self.sa_top: dict[int, int] = {}
        for u, ints in self.int_sent.items():
            top = sum(c for c, _ in ints if c > 0)
            if top <= 0:
                continue
            self.sa_top[u] = top
            for a in range(self.prob.p - 1):  # the last stage sends nothing
                var = self.m.new_int_var(0, top, f"sa{u}_{a}")
                self.m.add(weighted([(1, var), *((-c, lit) for c, lit in ints)]) >= 0).only_enforce_if(self.x[u][a])
                self.send_load[a].append((u, var))

    def assignment(self, solver: cp_model.CpSolver) -> list[int]:
        """The stage of each op in the solution ``solver`` found for this model."""
        return [next(s for s in range(self.prob.p) if solver.BooleanValue(self.x[v][s])) for v in range(self.prob.n)]

    def hint(self, assign: Sequence[int]) -> None:
        """A full warm start: every x, r, step, sender's sum, recomputation choice and B from ``assign`` (not
        :meth:`cut_sums`'s crossings)."""
        prob = self.prob
        # (variable, value) pairs appended to the proto in bulk: add_hint is a Python call per variable
        hinted: list[tuple[cp_model.IntVar, int]] = []
        for v in range(prob.n):
            hinted += [(self.x[v][s], int(assign[v] == s)) for s in range(prob.p)]
        dst = {(u, t): any(assign[w] == t for w in prob.succ[u]) and assign[u] != t for (u, t) in self.r}
        hinted += [(var, int(dst[key])) for key, var in self.r.items()]
        steps = [(w, int(dst[u, t] and (assign[u] < j) == less))
                 for u, t, _, _, sts in self.transfers for j, less, w in sts]
        hinted += steps
        on = {id(self.x[v][assign[v]]) for v in range(prob.n)}
        on |= {id(var) for key, var in self.r.items() if dst[key]}
        on |= {id(var) for var, value in steps if value}
        loads = [sum(c for c, lit in terms if id(lit) in on) for terms in self.int_load]
        for a, sends in enumerate(self.send_load):
            for u, var in sends:
                value = sum(c for c, lit in self.int_sent[u] if id(lit) in on) if assign[u] == a else 0
                hinted.append((var, max(0, value)))
                loads[a] += max(0, value)
        for s, term in enumerate(prob.stage_report(assign)):
            hinted += [(var, int(c == term.choice)) for c, var in self.choice[s].items()]
            if self.rec_var[s] is not None:
                rec = sum(coef for coef, lit in self.int_rec[s].get(term.choice, []) if id(lit) in on)
                hinted.append((self.rec_var[s], rec))
                loads[s] += rec
        hinted.append((self.bneck, max(loads)))
        hint = self.m.proto.solution_hint  # every variable here is a new one: a positive index
        hint.vars.extend([var.index for var, _ in hinted])
        hint.values.extend([value for _, value in hinted])

