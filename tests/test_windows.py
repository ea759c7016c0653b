"""The window search: valid, within memory, colocation kept, never worse, never below the optimum, counted."""

import importlib
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from partitioner import synthetic
from partitioner.cluster import Cluster
from partitioner.errors import MemoryLimitError
from partitioner.problem import Problem
from partitioner.solve import solve, windows_budget
from partitioner.solve.baselines import baseline_assign
from partitioner.solve.cpsat_model import PlacementModel
from partitioner.solve.moves import lexicographically_smaller, tabu_phases
from partitioner.solve.window_model import WindowModel
from partitioner.solve.windows import (SLOWEST, _search_window, _search_window_alone, _windows, slowest,
                                       window_search)

from _problems import colocated_problems, problems

SOLVE_MODULE = importlib.import_module("partitioner.solve")  # the package: ``partitioner.solve`` is also its function
WINDOWS_MODULE = importlib.import_module("partitioner.solve.windows")


def _start(prob: Problem, groups=()) -> list[int] | None:
    """The time-balanced cuts, when they are valid, fit memory and keep every group on one stage."""
    assign = baseline_assign(prob, "blocks", np.ones(prob.n + 1, dtype=bool))
    ok = not prob.check(assign) and prob.fits(prob.stage_costs(assign)[1])
    return assign if ok and all(len({assign[i] for i in grp}) == 1 for grp in groups) else None


def _sorted(prob: Problem, assign) -> list[float]:
    return sorted(prob.stage_costs(assign)[0], reverse=True)


