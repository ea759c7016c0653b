"""The cut-crossings bound alone on one graph: from the stage groups' bound to dp's plan, and single caps cut by cut.

Run: ``.venv/bin/python benchmarks/crossings_bound.py [--graph layered:1000] [--stages 8] [--budget 10]
[--caps 7.9 8.0]``. The graph as the planner benchmark builds it (a zoo spec on the meta device, analytic H100
profile, bf16; or a synthetic ``kind:ops``, seed 0). Prints the bisection ``auto`` would run between the
strongest of the closed-form bounds and two stage groups and dp's plan (each cap tried, proven or not, and
the deterministic seconds), without narrowing the windows and with it side by side, then, for each of ``--caps``
(ms), every cut's window and least ends round by round as the windows narrow, and whether the cap is proven
(without the bisection's cutoff for windows wider than a stage).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._graphs import graph_for  # noqa: E402
from partitioner.bounds import named_lower_bounds  # noqa: E402
from partitioner.cluster import Cluster  # noqa: E402
from partitioner.problem import Problem  # noqa: E402
from partitioner.solve import solve  # noqa: E402
from partitioner.solve import crossings  # noqa: E402
from partitioner.solve.cpsat_model import NS_PER_SECOND as _SCALE  # noqa: E402
from partitioner.solve.crossings import CUT_BUDGET, CutCrossings, crossing_lower_bound  # noqa: E402
from partitioner.solve.groups import group_lower_bound  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--graph", default="layered:1000", help="a zoo spec or a synthetic kind:ops")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--budget", type=float, default=10.0, help="deterministic seconds for the bisection")
    ap.add_argument("--caps", type=float, nargs="*", default=[], help="single caps to test cut by cut, in ms")
    args = ap.parse_args()
    p = args.stages
    graph = graph_for(args.graph)
    cluster = Cluster.load("h100-sxm", devices=p)
    prob = Problem(graph, p, cluster=cluster, microbatches=4 * p)
    plan = solve(graph, p, cluster=cluster, microbatches=4 * p, method="dp")
    groups = group_lower_bound(prob, groups=2, budget=15, wall_limit=600)
    lower = max([*named_lower_bounds(prob).values(), groups.lower_bound])
    total = float(prob.least_work.sum())
    print(f"{args.graph} ({prob.n} ops) at {p} stages: work / stages {total / p * 1e3:.4f} ms; "
          f"bound {lower * 1e3:.4f} ms (two stage groups {groups.lower_bound * 1e3:.4f}); "
          f"dp's plan {plan.bottleneck * 1e3:.4f} ms\n", flush=True)
    for rounds in (0, crossings.NARROWING_ROUNDS):  # the windows as they are, then narrowed: side by side
        crossings.NARROWING_ROUNDS = rounds
        t = time.perf_counter()
        res = crossing_lower_bound(prob, lower=lower, upper=plan.bottleneck, budget=args.budget, wall_limit=600)
        tried = ", ".join(f"{cap * 1e3:.4f} {'proven' if ok else 'not'}" for cap, ok in res.tries) or "none"
        print(f"bisection, {rounds} rounds of narrowing: bound {res.lower_bound * 1e3:.4f} ms in "
              f"{res.deterministic_seconds:.2f} deterministic s ({time.perf_counter() - t:.1f} wall s); caps: {tried}\n",
              flush=True)
    test = CutCrossings(prob)
    for cap_ms in args.caps:
        cap = cap_ms * 1e-3
        room = (cap * float(prob.speed.sum()) - total) * 1e3
        print(f"cap {cap_ms:g} ms: room for ends {room:.4f} ms\n\n"
              "| round | cut | window ms | ends counted | least ends ms | deterministic s |\n"
              "| ---: | ---: | --- | ---: | ---: | ---: |")
        windows = [test.window(s, cap) for s in range(1, p)]
        leasts, det, verdict, empty = [0] * (p - 1), 0.0, "not proven", False
        for rnd in range(crossings.NARROWING_ROUNDS + 1):
            for s in range(1, p):
                lo, hi = windows[s - 1]
                ends = test.ends(s, cap)
                least, d = test.model.least(ends, lo, hi, (s, test.real - (p - s)), CUT_BUDGET, 600, 0)
                det += d
                empty = empty or least < 0  # no ideal fits the window: no plan under the cap has this cut
                leasts[s - 1] = max(leasts[s - 1], least)
                print(f"| {rnd} | {s} | {lo / _SCALE * 1e3:.3f} - {hi / _SCALE * 1e3:.3f} | {sum(1 for e in ends if e)} | "
                      f"{least / _SCALE * 1e3:.4f} | {d:.2f} |", flush=True)
            narrowed = test.narrowed(cap, leasts)
            if empty or test.exceeds(cap, leasts) or any(lo > hi for lo, hi in narrowed):
                verdict = "proven"
                break
            if narrowed == windows:
                break
            windows = narrowed
        print(f"\nsum of the least ends {sum(max(0, x) for x in leasts) / _SCALE * 1e3:.4f} ms after round {rnd}: "
              f"{verdict} ({det:.2f} deterministic s)\n", flush=True)

if __name__ == "__main__":
    main()
