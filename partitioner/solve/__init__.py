"""The ``solve`` dispatcher: dp, cpsat, auto and the peer baselines, all reported through one cost model."""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable

import networkx as nx

from partitioner.cluster import Cluster
from partitioner.cost import DEFAULT_STATE_FACTOR, Partition, Problem, format_bytes
from partitioner.errors import MemoryLimitError, PlanningError
from partitioner.graph import OpGraph
from partitioner.solve.baselines import BASELINES, baseline_assign
from partitioner.solve.bounds import memory_lower_bound, trivial_lower_bound
from partitioner.solve.cpsat import cpsat_size, cpsat_solve
from partitioner.refine import refine_step_time
from partitioner.solve.dp import allowed_cuts, dp_solve

__all__ = ["solve", "METHODS", "OBJECTIVES", "AUTO_CPSAT_MAX_NODES", "AUTO_CPSAT_MAX_VARS", "DEFAULT_TIME_LIMIT",
           "DP_SEARCH_SECONDS"]

METHODS = ("auto", "dp", "cpsat", *BASELINES)
OBJECTIVES = ("bottleneck", "step_time")
#: Seconds the step-time refinement may take at most.
REFINE_SECONDS = 5.0
#: ``auto`` runs CP-SAT after the DP only on graphs up to this many ops ...
AUTO_CPSAT_MAX_NODES = 2000
#: ... and this many model variables (ops x stages + transfer variables).
AUTO_CPSAT_MAX_VARS = 400_000
#: Seconds dp's branch and bound may search to close its order gap.
DP_SEARCH_SECONDS = 2.0
#: Seconds CP-SAT may search when ``time_limit`` is not given.
DEFAULT_TIME_LIMIT = 10.0


