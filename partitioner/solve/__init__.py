"""The ``solve`` dispatcher: dp, cpsat, auto and the peer baselines, all reported through one cost model."""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from partitioner.bounds import memory_lower_bound, named_bounds
from partitioner.cost import OPTIMAL_RTOL, Partition, partition
from partitioner.errors import MemoryLimitError, PlanError
from partitioner.graph import OpGraph
from partitioner.problem import Problem, ProblemSettings, graph_order
from partitioner.refine import refine_step_time, simulated_step_time
from partitioner.solve.baselines import BASELINES, baseline_assign
from partitioner.solve.bisect import bisect_bound
from partitioner.solve.colocate import Blocks, colocation_blocks
from partitioner.solve.cpsat import cpsat_solve
from partitioner.solve.cpsat_model import cpsat_size
from partitioner.solve.crossings import crossing_lower_bound
from partitioner.solve.dp import DP_SEARCH_WORK, dp_solve, least_memory, search_work
from partitioner.solve.groups import GROUPS, group_lower_bound
from partitioner.solve.ideals import MAX_IDEALS, ideal_dp
from partitioner.solve.moves import SECOND_TENURE, TABU_TENURE, tabu_phases
from partitioner.solve.windows import window_search
from partitioner.units import format_bytes

__all__ = ["solve", "check_choices", "METHODS", "OBJECTIVES", "AUTO_CPSAT_MAX_NODES", "AUTO_CPSAT_MAX_VARS", "DEFAULT_TIME_LIMIT",
           "DP_SEARCH_WORK", "cpsat_budget", "windows_budget", "wall_limit_for"]

METHODS = ("auto", "dp", "cpsat", *BASELINES)
OBJECTIVES = ("bottleneck", "step_time")
#: ``auto`` runs CP-SAT after the DP only on graphs up to this many ops ...
AUTO_CPSAT_MAX_NODES = 2000
#: ... and this many model variables (:func:`~partitioner.solve.cpsat_model.cpsat_size`): on clusters of 8-GPU nodes
#: 2,000 ops at 16 stages and 1,000 at 32 (about 106-115k) are in, 1,000 at 64 out (the 1,000-op layered DAG:
#: 221k; there 15 deterministic seconds of CP-SAT took 124 wall seconds and found no plan).
AUTO_CPSAT_MAX_VARS = 150_000
#: ``auto``'s whole deterministic budget, as a multiple of ``time_limit`` (``cpsat`` alone spends ``time_limit``) ...
AUTO_BUDGET_FACTOR = 2.0
#: ... of which CP-SAT's optimisation gets this share of ``time_limit``: it raises no bound where it proves
#: nothing, and with the step-priced model the bisection given the time does better on the gap (at 30: a quarter
#: against half, T5-small x 16 1.081 -> 1.039, the 100-op layered DAG 1.063 -> 1.048; the runs' logs:
#: `git show 3ddb428:benchmarks/results/planner-cpsat-half.log`, `...:planner.log`) ...
CPSAT_BUDGET_SHARE = 0.25
#: ... but at least this many deterministic seconds, or all of ``time_limit`` when less: its proofs in the
#: planner benchmark take up to 5.49 (GPT-2 base at 16 stages), T5-small's at 4 stages 2.87 ...
CPSAT_MIN_BUDGET = 6.0
#: ... the window search (CP-SAT re-placing a few consecutive stages' ops) at most this share, once CP-SAT's
#: optimisation leaves the plan unproven, and never more than it leaves the bisection (:func:`windows_budget`):
#: the 100-op layered DAG at 8 stages 1.0773 -> 1.0631 ms in 15 deterministic seconds, the 1,000-op one
#: 8.127 -> 8.071 ms (docs/optimizer.md, "Windows") ...
WINDOWS_BUDGET_SHARE = 0.5
#: Where the whole model is too large (:func:`_cpsat_fits`), the windows run on models of the window alone
#: (:mod:`partitioner.solve.window_model`) on graphs of at most this many ops (10,000 ops are planned in
#: seconds, not the window search's tens).
WINDOWS_ALONE_MAX_NODES = 2000
#: ... the grouped-stages bound this share, and the bisection the rest (what the others left included).
GROUP_BUDGET_SHARE = 0.5
#: The cut-crossings bound at most this share (it stops early where it proves nothing, and where its caps left
#: span under a thousandth of the plan: the 1,000-op layered DAG at 8 stages 7.874 -> 7.889 ms in 10.8 deterministic
#: seconds; a quarter, 7.5, ran out at 7.874 once its windows were narrowed), on graphs of at most this many ops (it
#: weighs each op's ancestors and descendants, n x n bits).
CROSSINGS_BUDGET_SHARE = 0.5
CROSSINGS_MAX_NODES = 2000
#: Four groups on graphs of at most this many ops: on the 1,000-op layered DAG at 8 stages four groups
#: do not finish in 15 deterministic seconds (25 wall seconds) ...
GROUPS_MAX_NODES = 750
#: ... two groups (one boundary) up to this many, which need about (ops / 1,000)² deterministic seconds
#: (0.9-1.1 at 1,000 ops, 3.6-3.8 at 2,000; at 10,000 they do not finish in 5, docs/optimizer.md) ...
TWO_GROUPS_MAX_NODES = 2000
#: ... and run only with this many times that in their budget (unfinished, they prove less than the
#: closed-form bounds: 1,500 ops in 2 deterministic seconds).
TWO_GROUPS_MARGIN = 2.0
#: ``time_limit`` when not given, deterministic seconds (CP-SAT's: about 4-10 wall seconds on one core of
#: this 2-core machine; under ``auto`` all of it for CP-SAT's optimisation, see :func:`cpsat_budget`).
DEFAULT_TIME_LIMIT = 4.0


