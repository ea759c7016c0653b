"""Large-neighbourhood search over windows of consecutive stages: CP-SAT re-places a few stages' ops, the rest fixed.

CP-SAT's optimisation over the whole model finds plans slowly where its bound proves nothing (the random
layered DAGs, T5): every op may go anywhere, and its search wanders. The tabu search of
:mod:`partitioner.solve.moves` moves one op at a time and stops where every single move is worse. Between
the two, this search frees the ops of ``k`` consecutive stages (a window) and fixes every other op where the
plan has it; CP-SAT then finds, among every valid re-placement of those ops on those stages, the least
largest load of the window's stages with every stage held at most the plan's bottleneck (the stages outside
the window pay for what they send to it, so they are in the model too). A re-placement is taken when its
stage times, sorted from the largest, are lexicographically smaller than the plan's (so relieving one of
several equal bottlenecks counts), priced again in floats by the one cost model and within memory. This is
large-neighbourhood search (Shaw, "Using Constraint Programming and Local Search Methods to Solve Vehicle
Routing Problems", CP 1998) with the exact model of :mod:`partitioner.solve.cpsat` on each neighbourhood.

Windows hold a stage among the three slowest (a sixth of the stages where that is more: :func:`slowest`), and
each is tried once per plan; when no window of ``k`` stages
improves the plan, ``k`` grows by one (up to ``p - 1``: ``p`` is CP-SAT's own search). Small windows are cheap and
often all that is needed (the 1,000-op layered DAG at 8 stages: 8.127 -> 8.072 ms in 0.30 deterministic seconds
with two stages); larger ones reach plans the small ones cannot (the 100-op layered DAG at 8 stages: 1.0773 ->
1.0631 ms in 15 deterministic seconds, 1.0596 in 20, with windows of six). The budget is deterministic
seconds, each window at most :data:`WINDOW_BUDGET`: the same plan on any machine; the wall clock is only a
safety net. Colocation groups, memory limits and recomputation are the full model's. Where that model is too large
to build (``auto``'s limits; the 1,000-op layered DAG at 64 stages), each window is searched on a model of its
own ops alone (:mod:`partitioner.solve.window_model`: the plan's recomputation choices, each op's own memory), its
re-placements priced again in floats before one is taken (there: 1.6847 -> 1.6047 ms in 15 deterministic seconds).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from partitioner.problem import Problem
from partitioner.solve.cpsat_model import BUILD_LOCK, PlacementModel, proof_solver, weighted
from partitioner.solve.moves import lexicographically_smaller
from partitioner.solve.window_model import WindowModel

__all__ = ["WindowResult", "window_search", "slowest", "WINDOW_BUDGET", "SLOWEST", "SLOWEST_SHARE", "ALONE_WIDEST"]

#: Deterministic seconds one window may take (unfinished, its best re-placement still counts).
WINDOW_BUDGET = 5.0
#: Windows hold one of this many slowest stages, or of this share of the stages where that is more: on plans
#: with many near-equal bottlenecks (the 1,000-op layered DAG at 64 stages, 20 stages within 1.5% of it) the
#: three slowest stages' windows run out (1.6847 -> 1.6521 ms in 45 deterministic seconds; a sixth, 10 stages,
#: 1.6047 in 15; 20 stages the same plan; `git show 3ddb428:benchmarks/results/window-alone-scratch.log`).
SLOWEST = 3
SLOWEST_SHARE = 1 / 6
#: The widest window searched on a model of its own ops alone: its transfers inside the window take a Boolean per
#: (tensor, sending stage, receiving stage), k(k-1)/2 per tensor, built in Python outside CP-SAT's budget (the
#: 1,000-op layered DAG at 64 stages gains nothing past 4 stages, the encoder-decoder reaches 8).
ALONE_WIDEST = 8


@dataclass
class WindowResult:
    """The best plan (stage per position) and its bottleneck, where it started, the windows tried and taken, the
    widest window tried, the deterministic seconds spent, and whether the wall clock stopped it."""

    assign: list[int]
    value: float
    start_value: float
    tried: int = 0
    taken: int = 0
    widest: int = 0
    deterministic_seconds: float = 0.0
    wall_stopped: bool = False


def _sorted_times(prob: Problem, assign: Sequence[int]) -> tuple[list[float], bool]:
    """The stage times from the largest, and whether the plan fits memory."""
    times, mem = prob.stage_costs(assign)
    return sorted(times, reverse=True), prob.fits(mem)


def slowest(p: int) -> int:
    """How many of the slowest stages the windows hold one of, at ``p`` stages."""
    return max(SLOWEST, int(p * SLOWEST_SHARE))


def _windows(times: Sequence[float], p: int, k: int) -> list[int]:
    """First stages of the windows of k stages holding one of the :func:`slowest` slowest stages, slowest first."""
    starts: list[int] = []
    for b in np.argsort(-np.asarray(times), kind="stable")[:slowest(p)]:
        for lo in range(max(0, int(b) - k + 1), min(int(b), p - k) + 1):
            if lo not in starts:
                starts.append(lo)
    return starts


def window_search(prob: Problem, assign: Sequence[int], groups: Sequence[Sequence[int]] = (), *, budget: float,
                  wall_limit: float, workers: int = 1, seed: int = 0, whole: bool = True) -> WindowResult:
    """Re-place the ops of windows of consecutive stages (module docstring) from ``assign`` (valid, within memory)
    within ``budget`` deterministic seconds; ``groups``: colocated positions (the plan keeps them together).
    ``whole``: each window on CP-SAT's model of the whole problem (built once); else on a model of the window
    alone (:class:`~partitioner.solve.window_model.WindowModel`, for problems whose whole model is too large)."""
    t0 = time.perf_counter()
    p = prob.p
    plan = list(assign)
    times, _ = prob.stage_costs(plan)
    res = WindowResult(plan, max(times), max(times))
    # Two stages: a window of one stage moves nothing, of two is CP-SAT's own search; a free plan: nothing to relieve
    if p < 3 or budget <= 0 or res.value <= 0:
        return res
    if wall_limit <= 0:  # not even the model is built: that alone takes seconds at 2,000 ops
        res.wall_stopped = True
        return res
    model: PlacementModel | None = None
    if whole:
        with BUILD_LOCK:
            model = PlacementModel(prob, groups)
            model.objective(res.value, res.value, 0.0)
    loads = model.stage_loads() if model is not None else []
    left = budget
    k = 2
    tried: set[tuple[int, int, int]] = set()  # (first stage, stages, plan number) already searched
    plans = 0
    widest = p - 1 if whole else min(p - 1, ALONE_WIDEST)
    while k <= widest and left > 0:
        times, _ = prob.stage_costs(plan)
        todo = [lo for lo in _windows(times, p, k) if (lo, k, plans) not in tried]
        if not todo:
            k += 1
            continue
        wall_left = wall_limit - (time.perf_counter() - t0)
        if wall_left <= 0:
            res.wall_stopped = True
            break
        lo = todo[0]
        tried.add((lo, k, plans))
        res.tried += 1
        res.widest = max(res.widest, k)
        allot = min(left, WINDOW_BUDGET)
        window = range(lo, lo + k)
        if model is not None:
            det, new, finished = _search_window(prob, model, loads, plan, window, max(times), budget=allot,
                                                wall_left=wall_left, workers=workers, seed=seed)
        else:
            det, new, finished = _search_window_alone(prob, plan, window, groups, max(times), budget=allot,
                                                      wall_left=wall_left, workers=workers, seed=seed)
        left -= det
        res.deterministic_seconds += det
        if not finished and det < allot * 0.99:  # stopped before its budget: the wall clock struck
            res.wall_stopped = True
            break
        if new is None:
            continue
        new_sorted, fits = _sorted_times(prob, new)
        together = all(len({new[i] for i in group}) == 1 for group in groups)
        smaller = lexicographically_smaller(new_sorted, sorted(times, reverse=True))
        if fits and together and not prob.check(new) and smaller:
            plan, plans = new, plans + 1
            res.taken += 1
    res.assign = plan
    res.value = max(prob.stage_costs(plan)[0])
    return res


def _solve(m: cp_model.CpModel, window: range, *, budget: float, wall_left: float, workers: int, seed: int
           ) -> tuple[cp_model.CpSolver, int, float, bool]:
    """CP-SAT on one window's model: (the solver, its status, deterministic seconds, whether it finished)."""
    solver = proof_solver(budget=budget, wall_left=wall_left, workers=workers, seed=seed)
    status = solver.Solve(m)
    if status == cp_model.MODEL_INVALID:  # a bug in the model, not an answer
        raise RuntimeError(f"window search: CP-SAT rejected the model (stages {window.start}-{window.stop - 1})")
    finished = status in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
    return solver, status, float(solver.response_proto.deterministic_time), finished


