"""A lower bound by bisection on the bottleneck: CP-SAT shows that no valid plan fits under a cap.

CP-SAT minimising the bottleneck raises its lower bound only through its linear relaxation,
which spreads each op over every stage and pays no communication: on T5-small at 8 stages its
bound stays where it starts (0.380 ms) for 30 deterministic seconds, under every search
setting tried on the per-link model (default, ``linearization_level`` 2, LB tree search,
core-based search). The same model with the bottleneck *capped* and no objective is a
feasibility question, and there every stage's time constraint propagates against a constant:
without the linear relaxation (``linearization_level`` 0) "no plan under 0.44 ms" is proven in
2.9 deterministic seconds (7.5 on the per-link model; docs/optimizer.md, "Bisection"). So the
bound is raised by bisection between the best bound so far and the plan: each check is the
CP-SAT model of :mod:`partitioner.solve.cpsat` with the bottleneck's domain cut at the cap, no
objective, and the redundant sums over the stages on each side of every cut
(:meth:`~partitioner.solve.cpsat_model.PlacementModel.cut_sums`), which let propagation weigh an op as soon as it
is placed on one side of a cut (proofs on the 100-op layered DAG at 8 stages in 0.42-0.83 of the
deterministic time, on T5-small at 8 stages 0.41-0.68; at 16 stages 0.83-0.97 on average over three
seeds, and more wall seconds per deterministic second; docs/optimizer.md, "Bisection");

- INFEASIBLE proves every valid plan's bottleneck above the cap (the integer loads are rounded
  down, so a plan under the cap in floats is under it in integers: the model would hold it);
- FEASIBLE is a plan at most the cap (plus rounding), priced again in floats: the plan improves,
  and the bisection goes on below it;
- UNKNOWN (budget spent) leaves the cap unproven, and the bisection tries below it.

The caps first descend from the plan: 2% under it, then 1% under each plan found under a cap, so
that a plan a few percent above the optimum (where the DP, the tabu search and CP-SAT leave the
unproven rows of the planner benchmark) is improved and proven within 1% in two checks. A cap proven
ends the descent unless the cap 1% under the plan is still above the bound: after a proof 2% under it,
that cap proves the plan within 1%, finds a better plan, or is left unproven (T5-small at 16 stages from
the window search's plan: 0.3777 ms, none under 0.3703, a plan of 0.3735 under 0.3740). An unproven cap (or one whose
plan is not taken) ends it too; from there caps climb from the
bound, starting a quarter of the way to the lowest cap not proven or plan found, by a doubling step
while proven (a proof is harder the closer the cap is to the optimum). A check gets half the budget
left, or 1.5 times what the last proof took when more (while descending, what the search for the plan
just above the next cap took), so an unproven check leaves room for easier ones below it. Budgets
are deterministic seconds: the same checks, caps and answers on any machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from partitioner.problem import Problem
from partitioner.solve.cpsat_model import BUILD_LOCK, PlacementModel, proof_solver

__all__ = ["BISECT_RTOL", "Check", "BisectResult", "bisect_bound"]

#: Stop once the caps left to try span less than this fraction of the plan's bottleneck.
BISECT_RTOL = 1e-3
#: The first cap lies this share of the way from the bound to the plan; each cap proven doubles the step,
#: an unproven one quarters it (and caps stay below the unproven one).
FIRST_STEP = 0.25
#: A check may spend this share of the budget left ...
CHECK_SHARE = 0.5
#: ... or, when more, this many times what the last proof took (a higher cap is a harder proof; while
#: descending, what the search for the plan just above the cap took).
PROOF_GROWTH = 1.5
#: Deterministic seconds below which a check is not worth starting (CP-SAT's presolve alone).
MIN_CHECK = 0.05
#: The caps first descend from the plan, which the DP, the tabu search and CP-SAT leave a few percent above
#: the optimum where a row of the planner benchmark is bracketed: the first lies this fraction under it ...
FIRST_DROP = 0.02
#: ... and after each plan found under a cap (or the first cap proven), the next lies this fraction under the
#: plan (proven, the plan is within it of the optimum). A cap unproven, or proven with the next at or under
#: it, ends the descent; the climb begins.
TARGET_GAP = 0.01


@dataclass
class Check:
    """One feasibility check: the cap (seconds), CP-SAT's status and its deterministic seconds."""

    cap: float
    status: str
    deterministic_seconds: float


@dataclass
class BisectResult:
    """The highest cap proven infeasible (``lower_bound``; the ``lower`` given when none) and the best plan found
    under a cap (``assign`` None when none beat ``upper``)."""

    lower_bound: float
    assign: list[int] | None
    value: float
    checks: list[Check] = field(default_factory=list)
    wall_stopped: bool = False
    notes: list[str] = field(default_factory=list)