def wall_limit_for(budget: float) -> float:
    """The wall-clock safety limit for a deterministic ``budget``: generous, so it strikes only on a
    machine several times slower (or busier) than the one the budget was calibrated on."""
    return 60.0 + 6.0 * budget


@dataclass
class _Search:
    """The best plan found so far, every proven bound by name, and what to tell the user."""

    prob: Problem
    assign: list[int] | None = None
    value: float = float("inf")
    found_by: str = ""
    bounds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    infeasible: bool = False  # CP-SAT proved that no valid assignment fits memory

    def offer(self, assign: Sequence[int] | None, value: float, by: str) -> None:
        """Keep ``assign`` when strictly better (so a later method never makes the plan worse), valid and within memory.

        Memory is checked on the one cost model: a method that prices it op by op (CP-SAT,
        the ideal DP) does not see the cut tensors a stage keeps, so its plan may not fit.
        """
        if assign is None or (self.assign is not None and value >= self.value * (1 - 1e-12)):
            return
        invalid = self.prob.check(assign)
        if invalid:  # a solver's bug, said rather than returned
            self.notes.append(f"{by}: its plan is not a valid assignment ({'; '.join(invalid)}); not taken")
            return
        if not self.prob.fits(self.prob.stage_costs(assign)[1]):
            self.notes.append(f"{by}: its plan keeps cut tensors over the memory limit; not taken")
            return
        self.assign, self.value, self.found_by = list(assign), value, by

    def bound(self, name: str, value: float) -> None:
        self.bounds[name] = max(value, self.bounds.get(name, 0.0))

    @property
    def proven(self) -> bool:
        """The plan meets its bound, or no plan exists: either way no further search can change the answer."""
        if self.infeasible:
            return True
        return self.assign is not None and max(self.bounds.values(), default=0.0) >= self.value * (1 - OPTIMAL_RTOL)


