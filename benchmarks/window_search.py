"""The window search alone, from the plan ``auto`` has when it starts it: the plan it reaches, and the windows.

Run: ``.venv/bin/python benchmarks/window_search.py [--rows layered:100x8 t5:size=smallx16] [--budget 15]
[--trace]``. Each row is a graph (a zoo spec on the meta device, analytic H100 bf16, or a synthetic ``kind:ops``)
and a stage count, planned as benchmarks/planner.py plans it (``time_limit`` 30); ``auto`` runs up to the window
search, whose starting plan is taken, and :func:`window_search` then runs from it with the budget given
(deterministic seconds): on CP-SAT's model of the whole problem where ``auto`` builds it and, side by side, on
the models of each window alone (:mod:`partitioner.solve.window_model`, what ``auto`` runs where the whole model
is too large). Prints one line per row and model, and with ``--trace`` one per window that lowers the bottleneck.
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
from partitioner.problem import Problem  # noqa: E402
from partitioner.solve import solve  # noqa: E402

SOLVE_MODULE = importlib.import_module("partitioner.solve")
WINDOWS_MODULE = importlib.import_module("partitioner.solve.windows")


class _Started(Exception):
    """Raised in place of the window search inside ``auto``, carrying what it was given."""

    def __init__(self, prob: Problem, assign: list[int], groups: list[list[int]], whole: bool):
        super().__init__("window search reached")
        self.prob, self.assign, self.groups, self.whole = prob, assign, groups, whole


def auto_start(graph, stages: int, time_limit: float) -> _Started | None:
    """The problem (as ``solve`` builds it), plan and colocated positions ``auto`` hands the window search
    (None: proven before it, or too large for it)."""
    def stop(prob, assign, groups=(), *, whole=True, **kwargs):
        raise _Started(prob, list(assign), [list(g) for g in groups], whole)

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


def _traced(search, spent: list[float], trace: bool, window_at: int, bottleneck_at: int):
    """``search`` (one window's CP-SAT), adding its deterministic seconds to ``spent`` and printing each window
    that lowers the bottleneck when ``trace``."""
    def run(*args, **kwargs):
        det, new, finished = search(*args, **kwargs)
        spent[0] += det
        prob, window, bottleneck = args[0], args[window_at], args[bottleneck_at]
        if trace and new is not None:
            value = max(prob.stage_costs(new)[0])
            if value < bottleneck * (1 - 1e-12):
                print(f"  {len(window)} stages from {window.start}: {bottleneck * 1e3:.5f} -> {value * 1e3:.5f} ms "
                      f"({det:.2f} deterministic s, {spent[0]:.2f} in all)", flush=True)
        return det, new, finished
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=["layered:100x8", "layered:1000x8", "t5:size=smallx8",
                                                  "t5:size=smallx16", "layered:1000x64"])
    ap.add_argument("--budget", type=float, default=15.0)
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--trace", action="store_true", help="a line per window that lowers the bottleneck")
    args = ap.parse_args()
    real = WINDOWS_MODULE._search_window, WINDOWS_MODULE._search_window_alone
    for row in args.rows:
        spec, _, p = row.rpartition("x")
        stages = int(p)
        graph = graph_for(spec)
        start = auto_start(graph, stages, args.time_limit)
        if start is None:
            print(f"{row}: auto does not run the window search here")
            continue
        for whole in ([True, False] if start.whole else [False]):
            spent = [0.0]
            WINDOWS_MODULE._search_window = _traced(real[0], spent, args.trace, 4, 5)
            WINDOWS_MODULE._search_window_alone = _traced(real[1], spent, args.trace, 2, 4)
            t0 = time.perf_counter()
            try:
                res = WINDOWS_MODULE.window_search(start.prob, start.assign, start.groups, budget=args.budget,
                                                   wall_limit=10 * args.budget + 60, whole=whole)
            finally:
                WINDOWS_MODULE._search_window, WINDOWS_MODULE._search_window_alone = real
            model = "whole model" if whole else "window alone"
            print(f"{row} ({model}): {res.start_value * 1e3:.5f} -> {res.value * 1e3:.5f} ms; windows up to "
                  f"{res.widest} stages, {res.tried} tried, {res.taken} taken, {spent[0]:.2f} of {args.budget:g} "
                  f"deterministic s, {time.perf_counter() - t0:.1f} wall s", flush=True)


if __name__ == "__main__":
    main()
