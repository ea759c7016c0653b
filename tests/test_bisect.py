"""The bisection bound: never above the optimum, its plans valid, and higher than the optimisation's where that stalls."""

import dataclasses
import importlib
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings

from partitioner import synthetic
from partitioner.bounds import named_bounds
from partitioner.cluster import Cluster
from partitioner.errors import ColocationError, MemoryLimitError
from partitioner.problem import Problem, graph_order
from partitioner.solve import solve
from partitioner.solve.bisect import FIRST_DROP, FIRST_STEP, TARGET_GAP, bisect_bound
from partitioner.solve.colocate import colocation_blocks
from partitioner.solve.cpsat_model import PlacementModel, proof_solver

from _problems import colocated_problems, problems

SOLVE_MODULE = importlib.import_module("partitioner.solve")  # the package, not its solve() function


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case=colocated_problems())
def test_the_bisection_brackets_the_optimum_with_colocation_and_fractional_memory(case):
    """From the closed-form bound and the worse of dp's and the uniform cuts' plans, every check finishes on
    graphs this small: the bound ends at or below the brute-force optimum, the plan at or above it, and the
    two within a part per million."""
    g, p, opts, groups = case
    try:
        best = synthetic.brute_force(g, p, colocate=groups, **opts)
        starts = [solve(g, p, colocate=groups, method=m, **opts) for m in ("dp", "uniform")]
    except (MemoryLimitError, ColocationError):
        return  # nothing valid to bracket
    nx_graph, order = graph_order(g)
    blocks = colocation_blocks(nx_graph, order, groups)
    prob = Problem(g, p, order=blocks.order, recompute="auto", **opts)  # as solve() and brute_force() build it
    plans = [prob.assignment(s.stage_of) for s in starts if s.memory_ok]
    upper = max(prob.bottleneck(a) for a in plans if not prob.check(a))  # a baseline may leave a stage empty
    lower = max(named_bounds(prob).values())
    if not 0 < lower < upper:
        return  # proven already, or nothing to start from
    positions = SOLVE_MODULE._block_positions(blocks)
    # to a part per billion, not BISECT_RTOL: a cap wrong by more than that shows
    res = bisect_bound(prob, positions, lower=lower, upper=upper, budget=20, wall_limit=120, rtol=1e-9)
    assert all(c.status in ("INFEASIBLE", "FEASIBLE", "OPTIMAL") for c in res.checks), res.checks
    assert lower <= res.lower_bound <= best.bottleneck * (1 + 1e-9)
    assert res.value >= best.bottleneck * (1 - 1e-9)
    if res.assign is not None:
        assert not prob.check(res.assign) and prob.fits(prob.stage_costs(res.assign)[1])
        assert res.value == pytest.approx(prob.bottleneck(res.assign), rel=1e-12) and res.value < upper
        assert all(res.assign[i] == res.assign[grp[0]] for grp in positions for i in grp)
    # a plan found under a cap may exceed it by the integer rounding (under 1e-6 of it)
    assert res.value - res.lower_bound <= 1e-6 * res.value
    # A cap at the optimum itself is never refuted (a cap cut by a part per million would be): from 1e-7
    # below it to 3e-7 above, the first cap, a quarter of the way up, is the optimum.
    at = bisect_bound(prob, positions, lower=best.bottleneck * (1 - 1e-7), upper=best.bottleneck * (1 + 3e-7),
                      budget=20, wall_limit=120, rtol=1e-9)
    assert at.checks[0].cap == pytest.approx(best.bottleneck, rel=1e-12)
    assert at.checks[0].status in ("FEASIBLE", "OPTIMAL") and at.lower_bound < best.bottleneck


def test_the_bisection_raises_the_bound_where_the_optimisation_stalls(monkeypatch):
    """A 40-op layered DAG at 4 stages with 1 deterministic second: CP-SAT's optimisation and the stage groups
    leave the plan unproven (0.603 ms proven for a 0.748 ms plan); a cap between them is proven infeasible."""
    g = synthetic.generate("layered", 40, seed=0)
    args = dict(cluster=Cluster.load("h100-sxm", devices=4), microbatches=16, method="auto", time_limit=1)
    with monkeypatch.context() as patched:
        patched.setattr(SOLVE_MODULE, "_run_bisection", lambda *a, **k: None)
        without = solve(g, 4, **args)
    part = solve(g, 4, **args)
    assert not without.optimal and without.bound_by != "bisection"
    assert part.bound_by == "bisection"
    assert part.lower_bound > 1.1 * without.lower_bound
    assert part.lower_bound <= part.bottleneck <= without.bottleneck
    note = next(n for n in part.notes if n.startswith("bisection: lower bound"))
    assert f"{part.lower_bound:.6g} s infeasible" in note


