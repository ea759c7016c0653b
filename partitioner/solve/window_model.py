"""CP-SAT over one window's ops alone: the window search's model where the whole problem's is too large to build.

:mod:`partitioner.solve.windows` searches a window of ``k`` consecutive stages on CP-SAT's model of the whole
problem with every op outside the window fixed; past ``AUTO_CPSAT_MAX_VARS`` (the 1,000-op layered DAG at 64
stages: about 220,000 variables) that model is not built, and each window would presolve it all again. This
model holds only what a re-placement inside the window can change: a 0/1 variable per (window op, window
stage), stage(u) <= stage(v) on the window's edges (the order encoding of :mod:`partitioner.solve.cpsat`), the
window's colocation groups, and the transfers whose price moves with the window's ops:

- a tensor made in the window and read on a later window stage: received once per reading stage (``r``), its
  price from the sender's stage written as one Boolean per (sending stage, receiving stage) (``y >= x ∧ r``;
  a window has few stages, so the step encoding of the whole model is not needed);
- a tensor made in the window and read after it: the reader's stage is fixed, the price a linear sum of the
  sender's stage Booleans, paid by the sender and by the reading stage outside the window;
- a tensor made before the window and read in it: received once per reading window stage, paid by the
  receiver and by the sending stage outside the window.

Every other part of a stage's time is a constant: the time of the stages outside the window under the plan,
less the transfers above; recomputation is the plan's choice on each window stage. Memory is each op's own
share under that choice (the cut's tensors and the optimizer step's memory left out). The model is therefore a
heuristic neighbourhood, not a relaxation used for bounds: the window search prices every re-placement again in
floats by the one cost model (validity, memory, colocation, the lexicographic rule) before taking it, so nothing
it proposes is trusted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ortools.sat.python import cp_model
from ortools.sat.python.cp_model import LinearExpr

from partitioner.problem import Problem
from partitioner.solve.cpsat_model import weighted

__all__ = ["WindowModel"]

#: Integer units of the plan's bottleneck: a term's rounding (down, under one unit) stays below 1e-9 of it.
_UNITS = 1e9


class WindowModel:
    """CP-SAT's model of re-placing the ops that ``plan`` puts on ``window``'s stages, on those stages only."""

    def __init__(self, prob: Problem, plan: Sequence[int], window: range, groups: Sequence[Sequence[int]],
                 bottleneck: float):
        self.prob, self.window, self.plan = prob, window, list(plan)
        self.m = cp_model.CpModel()
        self.stages = list(window)
        self.ops = [v for v in range(prob.n) if plan[v] in window]
        self.inside = {v: i for i, v in enumerate(self.ops)}
        self.scale = _UNITS / max(bottleneck, 1e-300)
        report = prob.stage_report(plan)
        self.choice = {s: report[s].choice for s in self.stages}
        self._placement(groups)
        # (seconds, literal) terms per modelled stage; outside the window, the plan's value of those terms
        self.terms: dict[int, list[tuple[float, cp_model.IntVar]]] = {s: [] for s in self.stages}
        self.moved: dict[int, float] = {}
        self.aux: list[cp_model.IntVar] = []  # r and y: each at least what the placement forces
        self._compute()
        self._transfers()
        self._limits([rep.time for rep in report], bottleneck)
        for i, v in enumerate(self.ops):
            for j, s in enumerate(self.stages):
                self.m.add_hint(self.x[i][j], int(plan[v] == s))

    def _placement(self, groups: Sequence[Sequence[int]]) -> None:
        """x (one window stage per op), the order encoding z on the window's edges, no empty stage, the groups."""
        prob, m, ops, inside, k = self.prob, self.m, self.ops, self.inside, len(self.stages)
        self.x = x = [[m.new_bool_var(f"x{v}_{s}") for s in self.stages] for v in ops]
        for row in x:
            m.add_exactly_one(row)
        z = [[None] + [m.new_bool_var(f"z{v}_{s}") for s in self.stages[1:]] for v in ops]
        for i in range(len(ops)):
            for j in range(1, k):
                m.add(z[i][j] == LinearExpr.sum(x[i][j:]))
        for u in ops:
            for w in prob.succ[u]:
                if w in inside:
                    for j in range(1, k):
                        m.add_implication(z[inside[u]][j], z[inside[w]][j])
        for j in range(k):
            m.add(LinearExpr.sum([x[i][j] for i, v in enumerate(ops) if not prob.is_output[v]]) >= 1)
        for group in groups:  # a group is inside the window or outside it as a whole: the plan keeps it together
            members = [inside[g] for g in group if g in inside]
            for g in members[1:]:
                for j in range(k):
                    m.add(x[g][j] == x[members[0]][j])

    def _pay(self, stage: int, seconds: float, lit: cp_model.IntVar, was: bool) -> None:
        """Stage ``stage`` pays ``seconds`` when ``lit``; ``was``: the plan pays it (counted outside the window)."""
        self.terms.setdefault(stage, []).append((seconds, lit))
        if stage not in self.window and was:
            self.moved[stage] = self.moved.get(stage, 0.0) + seconds

    def _compute(self) -> None:
        """Each op's compute and (under the stage's choice in the plan) recomputation on its window stage."""
        prob = self.prob
        for i, v in enumerate(self.ops):
            for j, s in enumerate(self.stages):
                c = (prob.work[v] + prob.rec.seconds[self.choice[s]][v]) / prob.speed[s]
                if c > 0:
                    self._pay(s, float(c), self.x[i][j], False)

    def _transfers(self) -> None:
        """The transfers whose price moves with the window's ops (module docstring), paid by both ends."""
        prob, m, x, plan, inside, stages = self.prob, self.m, self.x, self.plan, self.inside, self.stages

        def price(a: int, t: int, u: int) -> float:
            return prob.directions * prob.transfer_seconds(a, t, float(prob.out_bytes[u]))

        for u in range(prob.n):
            if prob.out_bytes[u] <= 0 or not prob.succ[u]:
                continue
            readers = [inside[w] for w in prob.succ[u] if w in inside]
            if u in inside:
                i = inside[u]
                for t in sorted({plan[w] for w in prob.succ[u] if w not in inside}):  # read after the window
                    for j, a in enumerate(stages):
                        self._pay(a, price(a, t, u), x[i][j], False)
                        self._pay(t, price(a, t, u), x[i][j], plan[u] == a)
                for jt in range(1, len(stages) if readers else 0):  # read on a later window stage
                    r = m.new_bool_var(f"r{u}_{stages[jt]}")
                    self.aux.append(r)
                    for w in readers:
                        m.add(r >= x[w][jt] - x[i][jt])
                    for ja in range(jt):
                        y = m.new_bool_var(f"y{u}_{stages[ja]}_{stages[jt]}")
                        self.aux.append(y)
                        m.add_bool_or([x[i][ja].Not(), r.Not(), y])
                        self._pay(stages[ja], price(stages[ja], stages[jt], u), y, False)
                        self._pay(stages[jt], price(stages[ja], stages[jt], u), y, False)
            elif plan[u] < self.window.start and readers:  # made before the window, read in it
                a = plan[u]
                for jt, t in enumerate(stages):
                    r = m.new_bool_var(f"r{u}_{t}")
                    self.aux.append(r)
                    for w in readers:
                        m.add(r >= x[w][jt])
                    self._pay(t, price(a, t, u), r, False)
                    self._pay(a, price(a, t, u), r, any(plan[w] == t for w in prob.succ[u]))

    def _limits(self, times: list[float], bottleneck: float) -> None:
        """Every modelled stage at most the plan's bottleneck (one unit over: terms are rounded down), each window
        stage's ops within its memory limit (their own share only), the window's largest load minimised."""
        prob, m, scale = self.prob, self.m, self.scale
        cap = math.floor(bottleneck * scale) + 1
        self.top = top = m.new_int_var(0, cap, "window")
        #: Per modelled stage, its integer load terms; outside the window, its constant part in ``base``.
        self.loads = {s: [(int(math.floor(sec * scale)), lit) for sec, lit in terms] for s, terms in self.terms.items()}
        self.base = {s: max(0, math.floor((times[s] - self.moved.get(s, 0.0)) * scale))
                     for s in self.terms if s not in self.window}
        for s, ints in self.loads.items():
            if s in self.window:
                m.add(weighted([*ints, (-1, top)]) <= 0)
            else:
                m.add(weighted(ints) <= cap - self.base[s])
        for j, s in enumerate(self.stages):
            limit = prob.mem_limit[s]
            if limit is None:
                continue
            need = [prob.node_memory(v, s, self.choice[s]) for v in self.ops]
            q = _UNITS / max(float(limit), 1e-300)
            m.add(weighted([(int(math.floor(b * q)), self.x[i][j]) for i, b in enumerate(need)])
                  <= math.floor(_UNITS * (1 + 1e-12)))
        m.minimize(top)

    def assignment(self, solver: cp_model.CpSolver) -> list[int]:
        """The plan with the window's ops where ``solver``'s solution puts them."""
        new = list(self.plan)
        for i, v in enumerate(self.ops):
            new[v] = next(s for j, s in enumerate(self.window) if solver.BooleanValue(self.x[i][j]))
        return new