def solve(graph: OpGraph | nx.DiGraph, stages: int | ProblemSettings, *,
          colocate: Iterable[Iterable[Hashable]] = (), method: str = "auto", time_limit: float | None = None,
          workers: int = 1, objective: str = "bottleneck", wall_limit: float | None = None,
          **options: Any) -> Partition:
    """Assign every op to one of ``stages`` pipeline stages, minimising the bottleneck stage time.

    ``stages``: a stage count, with ``options`` naming the other fields of
    :class:`~partitioner.problem.ProblemSettings` (``cluster``, ``microbatches``, ``schedule``,
    ``training``, ``memory_limit``, ``state_factor``, ``workspace_factor``, ``working_factor``,
    ``ranks``, ``recompute``, ``active_microbatches``; ``recompute`` defaults to "auto" here),
    or the settings themselves (the planning request's, partitioner/compile.py).
    ``method``: ``"dp"`` (exact over contiguous cuts of the program order), ``"cpsat"``
    (all valid assignments, proven bound, warm-started from dp), ``"auto"`` (dp, then the
    DP over all ideals, a tabu search over single-op moves, cpsat, then the stage-groups
    bound, the cut-crossings bound and the bisection, each only while the plan is unproven and
    the graph small enough; never worse than dp), or a baseline ``"uniform"``, ``"params"``, ``"blocks"``.
    ``colocate``: groups of node names that must share a stage (each group's convex closure
    does). ``time_limit``: the search budget in deterministic seconds (CP-SAT's measure of work,
    about seconds on a quiet core), default :data:`DEFAULT_TIME_LIMIT`; ``cpsat`` spends it on
    CP-SAT, ``auto`` spends at most :data:`AUTO_BUDGET_FACTOR` times it on its CP-SAT searches:
    the optimisation :func:`cpsat_budget` of it, the window search :data:`WINDOWS_BUDGET_SHARE` at most, the
    stage-groups bound :data:`GROUP_BUDGET_SHARE`, the cut
    crossings :data:`CROSSINGS_BUDGET_SHARE` at most, the bisection the rest; dp's search, the ideal DP's and
    the moves' are bounded by counts (:data:`DP_SEARCH_WORK` and others, docs/optimizer.md). Budgets are counts,
    so the same input gives the same plan and bound on any machine; ``wall_limit`` (seconds, default
    :func:`wall_limit_for`) is only a safety net, and a note says when it struck.
    ``workers``: CP-SAT threads (deterministic for any count). ``objective="step_time"``
    then picks and refines the plan by simulated step time under ``schedule``
    (``ranks``: pipeline ranks of an interleaved schedule), see :mod:`partitioner.refine`;
    the bound, gap and ``optimal`` always speak of the bottleneck (``Partition.bound_on``).
    ``recompute``: "auto" (each stage's activation recomputation chosen with the assignment:
    none wherever memory allows, see :mod:`partitioner.recompute`), or "none", "selective",
    "full" on every stage. Under ``"none"`` a limit nothing fits raises a
    :class:`MemoryLimitError` that gives the least memory a plan needs and says whether
    recomputation would fit. The other settings (memory limit, cap on microbatches in flight,
    state, workspace and working factors) are :class:`~partitioner.problem.ProblemSettings`'.
    """
    check_choices(method, objective)
    if not isinstance(stages, ProblemSettings):
        options.setdefault("recompute", "auto")  # the solver chooses recomputation unless told (a Problem's: none)
    settings = ProblemSettings.of(stages, **options)
    t0 = time.perf_counter()
    budget = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
    # auto may spend more on the stage-groups bound and the bisection: its safety net grows with it
    spent = budget * AUTO_BUDGET_FACTOR if method == "auto" else budget
    deadline = t0 + (wall_limit_for(spent) if wall_limit is None else float(wall_limit))
    g, program_order = graph_order(graph)
    blocks = colocation_blocks(g, program_order, colocate)
    prob = Problem(graph, settings, order=blocks.order)
    blocks.check_stages(prob.p, lonely=[i for i, out in enumerate(prob.is_output) if out])
    if method in BASELINES:
        part = partition(prob, baseline_assign(prob, method, _allowed_cuts(prob, blocks)), method=method)
    else:
        part = _optimise(prob, blocks, method, budget, deadline, workers)
    if objective == "step_time":
        part = _refine(prob, blocks, part, settings.ranks)
    return part.with_report(solve_seconds=time.perf_counter() - t0)


def check_choices(method: str, objective: str) -> None:
    """Refuse an unknown method or objective (the planning request's check too)."""
    if method not in METHODS:
        raise PlanError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    if objective not in OBJECTIVES:
        raise PlanError(f"unknown objective {objective!r}; use one of {', '.join(OBJECTIVES)}")


