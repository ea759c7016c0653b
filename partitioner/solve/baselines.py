"""Peer partitioners, for comparison only: equal layer counts, balanced parameters, balanced time.

- ``uniform``: equal numbers of layers per stage (DeepSpeed ``partition_method="uniform"``),
  a layer being a run of ops under one numbered module (``layers.3``) or one top-level
  module; equal op counts when there are fewer layers than stages.
- ``params``: balance parameter bytes (DeepSpeed's default ``"parameters"``).
- ``blocks``: the time-balanced block partition of a sequence, as torchgpipe's
  ``balance_by_time`` (comm-blind min-max of fwd + bwd per stage).

All cut the program order contiguously and never look at communication or memory; the
result is costed by the same :func:`~partitioner.cost.evaluate` as every solver.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from partitioner.problem import Problem

__all__ = ["BASELINES", "baseline_assign", "minmax_cuts", "cuts_to_assign"]

BASELINES = ("uniform", "params", "blocks")


def cuts_to_assign(cuts: Sequence[int], n: int) -> list[int]:
    """Stage per position from the p-1 boundaries (position where each later stage starts)."""
    assign = [0] * n
    bounds = [0, *cuts, n]
    for s in range(len(bounds) - 1):
        assign[bounds[s]:bounds[s + 1]] = [s] * (bounds[s + 1] - bounds[s])
    return assign


def minmax_cuts(weights: np.ndarray, p: int, allowed: np.ndarray) -> list[int]:
    """Contiguous p-way cuts minimising the largest segment weight, cutting only where allowed.

    Bisection on the answer with the greedy probe (extend each segment as far as it
    fits, cut at the last allowed position), the textbook method for chains-on-chains
    partitioning (Pinar & Aykanat 2004).
    """
    n = len(weights)
    cw = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=float))])
    prev_allowed = np.zeros(n + 1, dtype=np.int64)  # largest allowed cut <= c (0 if none)
    last = 0
    for c in range(n + 1):
        if 0 < c < n and allowed[c]:
            last = c
        prev_allowed[c] = last

    def greedy(limit: float) -> list[int] | None:
        cuts, start = [], 0
        while True:
            j = int(np.searchsorted(cw, cw[start] + limit * (1 + 1e-12), side="right")) - 1
            if j >= n:
                return cuts
            c = int(prev_allowed[j])
            if c <= start:
                return None
            cuts.append(c)
            start = c
            if len(cuts) >= p:
                return None

    lo, hi = float(np.max(weights, initial=0.0)), float(cw[-1])
    cuts = greedy(hi) or []
    for _ in range(100):
        if hi - lo <= 1e-12 * max(hi, 1e-300):
            break
        mid = (lo + hi) / 2
        trial = greedy(mid)
        if trial is None:
            lo = mid
        else:
            hi, cuts = mid, trial
    # Fewer than p segments: split the segment with most ops at an allowed position.
    cuts = sorted(cuts)
    while len(cuts) < p - 1:
        bounds = [0, *cuts, n]
        options = []
        for a, b in zip(bounds, bounds[1:]):
            inside = [c for c in range(a + 1, b) if allowed[c]]
            if inside:
                options.append((-(b - a), inside[len(inside) // 2]))
        if not options:
            break
        cuts = sorted([*cuts, min(options)[1]])
    return cuts


def _layer_runs(prob: Problem) -> list[int]:
    """Run id per position: consecutive ops under the same layer module form one run."""
    runs, key_prev, rid = [], None, -1
    for mod in prob.modules:
        parts = mod.split(".") if mod else []
        k = next((j for j, x in enumerate(parts) if x.isdigit()), None)
        key = ".".join(parts[:k + 1]) if k is not None else (parts[0] if parts else key_prev)
        if key != key_prev or rid < 0:
            rid += 1
            key_prev = key
        runs.append(rid)
    return runs


def baseline_assign(prob: Problem, method: str, allowed: np.ndarray) -> list[int]:
    """Stage per position of the program order under one of :data:`BASELINES`."""
    if method == "uniform":
        runs = _layer_runs(prob)
        nruns = runs[-1] + 1
        if nruns >= prob.p:
            sizes = np.bincount(runs)
            weights = np.array([1.0 / sizes[r] for r in runs])
            # Cut only between layers, as a layer-list partitioner would.
            layer_allowed = allowed.copy()
            for c in range(1, prob.n):
                if runs[c] == runs[c - 1]:
                    layer_allowed[c] = False
            cuts = minmax_cuts(weights, prob.p, layer_allowed)
            if len(cuts) == prob.p - 1:
                return cuts_to_assign(cuts, prob.n)
        weights = np.ones(prob.n)
    elif method == "params":
        weights = prob.params.astype(float)
    elif method == "blocks":
        weights = prob.work.astype(float)
    else:
        raise ValueError(f"unknown baseline {method!r}; one of {BASELINES}")
    return cuts_to_assign(minmax_cuts(weights, prob.p, allowed), prob.n)