def bisect_bound(prob: Problem, groups: Sequence[Sequence[int]] = (), *, lower: float, upper: float,
                 budget: float, wall_limit: float, workers: int = 1, seed: int = 0,
                 rtol: float = BISECT_RTOL, descend: bool = True) -> BisectResult:
    """Raise ``lower`` (a proven bound) towards ``upper`` (a plan's bottleneck) by feasibility checks
    under caps between them, within ``budget`` deterministic seconds in all, until the caps left span
    less than ``rtol`` of the plan; ``groups``: colocated positions; ``descend``: first try caps just under
    the plan (:data:`FIRST_DROP`, :data:`TARGET_GAP`), else climb from the bound at once."""
    t0 = time.perf_counter()
    res = BisectResult(lower, None, upper)
    if not 0 < lower < upper or not math.isfinite(upper) or upper - lower <= rtol * upper or budget < MIN_CHECK:
        return res
    if wall_limit <= 0:
        res.wall_stopped = True  # not even the model is built: that alone takes seconds at 2,000 ops
        return res
    with BUILD_LOCK:
        model = PlacementModel(prob, groups)
        model.objective(upper, upper, lower)
        model.cut_sums()
    model.m.clear_objective()
    res.notes += [f"bisection: {note.split(': ', 1)[-1]}" for note in model.notes]
    bneck = model.m.proto.variables[model.bneck.index]
    floor_units = bneck.domain[0]
    ceiling, left = upper, budget
    step = (upper - lower) * FIRST_STEP  # above the bound: the higher the cap, the harder the proof
    last_decided = 0.0  # deterministic seconds of the last proof (or, descending, of the last plan found)
    last_was_proof = False  # whether last_decided is a proof's (a plan's search says nothing of a proof)
    descending = descend
    while ceiling - res.lower_bound > rtol * res.value and left >= MIN_CHECK:
        wall_left = wall_limit - (time.perf_counter() - t0)
        if wall_left <= 0:
            res.wall_stopped = True
            break
        if descending:
            cap = res.value / (1 + (TARGET_GAP if res.checks else FIRST_DROP))
            last = res.checks[-1].status if res.checks else "FEASIBLE"
            # the last cap unproven, the plan that close to the bound (a cap proven 2% under it: the target 1%
            # under it is tried, which proves the plan within 1% or finds a better one), or not improved: climb
            if last not in ("FEASIBLE", "OPTIMAL", "INFEASIBLE") or not res.lower_bound < cap < ceiling:
                descending, step = False, (ceiling - res.lower_bound) * FIRST_STEP
                if not last_was_proof:
                    last_decided = 0.0  # a plan's search says nothing of a proof
        if not descending:
            cap = min((res.lower_bound + ceiling) / 2, res.lower_bound + step)
        # Half the budget left, or more where the last proof (at a lower cap; descending, the search for the
        # plan just above this cap) took more than that.
        allot = min(left, max(left * CHECK_SHARE, PROOF_GROWTH * last_decided))
        if left - allot < MIN_CHECK:
            allot = left
        # A plan at most ``cap`` in floats has integer loads at most floor(cap * scale): one unit over is safe.
        bneck.domain[1] = max(floor_units, math.floor(cap * model.scale) + 1)
        solver = proof_solver(budget=allot, wall_left=wall_left, workers=workers, seed=seed)
        # No linear relaxation: it is what cannot see communication, and without it propagation alone proves
        # more, faster (T5-small at 8 stages, "none under 0.42 ms": 3.3 deterministic s, 7.1 with it at
        # the default level, 16.8 at level 2; docs/optimizer.md)
        solver.parameters.linearization_level = 0
        status = solver.Solve(model.m)
        det = float(solver.response_proto.deterministic_time)
        left -= det
        res.checks.append(Check(cap, solver.StatusName(status), det))
        if status == cp_model.INFEASIBLE:
            res.lower_bound, last_decided, last_was_proof = cap, det, True
            step *= 2
        elif status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            assign = model.assignment(solver)
            times, mem = prob.stage_costs(assign)
            if prob.fits(mem) and max(times) < res.value:
                res.assign, res.value = assign, max(times)
            elif not prob.fits(mem):
                note = ("bisection: a plan under a cap exceeds a memory limit by less than the integer rounding; "
                        "not taken")
                res.notes += [note] if note not in res.notes else []
            ceiling = min(cap, res.value)
            if descending:
                last_decided, last_was_proof = det, False  # the next cap is lower, likely a proof, as hard as this
        elif status == cp_model.UNKNOWN:
            if det < allot * 0.99:  # stopped before its budget: the wall clock struck
                res.wall_stopped = True
                break
            ceiling, step = cap, step / 4
        else:  # MODEL_INVALID: a bug in the model, not an answer
            raise RuntimeError(f"bisection: CP-SAT rejected the model ({solver.StatusName(status)}) at cap {cap:.6g} s")
    return res