def solve(graph: OpGraph | nx.DiGraph, stages: int, *, cluster: Cluster | None = None,
          microbatches: int = 1, schedule: str = "1f1b", training: bool = True,
          memory_limit: float | None = None, colocate: Iterable[Iterable[Hashable]] = (),
          method: str = "auto", time_limit: float | None = None,
          state_factor: float = DEFAULT_STATE_FACTOR, workers: int = 1,
          objective: str = "bottleneck", ranks: int | None = None) -> Partition:
    """Assign every op to one of ``stages`` pipeline stages, minimising the bottleneck stage time.

    ``method``: ``"dp"`` (exact over contiguous cuts of the program order), ``"cpsat"``
    (all valid assignments, proven bound, warm-started from dp), ``"auto"`` (dp, then
    cpsat when the graph has more than one topological order and is small enough; never
    worse than dp), or a baseline ``"uniform"``, ``"params"``, ``"blocks"``.
    ``memory_limit``: bytes per device, or None for the cluster devices' memory.
    ``colocate``: groups of node names that must share a stage. ``time_limit``: seconds
    for the whole solve (CP-SAT gets what dp leaves). ``workers``: CP-SAT threads; 1 keeps
    results deterministic. ``objective="step_time"`` then refines the answer by simulated
    step time under ``schedule`` (``ranks``: pipeline ranks of an interleaved schedule),
    see :mod:`partitioner.refine`; bounds and gap still speak of the bottleneck.
    """
    if objective not in OBJECTIVES:
        raise PlanningError(f"unknown objective {objective!r}; use one of {', '.join(OBJECTIVES)}")
    if method not in METHODS:
        raise PlanningError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    t0 = time.perf_counter()
    prob = Problem(graph, stages, cluster=cluster, microbatches=microbatches, schedule=schedule,
                   training=training, memory_limit=memory_limit, state_factor=state_factor)
    groups = [list(g) for g in colocate]
    allowed = allowed_cuts(prob, groups)
    budget = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)

    if method in BASELINES:
        assign = baseline_assign(prob, method, allowed)
        return prob.partition(assign, method=method, solve_seconds=time.perf_counter() - t0)

    # The branch and bound behind dp only matters when its lower model is loose; cap it so
    # dp stays fast and auto leaves CP-SAT most of the budget.
    dp = dp_solve(prob, groups, time_limit=min(budget, DP_SEARCH_SECONDS if method == "dp" else 1.0))
    unique = prob.is_unique_order()
    notes: list[str] = []
    best_assign, best_lb, best_opt, used = None, trivial_lower_bound(prob), False, "dp"
    if dp is not None:
        best_assign = dp.assign
        if unique:
            best_lb = max(best_lb, dp.order_lower_bound)
            best_opt = dp.order_optimal
        if dp.order_optimal:
            notes.append("dp: optimal over contiguous cuts of the program order")
        else:
            notes.append(f"dp: search budget ran out; the program order's best is >= "
                         f"{dp.order_lower_bound:.6g} s")
        if unique:
            notes.append("the graph has a single topological order, so contiguous cuts are every valid assignment")

    run_cp = method == "cpsat" or (
        method == "auto" and not (unique and dp is not None and dp.order_optimal)
        and prob.n <= AUTO_CPSAT_MAX_NODES and cpsat_size(prob) <= AUTO_CPSAT_MAX_VARS)
    if method == "auto" and not run_cp and not unique:
        notes.append(f"auto: CP-SAT skipped ({prob.n} ops, ~{cpsat_size(prob)} variables; limits "
                     f"{AUTO_CPSAT_MAX_NODES} ops, {AUTO_CPSAT_MAX_VARS} variables): coarsen the graph")
    cp = None
    if run_cp:
        remaining = max(0.1, budget - (time.perf_counter() - t0))
        cp = cpsat_solve(prob, groups, hint=dp.assign if dp is not None else None,
                         time_limit=remaining, workers=workers)
        notes.append(f"cpsat: {cp.status} in {cp.seconds:.2f} s")
        if cp.assign is not None:
            best_lb = max(best_lb, cp.lower_bound)
            if best_assign is None or cp.value < prob.bottleneck(best_assign) * (1 - 1e-12):
                best_assign, used = cp.assign, "cpsat"
            if cp.optimal:
                best_opt = True
        elif cp.infeasible and dp is not None:
            # The hint is feasible, so this only happens through memory rounding; keep dp.
            notes.append("cpsat: model infeasible with rounded memory; kept the dp plan")

    if best_assign is None:
        raise _memory_error(prob, proven=cp is not None and cp.infeasible)
    label = used if method != "auto" else f"auto/{used}"
    if objective == "step_time":
        frozen = {prob.pos[v] for group in groups if len(group) > 1 for v in group}
        remaining = max(0.5, budget - (time.perf_counter() - t0))
        refined, before, after = refine_step_time(prob, best_assign, ranks=ranks, frozen=frozen,
                                                  time_limit=min(remaining, REFINE_SECONDS))
        if refined != list(best_assign):
            notes.append(f"step-time refinement: simulated step {before * 1e3:.4g} ms -> {after * 1e3:.4g} ms")
            best_opt = best_opt and prob.bottleneck(refined) <= prob.bottleneck(best_assign)
            best_assign = refined
            label += "+sim"
        else:
            notes.append("step-time refinement: no single-op move shortens the simulated step")
    part = prob.partition(best_assign, method=label)
    part.with_report(lower_bound=best_lb, optimal=best_opt,
                     solve_seconds=time.perf_counter() - t0, notes=notes)
    return part


def _memory_error(prob: Problem, *, proven: bool) -> MemoryLimitError:
    needed, largest = memory_lower_bound(prob)
    limits = [x for x in prob.mem_limit if x is not None]
    limit = min(limits) if limits else None
    what = (f"memory limit {format_bytes(limit)} per device" if prob.memory_limit_arg is not None
            else f"device memory ({format_bytes(limit)} on the smallest device)")
    fix = ("raise the memory limit, add stages, train with a schedule that keeps fewer microbatches "
           "in flight (1f1b instead of gpipe), use fewer microbatches, or a smaller state_factor")
    if limit is not None and limit < needed:
        msg = (f"{what} is below what any {prob.p}-stage assignment needs: at least "
               f"{format_bytes(needed)} (the largest op alone needs {format_bytes(largest)}); {fix}")
    else:
        where = "no valid assignment" if proven else "no assignment on the program order"
        msg = (f"{what}: {where} fits, though the bound for any {prob.p}-stage assignment is "
               f"{format_bytes(needed)} (ops cannot be split finely enough); {fix}")
    return MemoryLimitError(msg, needed=needed)
