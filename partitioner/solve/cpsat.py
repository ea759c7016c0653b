"""CP-SAT over every valid assignment of the DAG (not one order), with a proven bound.

The model follows Tarnawski et al., "Efficient Algorithms for Device Placement of DNN
Graph Operators" (NeurIPS 2020): a 0/1 variable per (op, stage), stage(u) <= stage(v)
on every edge (which makes every stage convex), and per-stage time and memory as linear
sums. Communication is exact under our cost model: ``r[u,t]`` says stage t receives u's
output (some consumer of u is on t and u is not), and ``y[u,a,t] = x[u,a] ∧ r[u,t]``
prices the transfer on the link from a to t for both endpoints.

Integers, in the direction that never cuts off a plan: times are scaled and rounded
*down*, so every integer stage time is at most the float time times the scale and the
solver's bound divided by the scale is a valid lower bound on the float optimum. Memory
is scaled *exactly* (by the power of two that makes every byte count an integer) when
that fits in 64 bits, else rounded down as well; either way every plan that fits in
floats fits the integer model, and the returned plan is checked in floats by the one
cost model. The search stops at a deterministic-time budget (the same plan and bound on
any machine); the wall clock is only a safety limit, and reported when it struck.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
from ortools.sat.python import cp_model
from ortools.sat.python.cp_model import LinearExpr

from partitioner.cost import Problem

__all__ = ["CPResult", "cpsat_solve", "cpsat_size"]

#: Integer units per op the reference bottleneck is scaled to (at least 1e9 in all): a plan's
#: rounding, under one unit per term, stays below 1e-6 of it (``OPTIMAL_RTOL``). Much larger
#: coefficients make CP-SAT's LP numerically fragile (seen: searches that stall for minutes).
_UNITS_PER_OP = 1e6
#: Largest magnitude a stage's integer sum may reach: exact in the LP's doubles.
_INT_MAX = 2.0**53


@dataclass
class CPResult:
    assign: list[int] | None
    value: float
    lower_bound: float
    infeasible: bool
    status: str
    seconds: float
    deterministic_seconds: float
    wall_stopped: bool
    notes: list[str] = field(default_factory=list)


def _comm_nodes(prob: Problem) -> list[int]:
    """Ops whose output can cost anything to send (none when the links are free)."""
    free = bool(np.isinf(prob.bw).all() and not prob.lat.any())
    if free:
        return []
    return [u for u in range(prob.n) if prob.out_bytes[u] > 0 and prob.succ[u]]


def cpsat_size(prob: Problem) -> int:
    """Rough count of model variables; the dispatcher skips CP-SAT when this is too large."""
    p = prob.p
    return prob.n * p + len(_comm_nodes(prob)) * (p * (p - 1) // 2 + p)


def _dyadic_exponent(values: np.ndarray) -> int:
    """Smallest k such that every value times 2**k is an integer (floats are dyadic rationals)."""
    nz = values[(values != 0) & np.isfinite(values)]
    if not nz.size:
        return 0
    mant, exp = np.frexp(nz)
    ints = np.abs(mant * 2.0**53).astype(np.int64)
    trailing = np.log2((ints & -ints).astype(float)).astype(int)
    return max(0, int((53 - exp - trailing).max()))


def _weighted(terms: Sequence[tuple[int, cp_model.IntVar]]) -> cp_model.LinearExpr:
    """Σ coef x lit over the nonzero terms, built in one call (a Python sum of expressions nests one
    node per term: seconds on a model of 10^5 variables)."""
    kept = [(coef, lit) for coef, lit in terms if coef]
    return LinearExpr.weighted_sum([lit for _, lit in kept], [coef for coef, _ in kept])


class _Model:
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
        self.y: dict[tuple[int, int, int], cp_model.IntVar] = {}
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
        prob, m, k = self.prob, self.m, self.prob.directions
        for u in _comm_nodes(prob):
            b = float(prob.out_bytes[u])
            for t in range(1, prob.p):
                # k x Problem.transfer_seconds(a, t, b) for every a < t, as one column (the same floats)
                prices = (k * (b / prob.bw[:t, t] + prob.lat[:t, t])).tolist()
                if not any(c > 0 for c in prices):
                    continue
                rt = self._received(u, t)
                for a, c in enumerate(prices):
                    if c <= 0:
                        continue
                    ya = m.new_bool_var(f"y{u}_{a}_{t}")
                    self.y[u, a, t] = ya
                    m.add(ya >= self.x[u][a] + rt - 1)
                    self.load[a].append((c, ya))
                    self.load[t].append((c, ya))

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
            ct = self.m.add(_weighted(terms) <= cap)
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

        widest = max((sum(c for c, _ in terms) + most(rec) for terms, rec in zip(self.load, self.rec_terms)),
                     default=0.0)
        target = _UNITS_PER_OP * max(1000, self.prob.n)
        self.scale = min(target / max(ref, 1e-300), _INT_MAX / max(widest, 1e-300))
        self.int_load = [[(int(math.floor(c * self.scale)), lit) for c, lit in terms] for terms in self.load]
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
                    self.m.add(_weighted([(1, var), *((-coef, lit) for coef, lit in t)]) >= 0).only_enforce_if(
                        self.choice[s][c])
        tops = [sum(c for c, _ in terms) + (max(sum(c for c, _ in t) for t in rec.values()) if rec else 0)
                for terms, rec in zip(self.int_load, self.int_rec)]
        top = max(tops, default=0)
        terms = max((len(t) + max((len(r) for r in rec.values()), default=0)
                     for t, rec in zip(self.int_load, self.int_rec)), default=0)
        lo = max(0, min(top, int(math.floor(lower_bound * self.scale)) - terms))
        hi = top if upper is None else max(lo, min(top, int(math.floor(upper * self.scale)) + 1))
        self.bneck = self.m.new_int_var(lo, hi, "bottleneck")
        for terms_s, rec_var in zip(self.int_load, self.rec_var):
            total = [(c, lit) for c, lit in terms_s if c] + ([(1, rec_var)] if rec_var is not None else [])
            if total:
                self.m.add(_weighted([*total, (-1, self.bneck)]) <= 0)
        self.m.minimize(self.bneck)

    def assignment(self, solver: cp_model.CpSolver) -> list[int]:
        """The stage of each op in the solution ``solver`` found for this model."""
        return [next(s for s in range(self.prob.p) if solver.BooleanValue(self.x[v][s])) for v in range(self.prob.n)]

    def hint(self, assign: Sequence[int]) -> None:
        """A full warm start: every x, r, y, recomputation choice and B from ``assign``."""
        prob = self.prob
        # (variable, value) pairs appended to the proto in bulk: add_hint is a Python call per variable
        hinted: list[tuple[cp_model.IntVar, int]] = []
        for v in range(prob.n):
            hinted += [(self.x[v][s], int(assign[v] == s)) for s in range(prob.p)]
        dst = {(u, t): any(assign[w] == t for w in prob.succ[u]) and assign[u] != t for (u, t) in self.r}
        hinted += [(var, int(dst[key])) for key, var in self.r.items()]
        hinted += [(var, int(dst[u, t] and assign[u] == a)) for (u, a, t), var in self.y.items()]
        on = {id(self.x[v][assign[v]]) for v in range(prob.n)}
        on |= {id(var) for (u, a, t), var in self.y.items() if dst[u, t] and assign[u] == a}
        loads = [sum(c for c, lit in terms if id(lit) in on) for terms in self.int_load]
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


#: Building a model is Python that holds the GIL throughout; solving runs without it. Threads
#: that solve at once (the shape search's finalists) build one at a time, so the first solve
#: starts after one build, not after all of them interleaved.
_BUILDING = threading.Lock()


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


def cpsat_solve(prob: Problem, groups: Sequence[Sequence[int]] = (), *, hint: Sequence[int] | None = None,
                lower_bound: float = 0.0, budget: float = 10.0, wall_limit: float = 60.0, workers: int = 1,
                seed: int = 0) -> CPResult:
    """Minimise the bottleneck over all valid assignments with ``groups`` (positions) colocated.

    ``budget``: CP-SAT deterministic time (its work measure, roughly seconds on a quiet
    core); ``wall_limit``: seconds, a safety net. Deterministic for any ``workers``.
    """
    t0 = time.perf_counter()
    upper = prob.bottleneck(hint) if hint is not None else None
    with _BUILDING:
        model = _Model(prob, groups)
        model.objective(max(upper or 0.0, lower_bound), upper, lower_bound)
        if hint is not None:
            model.hint(hint)
    solver = proof_solver(budget=budget, wall_left=wall_limit - (time.perf_counter() - t0), workers=workers,
                          seed=seed)
    status = solver.Solve(model.m)
    return _result(prob, model, solver, status, time.perf_counter() - t0, budget)


def _result(prob: Problem, model: _Model, solver: cp_model.CpSolver, status, seconds: float,
            budget: float) -> CPResult:
    det = float(solver.response_proto.deterministic_time)
    done = status in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
    wall = not done and det < budget * 0.99
    res = CPResult(None, math.inf, 0.0, status == cp_model.INFEASIBLE, solver.StatusName(status), seconds,
                   det, wall, list(model.notes))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return res
    res.lower_bound = solver.BestObjectiveBound() / model.scale
    assign = model.assignment(solver)
    times, mem = prob.stage_costs(assign)
    if prob.fits(mem):
        res.assign, res.value = assign, max(times)
    else:  # only possible where memory was rounded (a relaxation): the bound stands, the plan does not
        res.notes.append("cpsat: its plan exceeds a memory limit by less than the integer rounding; "
                         "kept the other plan")
    return res
