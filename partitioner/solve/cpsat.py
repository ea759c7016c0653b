"""CP-SAT's optimisation over every valid assignment of the DAG (not one order), with a proven bound.

The model is :class:`~partitioner.solve.cpsat_model.PlacementModel` (after Tarnawski et al., NeurIPS 2020:
a 0/1 variable per (op, stage), exact communication, memory and recomputation), its integers rounded in the
direction that never cuts off a plan: the solver's bound divided by the scale is a valid lower bound on the
float optimum, and the returned plan is checked in floats by the one cost model. The search stops at a
deterministic-time budget (the same plan and bound on any machine); the wall clock is only a safety limit, and
reported when it struck.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from partitioner.problem import Problem
from partitioner.solve.cpsat_model import BUILD_LOCK, PlacementModel, proof_solver

__all__ = ["CPResult", "cpsat_solve"]


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


def cpsat_solve(prob: Problem, groups: Sequence[Sequence[int]] = (), *, hint: Sequence[int] | None = None,
                lower_bound: float = 0.0, budget: float = 10.0, wall_limit: float = 60.0, workers: int = 1,
                seed: int = 0) -> CPResult:
    """Minimise the bottleneck over all valid assignments with ``groups`` (positions) colocated.

    ``budget``: CP-SAT deterministic time (its work measure, roughly seconds on a quiet
    core); ``wall_limit``: seconds, a safety net. Deterministic for any ``workers``.
    """
    t0 = time.perf_counter()
    upper = prob.bottleneck(hint) if hint is not None else None
    with BUILD_LOCK:
        model = PlacementModel(prob, groups)
        model.objective(max(upper or 0.0, lower_bound), upper, lower_bound)
        if hint is not None:
            model.hint(hint)
    solver = proof_solver(budget=budget, wall_left=wall_limit - (time.perf_counter() - t0), workers=workers,
                          seed=seed)
    status = solver.Solve(model.m)
    return _result(prob, model, solver, status, time.perf_counter() - t0, budget)


def _result(prob: Problem, model: PlacementModel, solver: cp_model.CpSolver, status, seconds: float,
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
