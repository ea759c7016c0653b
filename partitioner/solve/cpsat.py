"""CP-SAT over every valid assignment of the DAG (not one order), with a proven bound.

The model follows Tarnawski et al., "Efficient Algorithms for Device Placement of DNN
Graph Operators" (NeurIPS 2020): a 0/1 variable per (op, stage), stage(u) <= stage(v)
on every edge (which makes every stage convex), and per-stage time and memory as linear
sums. Communication is exact under our cost model: ``r[u,t]`` says stage t receives u's
output (some consumer of u is on t and u is not), and ``y[u,a,t] = x[u,a] ∧ r[u,t]``
prices the transfer on the link from a to t for both endpoints.

Costs are scaled to integers by rounding *down*, so every integer stage time is at most
the float time times the scale, and the solver's proven bound divided by the scale is
a valid lower bound on the float optimum. The returned plan is re-costed in floats by
the one cost model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from partitioner.cost import Problem
from partitioner.errors import ColocationError

__all__ = ["CPResult", "cpsat_solve", "cpsat_size"]

#: Integer units the bottleneck is scaled to; rounding error per term is < 1 unit.
_SCALE_TARGET = 1e9


@dataclass
class CPResult:
    assign: list[int] | None
    value: float
    lower_bound: float
    optimal: bool
    infeasible: bool
    status: str
    seconds: float


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


def cpsat_solve(prob: Problem, colocate: Iterable[Iterable[Hashable]] = (), *,
                hint: Sequence[int] | None = None, time_limit: float = 10.0, workers: int = 1,
                seed: int = 0) -> CPResult:
    """Minimise the bottleneck over all valid assignments; deterministic with ``workers=1``."""
    t0 = time.perf_counter()
    n, p, k = prob.n, prob.p, prob.directions
    from partitioner.solve.bounds import trivial_lower_bound

    ref = max(prob.bottleneck(hint) if hint is not None else 0.0, trivial_lower_bound(prob), 1e-300)
    scale = _SCALE_TARGET / ref

    def units(seconds: float) -> int:
        return int(math.floor(seconds * scale))

    m = cp_model.CpModel()
    x = [[m.NewBoolVar(f"x{v}_{s}") for s in range(p)] for v in range(n)]
    for v in range(n):
        m.AddExactlyOne(x[v])
    # Order encoding: z[v][s] = [stage(v) >= s]; an edge u -> v is z[u][s] <= z[v][s] for
    # every s, which propagates far better than comparing two weighted sums.
    z = [[None] + [m.NewBoolVar(f"z{v}_{s}") for s in range(1, p)] for v in range(n)]
    for v in range(n):
        for s in range(1, p):
            m.Add(z[v][s] == sum(x[v][t] for t in range(s, p)))
    for u in range(n):
        for v in prob.succ[u]:
            for s in range(1, p):
                m.AddImplication(z[u][s], z[v][s])
    for s in range(p):  # every stage holds a real op (the model's output node is none)
        m.Add(sum(x[v][s] for v in range(n) if not prob.is_output[v]) >= 1)
    for group in colocate:
        members = list(group)
        unknown = [g for g in members if g not in prob.pos]
        if unknown:
            raise ColocationError(f"colocation group names ops not in the graph: {unknown[:5]}")
        first = prob.pos[members[0]]
        for g in members[1:]:
            for s in range(p):
                m.Add(x[prob.pos[g]][s] == x[first][s])

    load: list[list] = [[] for _ in range(p)]  # (coefficient, literal) terms per stage
    for v in range(n):
        for s in range(p):
            c = units(prob.work[v] / prob.speed[s])
            if c:
                load[s].append((c, x[v][s]))
    r: dict[tuple[int, int], cp_model.IntVar] = {}
    y: dict[tuple[int, int, int], cp_model.IntVar] = {}
    for u in _comm_nodes(prob):
        b = float(prob.out_bytes[u])
        for t in range(1, p):
            prices = {a: units(k * prob.transfer_seconds(a, t, b)) for a in range(t)}
            if not any(prices.values()):
                continue
            rt = m.NewBoolVar(f"r{u}_{t}")
            r[u, t] = rt
            for v in prob.succ[u]:
                m.Add(rt >= x[v][t] - x[u][t])
            for a, c in prices.items():
                if not c:
                    continue
                ya = m.NewBoolVar(f"y{u}_{a}_{t}")
                y[u, a, t] = ya
                m.Add(ya >= x[u][a] + rt - 1)
                load[a].append((c, ya))
                load[t].append((c, ya))

    total_max = max((sum(c for c, _ in terms) for terms in load), default=0)
    upper = total_max
    if hint is not None:
        upper = min(upper, units(prob.bottleneck(hint)) + 1)
    bneck = m.NewIntVar(0, max(upper, 0), "bottleneck")
    for s in range(p):
        if load[s]:
            m.Add(sum(c * lit for c, lit in load[s]) <= bneck)
        # Memory: rounded up per op so a plan accepted here fits in floats too.
        lim = prob.mem_limit[s]
        if lim is not None:
            coef = [math.ceil(prob.node_memory(v, s)) for v in range(n)]
            m.Add(sum(coef[v] * x[v][s] for v in range(n) if coef[v]) <= int(math.floor(lim)))
    m.Minimize(bneck)

    if hint is not None:
        for v in range(n):
            for s in range(p):
                m.AddHint(x[v][s], int(hint[v] == s))
        dst = {(u, t): any(hint[w] == t for w in prob.succ[u]) and hint[u] != t for (u, t) in r}
        for (u, t), var in r.items():
            m.AddHint(var, int(dst[u, t]))
        for (u, a, t), var in y.items():
            m.AddHint(var, int(dst[u, t] and hint[u] == a))
        hint_load = [sum(c for c, lit in load[s] if _hint_value(lit, x, y, hint, dst)) for s in range(p)]
        m.AddHint(bneck, max(hint_load))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    solver.parameters.max_time_in_seconds = max(0.05, time_limit - (time.perf_counter() - t0))
    solver.parameters.max_deterministic_time = max(0.05, time_limit)
    status = solver.Solve(m)
    name = solver.StatusName(status)
    elapsed = time.perf_counter() - t0
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        assign = [next(s for s in range(p) if solver.BooleanValue(x[v][s])) for v in range(n)]
        bound = solver.BestObjectiveBound() / scale
        return CPResult(assign, prob.bottleneck(assign), bound, status == cp_model.OPTIMAL, False,
                        name, elapsed)
    return CPResult(None, math.inf, 0.0, False, status == cp_model.INFEASIBLE, name, elapsed)


def _hint_value(lit, x, y, hint, dst) -> bool:
    """Value the hint gives a load term's literal (an x or a y variable)."""
    name = lit.Name()
    if name.startswith("x"):
        v, s = map(int, name[1:].split("_"))
        return hint[v] == s
    u, a, t = map(int, name[1:].split("_"))
    return bool(dst[u, t] and hint[u] == a)