@pytest.mark.parametrize("whole", [True, False], ids=["whole model", "window alone"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case=problems().filter(lambda case: case[1] >= 3))
def test_windows_keep_plans_valid_and_never_pass_the_optimum(whole, case):
    g, p, opts = case
    prob = Problem(g, p, **opts)
    assign = _start(prob)
    if assign is None:
        return
    res = window_search(prob, assign, budget=2.0, wall_limit=600, whole=whole)
    assert prob.check(res.assign) == [] and prob.fits(prob.stage_costs(res.assign)[1])
    assert res.value == pytest.approx(prob.bottleneck(res.assign), rel=1e-12)
    assert res.start_value == pytest.approx(prob.bottleneck(assign), rel=1e-12)
    new, old = _sorted(prob, res.assign), _sorted(prob, assign)
    assert new == old if res.taken == 0 else lexicographically_smaller(new, old)  # each plan taken is smaller
    assert res.tried >= 1 and 2 <= res.widest <= p - 1
    try:
        best = synthetic.brute_force(g, p, **opts)
    except MemoryLimitError:
        pytest.fail("the search started from a plan that fits, so one exists")
    assert res.value >= best.bottleneck * (1 - 1e-9)


@pytest.mark.parametrize("whole", [True, False], ids=["whole model", "window alone"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case=colocated_problems().filter(lambda case: case[1] >= 3))
def test_windows_keep_colocated_ops_together(whole, case):
    g, p, opts, names = case
    prob = Problem(g, p, **opts)
    groups = [[prob.pos[v] for v in grp] for grp in names]
    assign = _start(prob, groups)
    if assign is None:
        return
    res = window_search(prob, assign, groups, budget=1.0, wall_limit=600, whole=whole)
    assert res.tried >= 1
    assert prob.check(res.assign) == [] and prob.fits(prob.stage_costs(res.assign)[1])
    assert all(len({res.assign[i] for i in grp}) == 1 for grp in groups)
    assert res.value <= res.start_value


def _window_top(prob: Problem, assign: list[int], window: range) -> float:
    return max(prob.stage_costs(assign)[0][s] for s in window)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(problems().filter(lambda case: case[1] >= 3 and case[2]["memory_limit"] is None),
       st.sampled_from(["none", "selective", "full"]))
def test_the_window_alone_finds_the_whole_models_optimum(case, recompute):
    """Without memory limits (so one recomputation choice per stage), the model of the window alone prices
    every re-placement as the whole model does: CP-SAT's best on each window is the same stage time (to the
    integers' rounding, 1e-6 of the bottleneck)."""
    g, p, opts = case
    prob = Problem(g, p, **opts, recompute=recompute if opts["training"] else "none")
    assign = _start(prob)
    assert all(len(options) == 1 for options in prob.choices)
    if assign is None:
        return
    bottleneck = prob.bottleneck(assign)
    model = PlacementModel(prob, [])
    model.objective(bottleneck, bottleneck, 0.0)
    loads = model.stage_loads()
    for k in range(2, p):
        for lo in range(p - k + 1):
            window = range(lo, lo + k)
            budget = dict(budget=10.0, wall_left=600.0, workers=1, seed=0)
            _, whole, whole_done = _search_window(prob, model, loads, assign, window, bottleneck, **budget)
            _, alone, alone_done = _search_window_alone(prob, assign, window, [], bottleneck, **budget)
            assert whole_done and alone_done and whole is not None and alone is not None  # the plan is one
            assert all(alone[v] == assign[v] for v in range(prob.n) if assign[v] not in window)
            assert _window_top(prob, alone, window) == pytest.approx(_window_top(prob, whole, window),
                                                                     rel=1e-6, abs=1e-6 * bottleneck)
            assert max(prob.stage_costs(alone)[0]) <= bottleneck * (1 + 1e-6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(problems().filter(lambda case: case[1] >= 3 and case[2]["memory_limit"] is None), st.randoms(),
       st.sampled_from(["none", "selective", "full"]))
def test_the_window_alone_prices_each_re_placement_as_the_cost_model(case, rng, recompute):
    """Random re-placements of a window's ops, fixed in the window's model: each modelled stage's load (the
    constant part included) is the cost model's stage time under the plan's recomputation choices, and every
    stage left out of the model keeps its time."""
    g, p, opts = case
    prob = Problem(g, p, **opts, recompute=recompute if opts["training"] else "none")
    assign = _start(prob)
    if assign is None:
        return
    choices = [t.choice for t in prob.stage_report(assign)]
    before = prob.stage_costs(assign, choices)[0]
    for k in range(2, p):
        for lo in range(p - k + 1):
            window = range(lo, lo + k)
            for draw in range(4):  # the plan itself, then random re-placements (the valid ones)
                new = [rng.choice(window) if s in window and draw else s for s in assign]
                if prob.check(new):
                    continue
                times = prob.stage_costs(new, choices)[0]
                ref = 4 * max(*times, *before)  # the model's cap well above every stage: nothing is cut off
                model = WindowModel(prob, assign, window, [], ref)
                for i, v in enumerate(model.ops):
                    for j, s in enumerate(window):
                        model.m.add(model.x[i][j] == int(new[v] == s))
                model.m.minimize(cp_model.LinearExpr.sum(model.aux))  # r and y at what the placement forces
                solver = cp_model.CpSolver()
                assert solver.Solve(model.m) == cp_model.OPTIMAL
                for s in range(p):
                    if s not in model.loads:
                        assert times[s] == pytest.approx(before[s], rel=1e-12, abs=1e-15)
                        continue
                    units = sum(c * solver.Value(lit) for c, lit in model.loads[s]) + model.base.get(s, 0)
                    assert units / model.scale == pytest.approx(times[s], rel=0, abs=1e-6 * ref)


@pytest.mark.slow
def test_windows_go_where_single_moves_stop():
    """From the tabu search's best plan (where no single move helps), re-placing a few stages' ops at once finds
    a better plan, counted in deterministic seconds: the same plan twice."""
    g = synthetic.generate("layered", 60, seed=0)
    prob = Problem(g, 6, cluster=Cluster.load("h100-sxm", devices=6), microbatches=24)
    moved = tabu_phases(prob, _start(prob))
    runs = [window_search(prob, moved.assign, budget=1.5, wall_limit=600) for _ in range(2)]
    assert runs[0].assign == runs[1].assign and runs[0].tried == runs[1].tried
    assert runs[0].value < moved.value * (1 - 1e-3) and runs[0].taken >= 1
    assert runs[0].deterministic_seconds <= 1.5 * 1.05  # one window may overrun its budget a little


def test_windows_hold_one_of_the_slowest_stages():
    times = [1, 5, 2, 9, 3, 4, 8, 7]  # slowest: stages 3, 6, 7
    for k in range(2, 8):
        starts = _windows(times, 8, k)
        assert len(set(starts)) == len(starts)
        for lo in range(0, 8 - k + 1):
            holds = any(lo <= s < lo + k for s in (3, 6, 7)[:SLOWEST])
            assert (lo in starts) == holds
    assert _windows(times, 8, 2)[:2] == [2, 3]  # the slowest stage's windows first
    assert slowest(8) == slowest(16) == SLOWEST == 3 and slowest(64) == 10  # a sixth of the stages where more
    many = list(range(64))  # stage s takes s: the ten slowest are 54-63
    assert sorted(_windows(many, 64, 2)) == list(range(53, 63))


def test_windows_stop_at_the_wall_clock_and_try_nothing_under_three_stages():
    g = synthetic.generate("layered", 40, seed=0)
    prob = Problem(g, 4, cluster=Cluster.load("h100-sxm", devices=4), microbatches=16)
    start = _start(prob)
    t = time.perf_counter()
    stopped = window_search(prob, start, budget=5.0, wall_limit=0.0)
    assert stopped.wall_stopped and stopped.assign == start and stopped.tried == 0
    assert time.perf_counter() - t < 30
    two = Problem(g, 2, cluster=Cluster.load("h100-sxm", devices=2), microbatches=8)
    assert window_search(two, _start(two), budget=5.0, wall_limit=60).tried == 0


@pytest.mark.slow
def test_auto_runs_the_windows_after_cpsat_and_says_so():
    g = synthetic.generate("layered", 100, seed=0)
    part = solve(g, 8, cluster=Cluster.load("h100-sxm", devices=8), microbatches=32, time_limit=4)
    notes = [n.split(":")[0] for n in part.notes]
    assert "windows" in notes and notes.index("cpsat") < notes.index("windows") < notes.index("stage groups")


@pytest.mark.slow
def test_auto_runs_the_windows_alone_where_the_whole_model_is_too_large(monkeypatch):
    """Past auto's CP-SAT limits (here lowered to nothing) the windows run on models of each window alone, say so,
    and hand on a plan at least as good; with the whole model gone no bisection follows."""
    monkeypatch.setattr(SOLVE_MODULE, "AUTO_CPSAT_MAX_VARS", 0)
    g = synthetic.generate("layered", 100, seed=0)
    part = solve(g, 8, cluster=Cluster.load("h100-sxm", devices=8), microbatches=32, time_limit=4)
    names = [n.split(":")[0] for n in part.notes]
    assert "cpsat" not in names and "bisection" not in names
    windows = next(n for n in part.notes if n.startswith("windows: CP-SAT re-placing"))
    assert "a model of each window alone" in windows
    before, after = (float(x.split()[0]) for x in windows.split(", ")[1].split(" -> "))
    assert part.bottleneck == pytest.approx(after, rel=1e-5) and after < before


def _slowest_stage_ends() -> tuple[Problem, list[int], list[int]]:
    """A 60-op layered DAG at 6 stages, its time-balanced start, and the first and last op of its slowest stage."""
    g = synthetic.generate("layered", 60, seed=0)
    prob = Problem(g, 6, cluster=Cluster.load("h100-sxm", devices=6), microbatches=24)
    start = _start(prob)
    bottleneck = int(np.argmax(prob.stage_costs(start)[0]))
    ops = [i for i, s in enumerate(start) if s == bottleneck]
    return prob, start, [ops[0], ops[-1]]


@pytest.mark.parametrize("whole", [True, False], ids=["whole model", "window alone"])
def test_windows_keep_a_colocated_pair_the_search_would_split(whole):
    """Two ops of the start's slowest stage, one at each end, colocated: the windows move the stage's ops (the
    search without the pair splits it) and keep the pair on one stage."""
    prob, start, pair = _slowest_stage_ends()
    free = window_search(prob, start, budget=1.0, wall_limit=60, whole=whole)
    assert free.assign[pair[0]] != free.assign[pair[1]]
    kept = window_search(prob, start, [pair], budget=1.0, wall_limit=60, whole=whole)
    assert kept.assign[pair[0]] == kept.assign[pair[1]] and kept.taken >= 1
    assert prob.check(kept.assign) == [] and kept.value < kept.start_value


def test_a_re_placement_that_splits_a_group_is_not_taken(monkeypatch):
    """The model of the window alone made to forget the groups proposes the split pair; the search prices every
    proposal again and keeps the pair together."""
    prob, start, pair = _slowest_stage_ends()
    monkeypatch.setattr(WINDOWS_MODULE, "WindowModel",
                        lambda prob_, plan, window, groups, bottleneck_: WindowModel(prob_, plan, window, [], bottleneck_))
    res = window_search(prob, start, [pair], budget=1.0, wall_limit=60, whole=False)
    assert res.assign[pair[0]] == res.assign[pair[1]] and prob.check(res.assign) == []


def test_the_window_alone_stops_at_its_widest_window_and_on_a_free_plan(monkeypatch):
    g = synthetic.generate("layered", 60, seed=0)
    prob = Problem(g, 6, cluster=Cluster.load("h100-sxm", devices=6), microbatches=24)
    monkeypatch.setattr(WINDOWS_MODULE, "ALONE_WIDEST", 2)
    res = window_search(prob, _start(prob), budget=50.0, wall_limit=600, whole=False)
    assert res.widest == 2 and res.deterministic_seconds < 50  # whole windows of 2 tried, then it stops
    free = Problem(synthetic.generate("chain", 6, seed=0), 3, microbatches=4)
    free.work[:] = 0  # nothing costs anything: the bottleneck is 0 and there is nothing to relieve
    assert window_search(free, [0, 0, 1, 1, 2, 2], budget=1.0, wall_limit=60, whole=False).tried == 0


def test_the_windows_leave_the_bisection_at_least_as_much_as_they_take():
    """At time_limit 30 the windows get their share; at the default 4 (CP-SAT's optimisation took all 4) half of
    what the stage groups leave, never a negative budget."""
    assert windows_budget(30, 60 - 7.5) == 15
    assert windows_budget(4, 8 - 4) == 1 and 8 - 4 - 1 - 2 >= 1
    assert windows_budget(1, 2 - 1) == 0.25 and windows_budget(4, 1) == 0
