"""Relaxations past the cut crossings, on the random layered DAG: how far each can go.

- *chained*: each stage pays its work and the ends counted at both of its cuts
  (:meth:`CutCrossings.ends_by_side`): with ``D_s`` the ideal before cut s, every plan under the cap has
  ``w(D_{s+1}) + sends_{s+1}(D_{s+1}) <= b_s = cap + w(D_s) - receives_s(D_s)`` (``b_0`` = cap) and ``W <=
  b_{p-1}``. Without requiring the ideals nested this separates: cut by cut, the most ``b_s`` can be is the cap
  plus the most ``w(D) - receives_s(D)`` over the ideals D in the cut's window whose work and sends fit the most
  ``b_{s-1}`` (CP-SAT, its bound from above; the window's end or the room where it finds none), and a plan under
  the cap needs the last to reach W: prints that margin (negative: the cap is proven) and how many ops of each
  ideal found lie outside the next one (each counts as work its stage sheds: where the relaxation stops).
- *nested*: the same stage constraints over p - 1 nested ideals in one CP-SAT model (feasible, infeasible or
  unknown under the cap within ``--budget``).
- *one stage*: the most work one stage can hold under a cap while paying every end of its own ops (receives
  priced on the cheapest link into it from an earlier stage, sends on the cheapest to a later one), convex as a
  plan's stage but placed anywhere (the first stage has nothing before it, the last nothing after), per kind of
  stage (the links into and out of it); the most of each kind times the stages of that kind: where that reaches
  the work, no bound that weighs each such stage alone proves the cap (the stages' sets may overlap).

Run: ``.venv/bin/python benchmarks/layered_relaxations.py [--graph layered:1000] [--stages 8] [--caps 7.88 7.9
7.91 7.95] [--budget 20] [--cut-budget 2] [--stage-stages 64] [--stage-caps 1.15] [--stage-budget 5]``. The
graph as the planner benchmark builds it (a synthetic ``kind:ops``, seed 0, or a zoo spec), on h100-sxm nodes;
caps in ms; the budgets are deterministic seconds. Integers are nanoseconds, work rounded down and prices down
(a relaxation).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ortools.sat.python import cp_model  # noqa: E402

from benchmarks._graphs import graph_for  # noqa: E402
from partitioner.cluster import Cluster  # noqa: E402
from partitioner.problem import Problem  # noqa: E402
from partitioner.solve.cpsat_model import (NS_PER_SECOND as _SCALE, least_end_price as _price,  # noqa: E402
                                           proof_solver, weighted as _weighted)
from partitioner.solve.crossings import _FLOAT, CutCrossings  # noqa: E402


def problem(spec: str, p: int) -> Problem:
    prob = Problem(graph_for(spec), p, cluster=Cluster.load("h100-sxm", devices=p), microbatches=4 * p)
    if any(float(speed) != 1.0 for speed in prob.speed):
        sys.exit("layered_relaxations.py: the stage constraints here assume devices of speed 1 (h100-sxm)")
    return prob


def _solve(m: cp_model.CpModel, budget: float) -> tuple[int, cp_model.CpSolver]:
    solver = proof_solver(budget=budget, wall_left=600, workers=1, seed=0)
    solver.parameters.cp_model_probing_level = 0  # as the crossings' model runs (crossings.py)
    return solver.Solve(m), solver


def chained(test: CutCrossings, cap: float, cut_budget: float) -> tuple[float, float, list[int]]:
    """The margin ``b_{p-1} - W`` in ms (negative: proven), the deterministic seconds, and per cut but the last how
    many ops of the ideal found there lie outside the one found at the next (the cuts weighed in order)."""
    p, model = test.prob.p, test.model
    assert model is not None
    room, spent, found = cap * _SCALE * (1 + _FLOAT), 0.0, []
    for s in range(1, p):
        receives, sends = test.ends_by_side(s, cap)
        lo, hi = test.window(s, cap)
        m = model.m.clone()  # the room's constraint is this cut's alone
        weight = m.get_int_var_from_proto_index(model.weight.index)
        held = m.get_int_var_from_proto_index(model.held.index)
        cross = [m.get_bool_var_from_proto_index(lit.index) for lit in model.cross]
        for var, (low, high) in ((weight, (lo, hi)), (held, (s, test.real - (p - s)))):  # (set afresh: the
            dom = m.proto.variables[var.index].domain  # crossings' least() leaves the last cut's in the model)
            dom[0], dom[1] = low, high
        m.add(_weighted([(1, weight), *zip(sends, cross)]) <= math.floor(room))
        m.maximize(_weighted([(1, weight), *((-r, lit) for r, lit in zip(receives, cross))]))
        status, solver = _solve(m, cut_budget)
        spent += solver.response_proto.deterministic_time
        if status == cp_model.INFEASIBLE:
            return -math.inf, spent, []
        most = min(hi, math.floor(room))  # the work, at most the window's end and the room; receives cost >= 0
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            most = min(most, math.ceil(solver.BestObjectiveBound()))
            found.append({v for v, lit in enumerate(model.x) if solver.Value(lit)})
        room = cap * _SCALE * (1 + _FLOAT) + most
    whole = sum(math.floor(float(w) * _SCALE) for w in test.prob.least_work)  # the ideals' work as summed
    return (room - whole) / 1e6, spent, [len(a - b) for a, b in zip(found, found[1:])]


def nested(test: CutCrossings, cap: float, budget: float) -> tuple[str, float]:
    """CP-SAT's answer on the nested chain under ``cap`` and its deterministic seconds."""
    prob, p = test.prob, test.prob.p
    m = cp_model.CpModel()
    work = [math.floor(float(w) * _SCALE) for w in prob.least_work]
    ideals = [[m.new_bool_var(f"d{s}_{v}") for v in range(prob.n)] for s in range(1, p)]
    for s, x in enumerate(ideals):
        for u in range(prob.n):
            for c in prob.succ[u]:
                m.add_implication(x[c], x[u])
            if s + 1 < len(ideals):
                m.add_implication(x[u], ideals[s + 1][u])
    receives, sends, weights = {}, {}, {}
    for s in range(1, p):
        x, (rec, snd) = ideals[s - 1], test.ends_by_side(s, cap)
        cross = []
        for u in test.senders:
            lit = m.new_bool_var("")
            for c in prob.succ[u]:
                m.add_bool_or([x[u].Not(), x[c], lit])
            cross.append(lit)
        receives[s], sends[s] = list(zip(rec, cross)), list(zip(snd, cross))
        weights[s] = list(zip(work, x))
    limit = math.floor(cap * _SCALE * (1 + _FLOAT))
    for t in range(p):  # stage t lies between cut t and cut t + 1
        terms = [*weights.get(t + 1, []), *sends.get(t + 1, []), *((-w, x) for w, x in weights.get(t, [])),
                 *receives.get(t, [])]
        m.add(_weighted(terms) + (sum(work) if t == p - 1 else 0) <= limit)
    status, solver = _solve(m, budget)
    return solver.StatusName(status), solver.response_proto.deterministic_time