def _optimise(prob: Problem, blocks: Blocks, method: str, budget: float, deadline: float,
              workers: int) -> Partition:
    """dp, the ideal DP and CP-SAT, each only while the plan is unproven; the best plan with the best bound."""
    search = _Search(prob)
    for name, value in named_bounds(prob).items():
        search.bound(name, value)
    limits = prob.mem_limit
    if limits and all(x is not None for x in limits) and \
            memory_lower_bound(prob)[0] > max(limits) * (1 + 1e-12):  # type: ignore[type-var]
        # some stage needs more than any device has, whatever the assignment: no search can fit
        raise _memory_error(prob, _allowed_cuts(prob, blocks), proven=True)
    single = blocks.single_order(prob.succ)
    _run_dp(search, blocks, single, deadline)
    starts: list[list[int]] = []
    if method == "auto" and not search.proven:
        starts = _run_ideals(search, blocks)
    if method == "auto" and not search.proven:
        _run_moves(search, blocks, deadline, starts)
    left = budget * AUTO_BUDGET_FACTOR  # auto's; the other methods spend ``budget`` on their one search
    if _wants_cpsat(search, method):
        before = search.assign
        left -= _run_cpsat(search, blocks, cpsat_budget(budget) if method == "auto" else budget, deadline, workers)
        if method == "auto" and not search.proven and search.assign is not before:
            _run_moves(search, blocks, deadline)  # CP-SAT's new plan, unproven: its neighbours too
    whole = _cpsat_fits(prob)
    if method == "auto" and not search.proven and search.assign is not None and \
            (whole or prob.n <= WINDOWS_ALONE_MAX_NODES):
        left -= _run_windows(search, blocks, windows_budget(budget, left), deadline, workers, whole=whole)
    groups = _groups_for(prob.n, budget * GROUP_BUDGET_SHARE)
    # A bound is wanted only beside a plan: with none found, nothing fits and no bound changes the answer
    if method == "auto" and not search.proven and search.assign is not None and groups:
        left -= _run_groups(search, groups, budget * GROUP_BUDGET_SHARE, deadline, workers)
    if method == "auto" and not search.proven and search.assign is not None and prob.n <= CROSSINGS_MAX_NODES:
        left -= _run_crossings(search, min(left, budget * CROSSINGS_BUDGET_SHARE), deadline)
    if method == "auto" and not search.proven and search.assign is not None and whole:
        before = search.assign
        _run_bisection(search, blocks, left, deadline, workers)
        if not search.proven and search.assign is not before:
            _run_moves(search, blocks, deadline)  # a plan found under a cap: its neighbours too
    if search.assign is None:
        raise _memory_error(prob, _allowed_cuts(prob, blocks), proven=search.infeasible)
    label = search.found_by if method != "auto" else f"auto/{search.found_by}"
    part = partition(prob, search.assign, method=label)
    for name, value in search.bounds.items():
        part.with_report(lower_bound=value, bound_by=name)
    return part.with_report(notes=search.notes)


def windows_budget(time_limit: float, left: float) -> float:
    """The window search's budget under ``auto`` (deterministic seconds), with ``left`` of auto's budget after
    CP-SAT's optimisation: :data:`WINDOWS_BUDGET_SHARE` of ``time_limit``, but at most half of what the stage
    groups' share leaves, so the bisection keeps as much (at ``time_limit`` 4: 1 of the 4 left)."""
    return max(0.0, min(WINDOWS_BUDGET_SHARE * time_limit, (left - GROUP_BUDGET_SHARE * time_limit) / 2))


def cpsat_budget(time_limit: float) -> float:
    """CP-SAT's optimisation budget under ``auto`` (deterministic seconds) for a ``time_limit``."""
    return min(time_limit, max(CPSAT_BUDGET_SHARE * time_limit, CPSAT_MIN_BUDGET))


def _run_dp(search: _Search, blocks: Blocks, single: bool, deadline: float) -> None:
    prob = search.prob
    dp = dp_solve(prob, _allowed_cuts(prob, blocks), wall_limit=max(0.0, deadline - time.perf_counter()))
    if dp is None:
        search.notes.append("dp: no contiguous cuts of the program order fit the memory limits")
        return
    search.offer(dp.assign, dp.value, "dp")
    what = "program order" if not blocks.groups else "program order with the colocation blocks contiguous"
    if dp.order_optimal:
        search.notes.append(f"dp: optimal over contiguous cuts of the {what}")
    else:
        search.notes.append(f"dp: search budget ({search_work():,} work units) ran out; the {what}'s "
                            f"best is >= {dp.order_lower_bound:.6g} s")
    if dp.wall_stopped:
        _note_wall_stop(search, "dp", "this plan and bound")
    if single:
        search.bound("dp (single order)", dp.order_lower_bound)
        search.notes.append("the graph has a single topological order (of its colocation blocks), so contiguous "
                            "cuts are every valid assignment")