@pytest.mark.slow
@pytest.mark.parametrize("min_budget", [None, 0.0], ids=["cpsat-keeps-all-of-a-short-limit", "cpsat-gets-its-share"])
def test_auto_spends_at_most_twice_time_limit_and_the_bisection_gets_what_is_left(monkeypatch, min_budget):
    """CP-SAT's optimisation gets cpsat_budget(time_limit), the windows windows_budget(time_limit, what is left), the
    stage groups GROUP_BUDGET_SHARE of it, the cut crossings at most CROSSINGS_BUDGET_SHARE of it, and the
    bisection the rest of AUTO_BUDGET_FACTOR x time_limit after what the other four spent; method="cpsat" gets
    all."""
    if min_budget is not None:  # at this test's short limit the floor would give CP-SAT all of it
        monkeypatch.setattr(SOLVE_MODULE, "CPSAT_MIN_BUDGET", min_budget)
    given: dict[str, float] = {}
    used: dict[str, float] = {}

    def spy(name, fn, spent, report=lambda res: res):
        def wrapped(*args, **kwargs):
            res = report(fn(*args, **kwargs))
            given[name], used[name] = kwargs["budget"], spent(res)
            return res
        return wrapped

    # CP-SAT, the windows, the groups and the crossings report a third of what they spent: the budgets after
    # them must follow what they report spending, not what they were given.
    def third(res):
        return dataclasses.replace(res, deterministic_seconds=res.deterministic_seconds / 3)

    for name, attr in (("groups", "group_lower_bound"), ("cpsat", "cpsat_solve"), ("windows", "window_search"),
                       ("crossings", "crossing_lower_bound")):
        monkeypatch.setattr(SOLVE_MODULE, attr, spy(name, getattr(SOLVE_MODULE, attr),
                                                     lambda r: r.deterministic_seconds, third))
    monkeypatch.setattr(SOLVE_MODULE, "bisect_bound", spy("bisection", SOLVE_MODULE.bisect_bound,
                                                          lambda r: sum(c.deterministic_seconds for c in r.checks)))
    time_limit = 1.0
    g = synthetic.generate("layered", 40, seed=0)
    args = dict(cluster=Cluster.load("h100-sxm", devices=4), microbatches=16, time_limit=time_limit)
    part = solve(g, 4, method="auto", **args)
    assert not part.optimal and set(given) == {"cpsat", "windows", "groups", "crossings", "bisection"}
    share = SOLVE_MODULE.CPSAT_BUDGET_SHARE if min_budget is not None else 1.0
    assert given["cpsat"] == share * time_limit
    left = SOLVE_MODULE.AUTO_BUDGET_FACTOR * time_limit - used["cpsat"]
    assert given["windows"] == pytest.approx(SOLVE_MODULE.windows_budget(time_limit, left)) and given["windows"] > 0
    assert given["groups"] == SOLVE_MODULE.GROUP_BUDGET_SHARE * time_limit
    assert 0 < used["groups"] < given["groups"] and 0 < used["cpsat"] < given["cpsat"]
    assert 0 < used["windows"] < given["windows"]
    left -= used["windows"] + used["groups"]
    assert given["crossings"] == pytest.approx(min(left, SOLVE_MODULE.CROSSINGS_BUDGET_SHARE * time_limit))
    assert 0 < used["crossings"] <= given["crossings"]
    assert given["bisection"] == pytest.approx(left - used["crossings"])
    assert sum(used.values()) <= SOLVE_MODULE.AUTO_BUDGET_FACTOR * time_limit * 1.01
    given.clear()
    solve(g, 4, method="cpsat", **args)
    assert given == {"cpsat": time_limit}


def test_cpsat_keeps_all_of_a_short_time_limit_at_least_its_floor_and_a_quarter_of_a_long_one():
    floor, share = SOLVE_MODULE.CPSAT_MIN_BUDGET, SOLVE_MODULE.CPSAT_BUDGET_SHARE
    assert floor == 6.0 and share == 0.25  # the figures below; docs/optimizer.md, "Bisection"
    assert [SOLVE_MODULE.cpsat_budget(t) for t in (1.0, 4.0, 6.0, 8.0, 24.0, 30.0, 40.0)] == [
        1.0, 4.0, 6.0, 6.0, 6.0, 7.5, 10.0]


def test_the_bisection_runs_no_check_without_a_gap_a_bound_or_time():
    g = synthetic.generate("layered", 12, seed=0)
    prob = Problem(g, 3)
    assert bisect_bound(prob, lower=1.0, upper=1.0, budget=5, wall_limit=30).checks == []  # proven already
    assert bisect_bound(prob, lower=1.0, upper=1.0005, budget=5, wall_limit=30).checks == []  # within BISECT_RTOL
    assert bisect_bound(prob, lower=0.0, upper=1.0, budget=5, wall_limit=30).checks == []  # no bound to start from
    late = bisect_bound(prob, lower=0.5, upper=1.0, budget=5, wall_limit=0.0)
    assert late.checks == [] and late.wall_stopped and late.lower_bound == 0.5