def one_stage(prob: Problem, s: int, cap: float, budget: float) -> tuple[float, float, float]:
    """The most work (ms) stage s holds under ``cap`` paying its own ends, convex as a plan's stage (the ops before
    it an ideal, and with it too; the first stage has none before it, the last none after), placed anywhere: found,
    CP-SAT's bound, and the deterministic seconds."""
    p, m = prob.p, cp_model.CpModel()
    x = [m.new_bool_var(f"x{v}") for v in range(prob.n)]  # the stage
    before = [m.new_bool_var(f"b{v}") for v in range(prob.n)]  # the ops of the stages before it
    work = [math.floor(float(w) * _SCALE) for w in prob.least_work]
    paid = []
    for u in range(prob.n):
        m.add_bool_or([x[u].Not(), before[u].Not()])
        for c in prob.succ[u]:
            m.add_implication(before[c], before[u])  # an ideal ...
            m.add_bool_or([x[c].Not(), x[u], before[u]])  # ... and so is it with the stage
        if not prob.succ[u] or prob.out_bytes[u] <= 0:
            continue
        if s > 0:  # u made earlier, read here: a receive
            lit = m.new_bool_var("")
            for c in prob.succ[u]:
                m.add_bool_or([before[u].Not(), x[c].Not(), lit])
            paid.append((_price(prob, u, slice(0, s), slice(s, s + 1)), lit))
        if s < p - 1:  # u made here, read later: a send
            lit = m.new_bool_var("")
            for c in prob.succ[u]:
                m.add_bool_or([x[u].Not(), x[c], before[c], lit])
            paid.append((_price(prob, u, slice(s, s + 1), slice(s + 1, p)), lit))
    held = list(zip(work, x))
    if s == 0:
        m.add(_weighted(list(zip(work, before))) == 0)  # nothing before the first stage ...
    if s == p - 1:
        m.add(_weighted([*zip(work, before), *held]) == sum(work))  # ... and nothing after the last
    m.add(_weighted([*held, *paid]) <= math.floor(cap * _SCALE * (1 + _FLOAT)))
    m.add_bool_or(x)
    m.maximize(_weighted(held))
    status, solver = _solve(m, budget)
    found = solver.ObjectiveValue() / 1e6 if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else 0.0
    return found, solver.BestObjectiveBound() / 1e6, solver.response_proto.deterministic_time


