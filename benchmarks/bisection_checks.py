"""One bisection check (CP-SAT: is there a plan under a cap?) by linearization level and with or without the
cut sums (``_Model.cut_sums``): what bisect.py runs (its integers scaled to the cap, where bisect.py scales
them to the plan: the same model, its integers a little apart).

Run: ``.venv/bin/python benchmarks/bisection_checks.py [--graph t5:size=small] [--stages 8] [--caps 0.42 0.44]
[--levels 0 1 2] [--budget 30] [--cut-sums on off] [--seeds 0 1 2]``. The graph as the planner benchmark builds
it (a zoo spec on the meta device, analytic H100 profile, bf16; or a synthetic ``kind:ops``, seed 0), caps in
ms; prints each check's status and deterministic seconds (the same on any machine) and wall seconds. CP-SAT's
``random_seed`` (bisect.py uses 0) samples how much a check's time owes to the search's luck.
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
from partitioner.solve.cpsat_model import PlacementModel as _Model, proof_solver  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--graph", default="t5:size=small", help="a zoo spec or a synthetic kind:ops")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--caps", type=float, nargs="+", default=[0.42, 0.44], help="caps in ms")
    ap.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2], help="CP-SAT linearization levels")
    ap.add_argument("--budget", type=float, default=30.0, help="deterministic seconds per check")
    ap.add_argument("--cut-sums", nargs="+", choices=["on", "off"], default=["on"],
                    help="with the redundant sums over the stages on each side of each cut, without, or both")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="CP-SAT random seeds")
    args = ap.parse_args()
    graph = graph_for(args.graph)
    p = args.stages
    prob = Problem(graph, p, cluster=Cluster.load("h100-sxm", devices=p), microbatches=4 * p)
    print(f"{args.graph} ({prob.n} ops) at {p} stages; budget {args.budget:g} deterministic s per check\n", flush=True)
    print("| cap ms | linearization | cut sums | seed | status | deterministic s | wall s |\n"
          "| ---: | ---: | --- | ---: | --- | ---: | ---: |", flush=True)
    for cap_ms in args.caps:
        cap = cap_ms * 1e-3
        for cut_sums in args.cut_sums:
            model = _Model(prob, [])
            model.objective(cap, cap, 0.0)  # the bottleneck's domain ends at the cap (plus one rounding unit)
            model.m.clear_objective()
            if cut_sums == "on":
                model.cut_sums()
            for level in args.levels:
                for seed in args.seeds:
                    solver = proof_solver(budget=args.budget, wall_left=20 * args.budget, workers=1, seed=seed)
                    solver.parameters.linearization_level = level
                    t = time.perf_counter()
                    status = solver.Solve(model.m)
                    print(f"| {cap_ms:g} | {level} | {cut_sums} | {seed} | {solver.StatusName(status)} | "
                          f"{solver.response_proto.deterministic_time:.1f} | {time.perf_counter() - t:.1f} |",
                          flush=True)


if __name__ == "__main__":
    main()