def _run_ideals(search: _Search, blocks: Blocks) -> list[list[int]]:
    """The DP over all ideals: a bound valid for every assignment, and often the optimum; returns its
    chain at the least bottleneck with copies counted (if any), a start for the moves."""
    if blocks.groups:
        return []  # its ideals would have to respect the blocks; CP-SAT handles colocation
    res = ideal_dp(search.prob, upper=search.value)
    if res is None:
        search.notes.append(f"ideal dp: skipped (more than {MAX_IDEALS:,} ideals or too many segment pairs)")
        return []
    counted = ""
    if res.watched is not None and res.lower_bound > res.min_max:
        counted = (f"; {res.min_max:.6g} s before each copy of {search.prob.order[res.watched]}'s output "
                   f"was counted")
    search.notes.append(f"ideal dp: lower bound {res.lower_bound:.6g} s over every valid assignment "
                        f"({res.pairs:,} segment pairs{counted}); its plan {res.value:.6g} s")
    search.bound("ideal dp", res.lower_bound)
    search.offer(res.assign, res.value, "ideals")
    fits = res.tightest is not None and search.prob.fits(search.prob.stage_costs(res.tightest)[1])
    return [res.tightest] if fits else []


def _run_moves(search: _Search, blocks: Blocks, deadline: float, starts: Sequence[list[int]] = ()) -> None:
    """Tabu search over single-op moves (see :mod:`partitioner.solve.moves`) from the plan found so far
    and from each of ``starts`` (valid plans that fit memory), each in two phases with their own budgets."""
    frozen = {i for ops in _block_positions(blocks) for i in ops}
    plans = [search.assign] if search.assign is not None else []
    plans += [s for s in starts if s not in plans and not search.prob.check(s)]
    for k, start in enumerate(plans):
        res = tabu_phases(search.prob, start, frozen=frozen, deadline=deadline)
        which = "the plan so far" if k == 0 and start is search.assign else "the ideal DP's tightest chain"
        better = res.value < search.value * (1 - 1e-12)
        gain = f"{res.start_value:.6g} s -> {res.value:.6g} s" + ("" if better else ", no better plan")
        search.notes.append(f"moves: tabu search over single-op moves from {which}, {gain} "
                            f"({res.evaluations:,} plans priced, tenure {TABU_TENURE} then {SECOND_TENURE})")
        if res.wall_stopped:
            _note_wall_stop(search, "moves", "this plan")
        search.offer(res.assign, res.value, "moves")


def _run_windows(search: _Search, blocks: Blocks, budget: float, deadline: float, workers: int, *,
                 whole: bool) -> float:
    """CP-SAT re-placing the ops of windows of consecutive stages (:mod:`partitioner.solve.windows`) from the
    plan so far, on the whole model or (``whole`` false) on models of each window alone; returns the
    deterministic seconds it spent."""
    assert search.assign is not None
    res = window_search(search.prob, search.assign, _block_positions(blocks), budget=budget,
                        wall_limit=max(0.0, deadline - time.perf_counter()), workers=workers, whole=whole)
    if not res.tried:
        if res.wall_stopped:
            _note_wall_stop(search, "windows", "this plan", before=True)
        return res.deterministic_seconds
    better = res.value < search.value * (1 - 1e-12)
    gain = f"{res.start_value:.6g} s -> {res.value:.6g} s" + ("" if better else ", no better plan")
    alone = "" if whole else " (a model of each window alone: the whole model is too large)"
    search.notes.append(f"windows: CP-SAT re-placing the ops of up to {res.widest} consecutive stages{alone}, {gain} "
                        f"({res.tried} windows, {res.taken} taken, in {res.deterministic_seconds:.2f} of {budget:.3g} "
                        f"deterministic s)")
    if res.wall_stopped:
        _note_wall_stop(search, "windows", "this plan")
    search.offer(res.assign, res.value, "windows")
    return res.deterministic_seconds


