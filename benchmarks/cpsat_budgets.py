"""CP-SAT's optimisation inside ``auto`` at several budgets: the plan, bound and status each ends on.

Run: ``.venv/bin/python benchmarks/cpsat_budgets.py [--budgets 7.5 15 30] [ROW ...]`` with rows
``GRAPH@STAGES``: a synthetic ``kind:ops`` (seed 0) or a zoo spec (built on meta, analytic H100
profile, bf16), as the planner benchmark plans them (``microbatches = 4 x stages``). ``auto`` runs
as usual up to CP-SAT, which gets the whole budget; the stage groups and the bisection are off.
Deterministic: the same figures on any machine. What ``CPSAT_BUDGET_SHARE`` and ``CPSAT_MIN_BUDGET``
rest on (docs/optimizer.md, "Bisection").
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._graphs import graph_for  # noqa: E402
from partitioner.cluster import Cluster  # noqa: E402

SOLVE = importlib.import_module("partitioner.solve")  # the package, not its solve() function
ROWS = ["t5:size=small@8", "t5:size=small@16", "layered:100@8", "layered:1000@8", "gpt:size=base@16"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("rows", nargs="*", default=ROWS, help="GRAPH@STAGES")
    ap.add_argument("--budgets", type=float, nargs="+", default=[7.5, 15.0, 30.0],
                    help="CP-SAT's deterministic seconds")
    args = ap.parse_args()
    SOLVE.cpsat_budget = lambda time_limit: time_limit  # CP-SAT gets all of it
    SOLVE._run_groups = lambda *a, **k: 0.0
    SOLVE._run_bisection = lambda *a, **k: None
    print("| graph | stages | CP-SAT budget | status | deterministic s | plan ms | bound ms | plan by | wall s |")
    print("|---|---:|---:|---|---:|---:|---:|---|---:|", flush=True)
    for row in args.rows:
        spec, stages = row.rsplit("@", 1)
        p = int(stages)
        graph = graph_for(spec)
        for budget in args.budgets:
            t = time.perf_counter()
            part = SOLVE.solve(graph, p, cluster=Cluster.load("h100-sxm", devices=p), microbatches=4 * p,
                               time_limit=budget)
            note = next((n for n in part.notes if n.startswith("cpsat:")), "cpsat: not run")
            status = note.split()[1]
            det = note.split("(", 1)[1].split(" of")[0] if "(" in note else "-"
            print(f"| {spec} | {p} | {budget:g} | {status} | {det} | {part.bottleneck * 1e3:.6g} | "
                  f"{part.lower_bound * 1e3:.6g} | {part.method} | {time.perf_counter() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
