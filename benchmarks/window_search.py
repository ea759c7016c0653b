"""The window search alone, from the plan ``auto`` has when it starts it: the plan it reaches, and the windows.

Run: ``.venv/bin/python benchmarks/window_search.py [--rows layered:100x8 t5:size=smallx16] [--budget 15]``. Each row is a graph (a zoo spec on the meta device, analytic H100 bf16, or a synthetic
``kind:ops``) and a stage count, planned as benchmarks/planner.py plans it (``time_limit`` 30); ``auto`` runs
up to the window search, whose starting plan is taken, and :func:`window_search` then runs from it with
the budget given (deterministic seconds). Prints one line per row and per window that lowers the bottleneck.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._graphs import graph_for  # noqa: E402
from partitioner.cluster import Cluster  # noqa: E402
from partitioner.cost import Problem  # noqa: E402
from partitioner.solve import solve  # noqa: E402

SOLVE_MODULE = importlib.import_module("partitioner.solve")
WINDOWS_MODULE = importlib.import_module("partitioner.solve.windows")


class _Started(Exception):
    """Raised in place of the window search inside ``auto``, carrying what it was given."""

    def __init__(self, prob: Problem, assign: list[int], groups: list[list[int]]):
        super().__init__("window search reached")
        self.prob, self.assign, self.groups = prob, assign, groups


def auto_start(graph, stages: int, time_limit: float) -> _Started | None:
    """The problem (as ``solve`` builds it), plan and colocated positions ``auto`` hands the window search
    (None: proven before it, or too large for it)."""
    def stop(prob, assign, groups=(), **kwargs):
        raise _Started(prob, list(assign), [list(g) for g in groups])

    real = SOLVE_MODULE.window_search
    SOLVE_MODULE.window_search = stop
    try:
        solve(graph, stages, cluster=Cluster.load("h100-sxm", devices=stages), microbatches=4 * stages,
              method="auto", time_limit=time_limit)
    except _Started as started:
        return started
    finally:
        SOLVE_MODULE.window_search = real
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=["layered:100x8", "layered:1000x8", "t5:size=smallx8",
                                                  "t5:size=smallx16"])
    ap.add_argument("--budget", type=float, default=15.0)
    ap.add_argument("--time-limit", type=float, default=30.0)
    args = ap.parse_args()
    real_search = WINDOWS_MODULE._search_window
    for row in args.rows:
        spec, _, p = row.rpartition("x")
        stages = int(p)
        graph = graph_for(spec)
        start = auto_start(graph, stages, args.time_limit)
        if start is None:
            print(f"{row}: auto does not run the window search here")
            continue
        spent = [0.0]

        def traced(prob_, model, loads, plan, window, bottleneck, **kwargs):
            det, new, finished = real_search(prob_, model, loads, plan, window, bottleneck, **kwargs)
            spent[0] += det
            if new is not None:
                value = max(prob_.stage_costs(new)[0])
                if value < bottleneck * (1 - 1e-12):
                    print(f"  {len(window)} stages from {window.start}: {bottleneck * 1e3:.5f} -> {value * 1e3:.5f} ms "
                          f"({det:.2f} deterministic s, {spent[0]:.2f} in all)", flush=True)
            return det, new, finished

        WINDOWS_MODULE._search_window = traced
        t0 = time.perf_counter()
        try:
            res = WINDOWS_MODULE.window_search(start.prob, start.assign, start.groups, budget=args.budget,
                                               wall_limit=10 * args.budget + 60)
        finally:
            WINDOWS_MODULE._search_window = real_search
        print(f"{row}: {res.start_value * 1e3:.5f} -> {res.value * 1e3:.5f} ms; windows up to {res.widest} stages, "
              f"{res.tried} tried, {res.taken} taken, {spent[0]:.2f} of {args.budget:g} deterministic s, "
              f"{time.perf_counter() - t0:.1f} wall s", flush=True)


if __name__ == "__main__":
    main()
