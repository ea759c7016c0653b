"""Time to price one plan (``Problem.stage_costs``), the step every order search repeats.

Run:  .venv/bin/python benchmarks/pricing.py [--repo PATH] [--repeats N] [--write docs/benchmarks.md]

``--repo`` prices with another checkout's ``partitioner`` (e.g. a ``git worktree`` of an
earlier commit), so two versions are timed by the same script; run them one after the other
and compare the ratio, not the absolute times (this machine is shared). Each case is a
synthetic graph at 64 stages, priced on the uniform baseline's plan. ``--write`` replaces
this checkout's section of a markdown file.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = (("layered", 1000), ("encdec", 1000), ("transformer", 1000), ("layered", 10000))
SECTION = "## Pricing one plan: `Problem.stage_costs`"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose partitioner is timed")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file (this checkout)")
    args = ap.parse_args()
    if args.write and args.repo.resolve() != ROOT:
        ap.error("--write describes this checkout: leave --repo out")
    sys.path.insert(0, str(args.repo.resolve()))
    import numpy as np

    from partitioner import synthetic
    from partitioner.cluster import Cluster
    from partitioner.problem import Problem
    from partitioner.solve.baselines import baseline_assign

    rows = []
    for kind, ops in CASES:
        graph = synthetic.generate(kind, ops, seed=0)
        prob = Problem(graph, 64, cluster=Cluster.load("h100-sxm", devices=64), microbatches=256)
        assign = baseline_assign(prob, "uniform", np.ones(prob.n + 1, dtype=bool))
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            prob.stage_costs(assign)
            times.append(time.perf_counter() - t)
        rows.append(f"| {kind} | {prob.n} | {statistics.median(times) * 1e3:.2f} |")
        print(f"{kind:>12} {prob.n:>6} ops x 64: {statistics.median(times) * 1e3:8.2f} ms a plan "
              f"(median of {args.repeats})", flush=True)
    if args.write:
        sys.path.insert(0, str(ROOT))
        from benchmarks._markdown import write_section

        write_section(args.write, SECTION, "\n".join([
            "`.venv/bin/python benchmarks/pricing.py --write docs/benchmarks.md` (written by the script). The cost "
            "model's price of one plan (every stage's compute, transfers and memory), which dp's searches, the tabu "
            "search and the windows repeat for every candidate: each synthetic graph at 64 stages on `h100-sxm` "
            f"nodes, priced on the uniform baseline's plan, median of {args.repeats} on "
            f"{platform.processor() or platform.machine()} (a shared machine: compare "
            "versions with `--repo`, one after the other).",
            "",
            "| graph | ops | ms a plan |",
            "|---|---:|---:|",
            *rows,
        ]))


if __name__ == "__main__":
    main()