def _groups_for(n: int, budget: float) -> int | None:
    """How many stage groups ``auto`` asks for on a graph of n ops with that budget (None: not run)."""
    if n <= GROUPS_MAX_NODES:
        return GROUPS
    if n <= TWO_GROUPS_MAX_NODES and budget >= TWO_GROUPS_MARGIN * (n / 1000) ** 2:
        return 2
    return None


def _run_groups(search: _Search, groups: int, budget: float, deadline: float, workers: int) -> float:
    """The grouped-stages bound (:mod:`partitioner.solve.groups`), started from the plan so far; returns
    the deterministic seconds it spent."""
    res = group_lower_bound(search.prob, groups=groups, budget=budget,
                            wall_limit=max(0.05, deadline - time.perf_counter()), hint=search.assign, workers=workers)
    if res is None:
        return 0.0
    done = f"({res.status}, {res.deterministic_seconds:.2f} of {budget:g} deterministic s)"
    if res.lower_bound > 0:
        search.notes.append(f"stage groups: lower bound {res.lower_bound:.6g} s with the stages in {len(res.starts)} "
                            f"groups from stages {list(res.starts)} {done}")
    else:
        search.notes.append(f"stage groups: nothing proven with the stages in {len(res.starts)} groups {done}")
    if res.wall_stopped:
        _note_wall_stop(search, "stage groups", "this bound")
    search.bound("stage groups", res.lower_bound)
    return res.deterministic_seconds


def _run_crossings(search: _Search, budget: float, deadline: float) -> float:
    """The cut-crossings bound (:mod:`partitioner.solve.crossings`) between the bound so far and the plan;
    returns the deterministic seconds it spent."""
    lower = max(search.bounds.values(), default=0.0)
    res = crossing_lower_bound(search.prob, lower=lower, upper=search.value, budget=budget,
                               wall_limit=max(0.0, deadline - time.perf_counter()))
    if not res.tries:
        return res.deterministic_seconds
    proven = [cap for cap, ok in res.tries if ok]
    what = (f"lower bound {res.lower_bound:.6g} s" if proven
            else f"nothing proven above {lower:.6g} s (not at {res.tries[0][0]:.6g} s)")
    search.notes.append(f"cut crossings: {what} ({len(res.tries)} caps in {res.deterministic_seconds:.2f} of "
                        f"{budget:.3g} deterministic s)")
    if res.wall_stopped:
        _note_wall_stop(search, "cut crossings", "this bound")
    if proven:
        search.bound("cut crossings", res.lower_bound)
    return res.deterministic_seconds


def _run_bisection(search: _Search, blocks: Blocks, budget: float, deadline: float, workers: int) -> None:
    """Raise the bound by CP-SAT feasibility checks under caps between it and the plan
    (:mod:`partitioner.solve.bisect`); a plan found under a cap is offered."""
    lower = max(search.bounds.values(), default=0.0)
    res = bisect_bound(search.prob, _block_positions(blocks), lower=lower, upper=search.value, budget=budget,
                       wall_limit=deadline - time.perf_counter(), workers=workers)
    if res.wall_stopped and not res.checks:
        _note_wall_stop(search, "bisection", "this bound", before=True)
    if not res.checks:
        return
    status = {"OPTIMAL": "feasible"}  # without an objective, OPTIMAL means a plan under the cap exists
    checks = ", ".join(f"{c.cap:.6g} s {status.get(c.status, c.status.lower())}" for c in res.checks)
    spent = sum(c.deterministic_seconds for c in res.checks)
    what = (f"lower bound {res.lower_bound:.6g} s: no valid plan at or under it" if res.lower_bound > lower
            else f"nothing proven above {lower:.6g} s")
    found = f"; a plan of {res.value:.6g} s found under a cap" if res.assign is not None else ""
    search.notes.append(f"bisection: {what} ({len(res.checks)} checks in {spent:.2f} of {budget:.3g} "
                        f"deterministic s: {checks}){found}")
    search.notes.extend(res.notes)
    if res.wall_stopped:
        _note_wall_stop(search, "bisection", "this bound")
    if res.lower_bound > lower:
        search.bound("bisection", res.lower_bound)
    search.offer(res.assign, res.value, "bisection")


