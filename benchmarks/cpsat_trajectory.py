"""When CP-SAT's optimisation inside ``auto`` finds each better plan, in deterministic seconds.

Run: ``.venv/bin/python benchmarks/cpsat_trajectory.py [--budget 30] [t5x8 t5x16 layered:100x8 ...]``.
Each row is ``auto`` as the planner benchmark runs it (T5-small on meta, analytic H100 profile, bf16;
synthetic graphs with seed 0; 4 x stages microbatches), with CP-SAT given the whole ``--budget``
(``CPSAT_BUDGET_SHARE`` set to 1) and the stage groups and bisection off; prints the deterministic
time at which each strictly better plan arrived, and the plan. What ``CPSAT_BUDGET_SHARE`` rests on.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from ortools.sat.python import cp_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partitioner import synthetic  # noqa: E402
from partitioner.cluster import Cluster  # noqa: E402
from partitioner.profile import profile  # noqa: E402
from smp.models import build  # noqa: E402

SOLVE = importlib.import_module("partitioner.solve")  # the package, not its solve() function
CPSAT = importlib.import_module("partitioner.solve.cpsat")


class _Improvements(cp_model.CpSolverSolutionCallback):
    """Records (deterministic seconds, objective in integer units) at each strictly better solution."""

    def __init__(self, found: list[tuple[float, float]]):
        super().__init__()
        self.found = found

    def on_solution_callback(self) -> None:
        if not self.found or self.objective_value < self.found[-1][1]:
            self.found.append((self.deterministic_time, self.objective_value))


def _graph(spec: str):
    if spec == "t5":
        bundle = build("t5:size=small", meta=True)
        return profile(bundle.model, bundle.example_args, bundle.example_kwargs,
                       timing="analytic", device_profile="h100-sxm", dtype="bf16")
    kind, ops = spec.split(":")
    return synthetic.generate(kind, int(ops), seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("rows", nargs="*", default=["t5x8", "t5x16", "layered:100x8"], help="GRAPHxSTAGES")
    ap.add_argument("--budget", type=float, default=30.0, help="CP-SAT's deterministic seconds")
    args = ap.parse_args()
    found: list[tuple[float, float]] = []
    scales: list[float] = []
    make_solver, set_objective = CPSAT.proof_solver, CPSAT._Model.objective

    def solver(**kwargs):
        s = make_solver(**kwargs)
        solve = s.Solve
        s.Solve = lambda model: solve(model, _Improvements(found))
        return s

    def objective(model, *a, **k):
        set_objective(model, *a, **k)
        scales.append(model.scale)

    CPSAT.proof_solver, CPSAT._Model.objective = solver, objective
    SOLVE.CPSAT_BUDGET_SHARE = 1.0
    SOLVE._run_groups = lambda *a, **k: 0.0
    SOLVE._run_bisection = lambda *a, **k: None
    for row in args.rows:
        spec, stages = row.rsplit("x", 1)
        p = int(stages)
        graph = _graph(spec)
        found.clear()
        scales.clear()
        t = time.perf_counter()
        part = SOLVE.solve(graph, p, cluster=Cluster.load("h100-sxm", devices=p), microbatches=4 * p,
                           time_limit=args.budget)
        print(f"{row}: {part.method} {part.bottleneck * 1e3:.6g} ms, bound {part.lower_bound * 1e3:.6g} ms, "
              f"{time.perf_counter() - t:.0f} s", flush=True)
        for note in part.notes:
            if note.startswith("cpsat:"):
                print(f"  {note}")
        for det, units in found:
            print(f"  better plan at {det:6.2f} deterministic s: {units / scales[-1] * 1e3:.6g} ms", flush=True)


if __name__ == "__main__":
    main()
