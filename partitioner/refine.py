"""Refine a partition by simulated step time: move boundary ops between neighbouring stages.

The bottleneck (largest stage time) is what the solvers minimise and prove bounds on;
the step time of a real schedule also depends on how fast the pipeline fills and drains,
on where communication sits on the critical path, and (zero-bubble) on each stage's
split between input and weight gradients. This module ranks candidates by the
simulator instead, starting from a solver's answer: a first-improvement hill climb over
single-op moves across stage boundaries, each candidate priced by ``evaluate`` and
timed by ``simulate`` on the schedule it will run under. The search is bounded by a
count of simulations, not seconds, so it returns the same plan on any machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from partitioner.cost import Partition, Problem
from partitioner.ir import ScheduleKind
from partitioner.schedule import make_schedule, stage_graph_from_transfers
from partitioner.simulate import simulate, stage_costs_from

__all__ = ["simulated_step_time", "refine_step_time", "REFINE_SIMULATIONS"]

#: Candidates the hill climb may simulate (deterministic; ~1-3 ms each on a 500-op graph).
REFINE_SIMULATIONS = 400

def simulated_step_time(part: Partition, schedule: str | None = None, *, ranks: int | None = None) -> float:
    """Simulated step time of ``part`` under ``schedule`` (default: the one it was priced for)."""
    kind = ScheduleKind.parse(schedule or part.schedule)
    graph = stage_graph_from_transfers(part.num_stages, part.transfers)
    cap = part.active_microbatches if kind.value == part.schedule else None  # another kind: its own warm-up
    sched = make_schedule(kind, graph, part.microbatches, num_ranks=(ranks or part.num_stages) if kind.interleaved
                          else None, active_microbatches=cap, check=False)  # simulated only: the walk checks
    return simulate(sched, stage_costs_from(part.stages, part.transfers), timeline=False).step_time


def refine_step_time(prob: Problem, assign: Sequence[int], *, ranks: int | None = None,
                     frozen: Iterable[int] = (), simulations: int = REFINE_SIMULATIONS,
                     slack: float = 0.10) -> tuple[list[int], float, float]:
    """Hill-climb ``assign`` (a stage per position of ``prob.order``) on simulated step time.

    A move takes one op from stage s to s - 1 or s + 1 when every producer (or consumer)
    already lies on the far side, so the assignment stays a valid pipeline; stages never
    empty, memory limits hold, and ops in ``frozen`` (colocation groups) stay put.
    Candidates whose bottleneck exceeds the current one by more than ``slack`` are not
    simulated; at most ``simulations`` are. Returns (assignment, step time before, step time after).
    """
    frozen = set(frozen)
    left = simulations
    current = list(assign)
    sizes = [0] * prob.p
    for s in current:
        sizes[s] += 1

    def step_of(candidate: list[int]) -> float | None:
        nonlocal left
        left -= 1
        part = prob.partition(candidate)
        if not part.memory_ok:
            return None
        return simulated_step_time(part, ranks=ranks)

    start_step = step_of(current)
    if start_step is None:
        return current, float("nan"), float("nan")
    best = start_step
    improved = True
    while improved and left > 0:
        improved = False
        bottleneck = prob.bottleneck(current)
        for i in range(prob.n):
            if i in frozen or sizes[current[i]] == 1:
                continue
            s = current[i]
            for target in (s + 1, s - 1):
                if not 0 <= target < prob.p:
                    continue
                if target > s and any(current[j] < target for j in prob.succ[i]):
                    continue
                if target < s and any(current[j] > target for j in prob.pred[i]):
                    continue
                candidate = current.copy()
                candidate[i] = target
                if prob.bottleneck(candidate) > bottleneck * (1 + slack):
                    continue
                step = step_of(candidate)
                if step is not None and step < best * (1 - 1e-9):
                    sizes[s] -= 1
                    sizes[target] += 1
                    current, best, improved = candidate, step, True
                    break
            if improved or left <= 0:
                break
    return current, start_step, best
