"""How far stage groups can ever prove: the grouped model's bound and its best plan found, for chosen group starts.

Run: ``.venv/bin/python benchmarks/group_relaxations.py [--graph layered:1000] [--stages 64] [--budget 15]
[--starts 0,32 0,7,8,9 ...]``. The graph as the planner benchmark builds it (a zoo spec on the meta device,
analytic H100 profile, bf16; or a synthetic ``kind:ops``, seed 0), on the planner benchmark's cluster (8-GPU
nodes). For each list of groups' first stages: the bound CP-SAT proves on the grouped model
(:mod:`partitioner.solve.groups`, started from ``auto``'s plan), and the least bottleneck of a grouped plan it found,
which no bound from those groups can exceed, whatever the budget: where that is far below the plan, the
grouping cannot close the gap.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._graphs import graph_for  # noqa: E402
from partitioner.cluster import Cluster  # noqa: E402
from partitioner.problem import Problem  # noqa: E402
from partitioner.solve import solve  # noqa: E402
from partitioner.solve.groups import group_lower_bound  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--graph", default="layered:1000", help="a zoo spec or a synthetic kind:ops")
    ap.add_argument("--stages", type=int, default=64)
    ap.add_argument("--budget", type=float, default=15.0, help="deterministic seconds per grouping")
    ap.add_argument("--time-limit", type=float, default=30.0, help="auto's time_limit for the plan the groups start from")
    ap.add_argument("--starts", nargs="*", default=["0,32", "0,7,8,9", "0,6,7,8,9,10", "0,8,16,24,32,40,48,56"],
                    help="groups' first stages, comma-separated, one list per grouping")
    args = ap.parse_args()
    p = args.stages
    graph = graph_for(args.graph)
    cluster = Cluster.load("h100-sxm", devices=p)
    prob = Problem(graph, p, cluster=cluster, microbatches=4 * p)
    plan = solve(graph, p, cluster=cluster, microbatches=4 * p, time_limit=args.time_limit)
    hint = prob.assignment(plan.stage_of)
    work = float(prob.least_work.sum()) / float(prob.speed.sum())
    print(f"{args.graph} ({prob.n} ops) at {p} stages (h100-sxm: 8 devices a node): work / stages "
          f"{work * 1e3:.4f} ms; auto's plan {plan.bottleneck * 1e3:.4f} ms (bound {plan.lower_bound * 1e3:.4f}, "
          f"{plan.bound_by})\n\n"
          "| group starts | bound ms | best grouped plan ms | status | deterministic s | wall s |\n"
          "| --- | ---: | ---: | --- | ---: | ---: |", flush=True)
    for spec in args.starts:
        starts = tuple(int(x) for x in spec.split(","))
        t = time.perf_counter()
        res = group_lower_bound(prob, starts=starts, budget=args.budget, wall_limit=600, hint=hint)
        print(f"| {spec} | {res.lower_bound * 1e3:.4f} | {res.relaxed * 1e3:.4f} | {res.status} | "
              f"{res.deterministic_seconds:.2f} | {time.perf_counter() - t:.1f} |", flush=True)


if __name__ == "__main__":
    main()