def stage_kinds(prob: Problem) -> dict[tuple, list[int]]:
    """Stages grouped by what their ends cost (first, last, and where the links in and out are slower)."""
    kinds: dict[tuple, list[int]] = {}
    p = prob.p
    for s in range(p):
        into, out = (slice(0, s), slice(s, s + 1)), (slice(s, s + 1), slice(s + 1, p))
        key = (s == 0, s == p - 1, *((float(prob.bw[a, b].max()), float(prob.lat[a, b].min()))
                                     if a.stop > a.start and b.stop > b.start else () for a, b in (into, out)))
        kinds.setdefault(key, []).append(s)
    return kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--graph", default="layered:1000", help="a synthetic kind:ops or a zoo spec")
    ap.add_argument("--stages", type=int, default=8, help="stages of the chained and nested relaxations")
    ap.add_argument("--caps", type=float, nargs="*", default=[7.88, 7.9, 7.91, 7.95], help="caps in ms")
    ap.add_argument("--budget", type=float, default=20.0, help="deterministic seconds for each nested check")
    ap.add_argument("--cut-budget", type=float, default=2.0, help="deterministic seconds per cut, chained")
    ap.add_argument("--stage-stages", type=int, default=64, help="stages of the one-stage relaxation")
    ap.add_argument("--stage-caps", type=float, nargs="*", default=[1.15], help="caps in ms, one stage")
    ap.add_argument("--stage-budget", type=float, default=5.0, help="deterministic seconds per stage kind")
    args = ap.parse_args()
    if args.caps:
        test = CutCrossings(problem(args.graph, args.stages))
        print(f"{args.graph} at {args.stages} stages: work / stages {test.total / args.stages * 1e3:.4f} ms",
              flush=True)
        for cap_ms in args.caps:
            t = time.perf_counter()
            margin, det, loose = chained(test, cap_ms * 1e-3, args.cut_budget)
            print(f"  chained, cap {cap_ms:.4f} ms: {'proven' if margin < 0 else 'not proven'}, margin {margin:+.4f} "
                  f"ms ({det:.2f} deterministic s, {time.perf_counter() - t:.1f} wall s); ops of each ideal found "
                  f"outside the next: {loose}", flush=True)
        for cap_ms in args.caps:
            t = time.perf_counter()
            status, det = nested(test, cap_ms * 1e-3, args.budget)
            print(f"  nested, cap {cap_ms:.4f} ms: {status} ({det:.2f} deterministic s, "
                  f"{time.perf_counter() - t:.1f} wall s)", flush=True)
    if args.stage_caps:
        prob = problem(args.graph, args.stage_stages)
        total = float(prob.least_work.sum()) * 1e3
        print(f"{args.graph} at {args.stage_stages} stages: work {total:.4f} ms, per stage "
              f"{total / prob.p:.4f}", flush=True)
        kinds = stage_kinds(prob)
        for cap_ms in args.stage_caps:
            held = bounded = 0.0
            for stages in kinds.values():
                found, bound, det = one_stage(prob, stages[0], cap_ms * 1e-3, args.stage_budget)
                held, bounded = held + found * len(stages), bounded + bound * len(stages)
                print(f"  one stage, cap {cap_ms:.4f} ms, stage {stages[0]} (and {len(stages) - 1} like it): "
                      f"holds {found:.4f} ms of work (CP-SAT's bound {bound:.4f}, {det:.2f} deterministic s)",
                      flush=True)
            verdict = ("no bound weighing each stage alone proves it" if held >= total
                       else "proven (the bounds fall short)" if bounded < total else "undecided")
            print(f"  one stage, cap {cap_ms:.4f} ms: the most each kind holds, times its stages, {held:.4f} ms "
                  f"(bounded by {bounded:.4f}) against {total:.4f} of work: {verdict}", flush=True)


if __name__ == "__main__":
    main()