def _wants_cpsat(search: _Search, method: str) -> bool:
    prob = search.prob
    if method == "cpsat":
        return True
    if method != "auto" or search.proven:
        return False
    if _cpsat_fits(prob):
        return True
    search.notes.append(f"auto: CP-SAT skipped ({prob.n} ops, ~{cpsat_size(prob)} variables; limits "
                        f"{AUTO_CPSAT_MAX_NODES} ops, {AUTO_CPSAT_MAX_VARS} variables): coarsen the graph")
    return False


def _cpsat_fits(prob: Problem) -> bool:
    """Whether ``auto`` builds CP-SAT's model of the whole problem (its size limits)."""
    return prob.n <= AUTO_CPSAT_MAX_NODES and cpsat_size(prob) <= AUTO_CPSAT_MAX_VARS


def _run_cpsat(search: _Search, blocks: Blocks, budget: float, deadline: float, workers: int) -> float:
    """CP-SAT minimising the bottleneck from the plan so far; returns the deterministic seconds it spent."""
    prob = search.prob
    groups = _block_positions(blocks)
    cp = cpsat_solve(prob, groups, hint=search.assign, lower_bound=max(search.bounds.values(), default=0.0),
                     budget=budget, wall_limit=max(0.05, deadline - time.perf_counter()), workers=workers)
    search.notes.append(f"cpsat: {cp.status} in {cp.seconds:.2f} s ({cp.deterministic_seconds:.2f} of "
                        f"{budget:g} deterministic s)")
    search.notes.extend(cp.notes)
    if cp.wall_stopped:
        _note_wall_stop(search, "cpsat", "this plan and bound")
    search.infeasible = cp.infeasible
    if cp.status in ("OPTIMAL", "FEASIBLE"):
        search.bound("cpsat", cp.lower_bound)
    search.offer(cp.assign, cp.value, "cpsat")
    return cp.deterministic_seconds


def _note_wall_stop(search: _Search, who: str, what: str, *, before: bool = False) -> None:
    """Say that the wall-clock safety limit struck ``who`` (``before``: before it started), so ``what`` may differ."""
    struck = "not run, the wall-clock safety limit had struck" if before else "stopped by the wall-clock safety limit"
    search.notes.append(f"{who}: {struck} (machine slow or busy); {what} may differ on another machine")


def _block_positions(blocks: Blocks) -> list[list[int]]:
    """Positions of every block of two or more ops: CP-SAT's colocation equalities."""
    members: dict[int, list[int]] = {}
    for i, b in enumerate(blocks.block_of):
        members.setdefault(b, []).append(i)
    return [m for m in members.values() if len(m) > 1]


def _refine(prob: Problem, blocks: Blocks, part: Partition, ranks: int | None) -> Partition:
    """Start from the candidate with the shortest simulated step (the solver's plan or a
    baseline's that fits memory), then hill-climb on simulated step time."""
    candidates = {part.method: prob.assignment(part.stage_of)}
    for name in BASELINES:
        candidates.setdefault(name, baseline_assign(prob, name, _allowed_cuts(prob, blocks)))
    steps = {}
    for name, assign in candidates.items():
        if len(set(assign)) < prob.p:
            continue  # a baseline left a stage empty: not a pipeline of p stages
        cand = partition(prob, assign)
        if cand.memory_ok:
            steps[name] = simulated_step_time(cand, ranks=ranks)
    if not steps:
        return part.with_report(notes=["step time: no candidate plan fits memory; nothing to refine"])
    start = min(steps, key=lambda name: (steps[name], name != part.method))
    frozen = {i for ops in _block_positions(blocks) for i in ops}
    refined, before, after = refine_step_time(prob, candidates[start], ranks=ranks, frozen=frozen)
    notes = [f"step time: the {part.method} plan simulates to {steps[part.method] * 1e3:.4g} ms"
             if part.method in steps else f"step time: the {part.method} plan does not fit memory"]
    if start != part.method:
        notes.append(f"step time: started from the {start} plan ({before * 1e3:.4g} ms)")
    notes.append(f"step-time refinement: {before * 1e3:.4g} ms -> {after * 1e3:.4g} ms" if after < before
                 else "step-time refinement: no single-op move shortens the simulated step")
    label = part.method + ("" if start == part.method else f"→{start}") + ("+sim" if after < before else "")
    out = partition(prob, refined, method=label)
    out.with_report(lower_bound=part.lower_bound, bound_by=part.bound_by, notes=[*part.notes, *notes])
    out.objective, out.simulated_step = "step_time", after
    out.bottleneck_plan = {"method": part.method, "bottleneck": part.bottleneck,
                           "simulated_step": steps.get(part.method), "optimal": part.optimal}
    return out