def _search_window_alone(prob: Problem, plan: list[int], window: range, groups: Sequence[Sequence[int]],
                         bottleneck: float, *, budget: float, wall_left: float, workers: int, seed: int
                         ) -> tuple[float, list[int] | None, bool]:
    """CP-SAT on a model of the window alone: (deterministic seconds, the re-placement found or None, whether
    CP-SAT finished)."""
    model = WindowModel(prob, plan, window, groups, bottleneck)
    solver, status, det, finished = _solve(model.m, window, budget=budget, wall_left=wall_left, workers=workers,
                                           seed=seed)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return det, None, finished
    return det, model.assignment(solver), finished


def _search_window(prob: Problem, model: PlacementModel, loads: list, plan: list[int], window: range, bottleneck: float,
                   *, budget: float, wall_left: float, workers: int, seed: int
                   ) -> tuple[float, list[int] | None, bool]:
    """CP-SAT on the window's ops: (deterministic seconds, the re-placement found or None, whether CP-SAT
    finished)."""
    model.m.clear_hints()
    model.hint(plan)
    m = model.m.clone()
    proto = m.proto
    for v in range(prob.n):
        inside = plan[v] in window
        for s in range(prob.p):
            dom = proto.variables[model.x[v][s].index].domain
            if inside and s in window:
                continue
            value = 0 if inside else int(plan[v] == s)
            dom[0], dom[1] = value, value
    # Every stage at most the plan's bottleneck (one unit over: the integer loads are rounded down) ...
    bneck = proto.variables[model.bneck.index].domain
    bneck[1] = max(bneck[0], min(bneck[1], math.floor(bottleneck * model.scale) + 1))
    # ... and the window's largest load as small as it can be.
    top = m.new_int_var(0, bneck[1], "window")
    for s in window:
        if loads[s]:
            m.add(weighted([*loads[s], (-1, top)]) <= 0)
    m.minimize(top)
    solver, status, det, finished = _solve(m, window, budget=budget, wall_left=wall_left, workers=workers, seed=seed)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return det, None, finished
    return det, model.assignment(solver), finished
