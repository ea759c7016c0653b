"""Tabu search over single-op moves across stage boundaries, minimising the bottleneck.

The DP cuts one topological order and the ideal DP prices segments in a lower model; on
graphs too large for CP-SAT their plan is the answer, and on DAGs with parallel branches
(skip connections, an encoder beside a decoder's first layers) an op sits better one
stage over than any contiguous cut of one order puts it. This search starts from such a
plan and moves one op at a time between the bottleneck stage and a neighbour: one of the
bottleneck's ops whose producers are all earlier (to the stage before) or whose
consumers are all later (to the stage after), or a neighbour's op that may join the
bottleneck (it may shed a transfer). Every candidate is priced exactly
(:meth:`~partitioner.problem.Problem.stage_costs`) and must fit memory; the best one is
taken even when it is worse, and an op just moved may not move again for
``TABU_TENURE`` steps unless that finds a new best plan (tabu search, Glover, "Tabu
Search — Part I", ORSA Journal on Computing 1989; the moves are those of
Fiduccia–Mattheyses refinement, DAC 1982, restricted to keep every edge pointing
forward). Plans are compared by their stage times sorted from the largest,
lexicographically, so a move that relieves one of two equal bottlenecks counts.

:func:`tabu_phases` runs it twice, the second time from the first's best plan with a longer tenure
(``SECOND_TENURE``): where the first keeps walking back to one plan, the second walks away from it.

The search is bounded by a count of candidate evaluations (``MOVE_WORK`` op-evaluations),
never by seconds, so it returns the same plan on any machine; a wall-clock deadline is only
a safety net.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from partitioner.problem import Problem

__all__ = ["MoveResult", "tabu_search", "tabu_phases", "lexicographically_smaller", "MOVE_WORK", "MOVE_EVALUATIONS",
           "TABU_TENURE", "SECOND_TENURE"]

#: Candidate evaluations at most ...
MOVE_EVALUATIONS = 2000
#: ... and at most this many ops priced over all of them (each evaluation prices every op):
#: about 1 s at 1,000 ops and 1 s at 10,000 on this 2-core machine.
MOVE_WORK = 5_000_000
#: Steps an op that moved stays where it is (unless moving it finds a new best plan) ...
TABU_TENURE = 4
#: ... and in a second phase, from the first phase's best plan, this many: a longer tenure walks further from a
#: plan the first phase keeps returning to (the planner benchmark's 1,000-op layered DAG at 64 stages 1.737 ->
#: 1.685 ms, the 903-op encoder-decoder 8.057 -> 8.027 ms; docs/optimizer.md, "Moves").
SECOND_TENURE = 8
_REL = 1e-12


@dataclass
class MoveResult:
    """The best plan the search met (``assign``, stage per position) and its bottleneck ``value``."""

    assign: list[int]
    value: float
    start_value: float
    evaluations: int
    wall_stopped: bool


def lexicographically_smaller(a: Sequence[float], b: Sequence[float]) -> bool:
    """``a`` < ``b`` lexicographically (both sorted from the largest), beyond rounding."""
    for x, y in zip(a, b):
        if x < y * (1 - _REL):
            return True
        if x > y * (1 + _REL):
            return False
    return False


def _candidates(prob: Problem, a: np.ndarray, b: int, frozen: Collection[int]) -> list[tuple[int, int]]:
    """(op, stage) moves that keep every edge forward and involve the bottleneck stage ``b``."""
    out = []
    for v in np.flatnonzero(a == b).tolist():
        if v in frozen:
            continue
        if b > 0 and all(a[u] < b for u in prob.pred[v]):
            out.append((v, b - 1))
        if b < prob.p - 1 and all(a[w] > b for w in prob.succ[v]):
            out.append((v, b + 1))
    if b > 0:
        out += [(v, b) for v in np.flatnonzero(a == b - 1).tolist()
                if v not in frozen and all(a[w] >= b for w in prob.succ[v])]
    if b < prob.p - 1:
        out += [(v, b) for v in np.flatnonzero(a == b + 1).tolist()
                if v not in frozen and all(a[u] <= b for u in prob.pred[v])]
    return out


def tabu_search(prob: Problem, assign: Sequence[int], *, frozen: Collection[int] = (),
                work: int = MOVE_WORK, evaluations: int = MOVE_EVALUATIONS, tenure: int = TABU_TENURE,
                deadline: float = float("inf")) -> MoveResult:
    """The best plan met by tabu search from ``assign`` (a valid plan that fits memory).

    ``frozen``: positions that never move (members of colocation groups). The result is never
    worse than ``assign``; every plan it visits is valid and fits memory.
    """
    a = np.asarray(assign, dtype=np.int64).copy()
    times, _ = prob.stage_costs(a)
    current = sorted(times, reverse=True)
    best, best_assign = current, a.copy()
    start = current[0]
    budget = min(evaluations, max(1, work // prob.n))
    real = np.asarray([not out for out in prob.is_output])
    ops_on = np.bincount(a[real], minlength=prob.p)  # a stage keeps at least one op
    # The output node is placed by the cost model's rules, not by this search.
    frozen = set(frozen) | {v for v in range(prob.n) if prob.is_output[v]}
    moved_at: dict[int, int] = {}
    used, step, wall_stopped = 0, 0, False
    while used < budget:
        if time.perf_counter() > deadline:
            wall_stopped = True
            break
        step += 1
        b = int(np.argmax(times))
        moves = [(v, to) for v, to in _candidates(prob, a, b, frozen) if ops_on[a[v]] > 1]
        if not moves:
            break
        pick = None
        for v, to in moves:
            if used >= budget:
                break
            frm = a[v]
            a[v] = to
            t, mem = prob.stage_costs(a)
            a[v] = frm
            used += 1
            if not prob.fits(mem):
                continue
            key = sorted(t, reverse=True)
            if step - moved_at.get(v, -tenure) <= tenure and not lexicographically_smaller(key, best):
                continue  # tabu, and not a new best
            if pick is None or lexicographically_smaller(key, pick[0]):
                pick = (key, v, to, t)
        if pick is None:
            if not moved_at:
                break  # nothing moves even with no op tabu: a dead end
            moved_at.clear()  # every move was tabu: let them all go
            continue
        key, v, to, times = pick
        ops_on[a[v]] -= 1
        ops_on[to] += 1
        a[v] = to
        moved_at[v] = step
        # never a larger bottleneck, not even by rounding
        if lexicographically_smaller(key, best) and key[0] <= best[0]:
            best, best_assign = key, a.copy()
    return MoveResult(best_assign.tolist(), float(best[0]), float(start), used, wall_stopped)


def tabu_phases(prob: Problem, assign: Sequence[int], *, frozen: Collection[int] = (),
                deadline: float = float("inf")) -> MoveResult:
    """:func:`tabu_search` from ``assign`` with :data:`TABU_TENURE`, then from its best plan with
    :data:`SECOND_TENURE`, each phase with its own budget; never worse than ``assign``."""
    first = tabu_search(prob, assign, frozen=frozen, deadline=deadline)
    second = tabu_search(prob, first.assign, frozen=frozen, deadline=deadline, tenure=SECOND_TENURE)
    return MoveResult(second.assign, second.value, first.start_value, first.evaluations + second.evaluations,
                      first.wall_stopped or second.wall_stopped)