def _allowed_cuts(prob: Problem, blocks: Blocks) -> np.ndarray:
    """Where the order-based methods may cut: between colocation blocks, never just before the model's output
    node (last in the order), which would make a stage of nothing but the output."""
    allowed = blocks.allowed_cuts()
    for i, out in enumerate(prob.is_output):
        if out:
            allowed[i] = False
    return allowed


def _memory_error(prob: Problem, allowed: np.ndarray, *, proven: bool) -> MemoryLimitError:
    """Nothing fits: say the least memory any plan needs, the least at which a plan exists (over
    contiguous cuts of the order), and whether recomputation would fit when it was not allowed."""
    needed, largest = memory_lower_bound(prob)
    limits = [x for x in prob.mem_limit if x is not None]
    limit = min(limits) if limits else None
    ranks = prob.settings.ranks
    shared = ranks is not None and 0 < ranks < prob.p  # interleaved: a rank's stages share its memory
    what = (f"memory limit {format_bytes(limit)} per device" if prob.settings.memory_limit is not None
            else f"device memory ({format_bytes(limit)} on the smallest device"
                 + (f" per stage: its {prob.p // ranks} interleaved stages share each rank's" if shared else "")
                 + ")")
    recompute = "" if prob.recompute_mode == "auto" else f" with recompute={prob.recompute_mode!r}"
    least = least_memory(prob, allowed)
    works = least[1] if least is not None else None
    if least is not None:
        exact = least[1] <= least[0] * (1 + 1e-9)
        where = f"a plan{recompute} fits in {format_bytes(least[1])} per device" + (
            " (the least over contiguous cuts of the program order)" if exact
            else f" (no contiguous cut of the program order needs less than {format_bytes(least[0])})")
    else:
        where = ""
    rescue = _recompute_rescue(prob, allowed) if prob.recompute_mode in ("none", "selective") and prob.training \
        else None
    fix = ("raise the memory limit, add stages, train with a schedule that keeps fewer microbatches "
           "in flight (1f1b instead of gpipe), use fewer microbatches, or a smaller state_factor")
    if rescue is None and prob.recompute_mode in ("none", "selective") and prob.training:
        fix = "recompute='full' or 'auto' does not fit either: " + fix
    if limit is not None and limit < needed:
        msg = (f"{what} is below what any {prob.p}-stage assignment{recompute} needs: at least "
               f"{format_bytes(needed)} (the largest op alone needs {format_bytes(largest)})")
    else:
        kind = "no valid assignment" if proven else "no assignment on the program order"
        msg = (f"{what}: {kind}{recompute} fits, though the bound for any {prob.p}-stage assignment is "
               f"{format_bytes(needed)} (ops cannot be split finely enough)")
    msg += f"; {where}" if where else ""
    msg += f"; {rescue}" if rescue else ""
    return MemoryLimitError(f"{msg}; {fix}", needed=needed, works=works, recompute_fits=rescue is not None
                            if prob.recompute_mode in ("none", "selective") and prob.training else None)


def _recompute_rescue(prob: Problem, allowed: np.ndarray) -> str | None:
    """When recomputation was not (fully) allowed: what recompute='auto' makes fit, or None."""
    auto = Problem(prob.graph, prob.settings, order=prob.order, recompute="auto")
    dp = dp_solve(auto, allowed)
    if dp is None:
        return None
    choices = [t.choice for t in auto.stage_report(dp.assign)]
    return (f"with recomputation it fits: recompute='auto' gives a plan with bottleneck {dp.value * 1e3:.4g} ms "
            f"recomputing {choices}")