def test_the_bisection_first_descends_from_a_plan_near_the_optimum_and_proves_it_within_the_target():
    """From a plan 3% above the brute-force optimum: the first cap, FIRST_DROP under it, finds a plan, and
    the next, TARGET_GAP under that plan, lies below the optimum and is proven: two checks bring the plan
    within TARGET_GAP of a proven bound, and the climb then starts FIRST_STEP of the way from that proof to
    the plan. Without the descent the first cap is a quarter of the way up from the bound."""
    g = synthetic.generate("layered", 12, seed=0)
    p = 3
    best = synthetic.brute_force(g, p).bottleneck
    prob = Problem(g, p, recompute="auto")  # as brute_force() builds it
    lower, upper = 0.5 * best, 1.03 * best
    two = bisect_bound(prob, lower=lower, upper=upper, budget=20, wall_limit=120, rtol=TARGET_GAP)
    first, second = two.checks
    assert first.cap == pytest.approx(upper / (1 + FIRST_DROP), rel=1e-12)
    assert first.status in ("FEASIBLE", "OPTIMAL") and second.status == "INFEASIBLE"
    # the second cap is TARGET_GAP under the plan the first found, which is no better than the optimum
    assert second.cap * (1 + TARGET_GAP) == pytest.approx(two.value, rel=1e-12)
    assert best <= two.value <= first.cap * (1 + 1e-9)
    assert two.lower_bound == second.cap and two.value <= two.lower_bound * (1 + TARGET_GAP) * (1 + 1e-12)
    res = bisect_bound(prob, lower=lower, upper=upper, budget=20, wall_limit=120)
    assert [(c.cap, c.status) for c in res.checks[:2]] == [(c.cap, c.status) for c in two.checks]
    assert res.checks[2].cap == pytest.approx(second.cap + FIRST_STEP * (two.value - second.cap), rel=1e-12)
    assert best / (1 + TARGET_GAP) <= res.lower_bound <= best <= res.value <= two.value
    climb = bisect_bound(prob, lower=lower, upper=upper, budget=20, wall_limit=120, descend=False)
    assert climb.checks[0].cap == pytest.approx(lower + FIRST_STEP * (upper - lower), rel=1e-12)
    assert climb.checks[0].status == "INFEASIBLE"


def test_after_a_proof_under_the_first_drop_the_bisection_tries_the_target_gap_before_climbing():
    """From a plan under FIRST_DROP above the optimum the first cap is proven; the next is TARGET_GAP under the
    plan, not a step up from the proof: 1.5% above, that cap is above the optimum and finds a better plan; 0.5%
    above, it is proven, and the plan is within TARGET_GAP of the bound after two checks."""
    g = synthetic.generate("layered", 12, seed=0)
    p = 3
    best = synthetic.brute_force(g, p).bottleneck
    prob = Problem(g, p, recompute="auto")  # as brute_force() builds it
    for above, second_status in ((1.015, ("FEASIBLE", "OPTIMAL")), (1.005, ("INFEASIBLE",))):
        upper = above * best
        res = bisect_bound(prob, lower=0.5 * best, upper=upper, budget=20, wall_limit=120)
        first, second = res.checks[:2]
        assert first.cap == pytest.approx(upper / (1 + FIRST_DROP), rel=1e-12) and first.status == "INFEASIBLE"
        assert second.cap == pytest.approx(upper / (1 + TARGET_GAP), rel=1e-12) and second.status in second_status
        assert best / (1 + TARGET_GAP) <= res.lower_bound <= best <= res.value <= upper
        if second.status == "INFEASIBLE":
            assert res.lower_bound >= second.cap and res.value <= res.lower_bound * (1 + TARGET_GAP) * (1 + 1e-9)
        else:
            assert res.value < second.cap * (1 + 1e-9)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case=problems())
def test_the_cut_sums_hold_every_valid_plan(case):
    """The bisection's model with the redundant sums over each cut holds every valid plan that fits memory,
    fixed stage by stage, under a cap at its own bottleneck: the sums only prune what no plan reaches (a
    term priced above what the stages pay, a speed or a link too slow, refutes a balanced plan here)."""
    g, p, opts = case
    prob = Problem(g, p, recompute="auto", **opts)
    if p ** prob.n > 60_000:
        return  # too many assignments to enumerate here
    plans = [list(a) for a in itertools.product(range(p), repeat=prob.n) if not prob.check(list(a))]
    plans = [a for a in plans if prob.fits(prob.stage_costs(a)[1])]
    if not plans:
        return
    upper = max(prob.bottleneck(a) for a in plans)
    model = PlacementModel(prob, ())
    model.objective(upper, upper, 0.0)
    model.m.clear_objective()
    model.cut_sums()
    bneck = model.m.proto.variables[model.bneck.index]
    plans.sort(key=prob.bottleneck)  # the most balanced first: their sums come nearest s x B
    for a in plans[:20] + plans[20:: max(1, len(plans) // 20)]:
        bneck.domain[1] = max(bneck.domain[0], math.floor(prob.bottleneck(a) * model.scale) + 1)
        model.m.clear_assumptions()
        model.m.add_assumptions([model.x[v][s] for v, s in enumerate(a)])
        solver = proof_solver(budget=5, wall_left=60, workers=1, seed=0)
        solver.parameters.linearization_level = 0
        assert solver.StatusName(solver.Solve(model.m)) in ("FEASIBLE", "OPTIMAL"), (a, prob.bottleneck(a))
