"""Refine a partition by simulated step time: move boundary ops between neighbouring stages.

The bottleneck (largest stage time) is what the solvers minimise and prove bounds on;
the step time of a real schedule also depends on how fast the pipeline fills and drains,
on where communication sits on the critical path, and (zero-bubble) on each stage's
split between input and weight gradients. This module ranks candidates by the
simulator instead, starting from a solver's answer: a first-improvement hill climb over
single-op moves across stage boundaries, each candidate priced by ``evaluate`` and
timed by ``simulate`` on the schedule it will run under. The search is bounded by a
count of simulations, not seconds, so it returns the same plan on any machine.

With many microbatches (a 256-microbatch step of a 13B model simulates in seconds) the
candidates are ranked on a shorter step instead: fill, ``RANKING_MICROBATCHES`` of steady
state and drain, extended by ``m - RANKING_MICROBATCHES`` periods of the candidate's
bottleneck (1F1B's steady state runs one microbatch per period of its slowest stage). Only
the ranking is estimated: the start and the end of the climb are simulated at full length,
and the faster of the two is returned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from partitioner.cost import Partition, partition
from partitioner.ir import ScheduleKind
from partitioner.problem import Problem
from partitioner.schedule import make_schedule, stage_graph_from_transfers
from partitioner.simulate import simulate, stage_costs_from

__all__ = ["simulated_step_time", "refine_step_time", "refine_simulations", "REFINE_SIMULATIONS"]

#: Candidates the hill climb may simulate (deterministic; ~1-3 ms each on a 500-op graph) ...
REFINE_SIMULATIONS = 400
#: ... while each simulates at most this many stage-microbatches (a simulation's work grows with both: 32 stages
#: ranked on 64 microbatches take a second in Python); beyond, the count shrinks so the climb's work stays
#: REFINE_SIMULATIONS x this, down to REFINE_MIN_SIMULATIONS.
REFINE_STAGE_MICROBATCHES = 16 * 64
REFINE_MIN_SIMULATIONS = 50
#: Microbatches a candidate is simulated with when the step has more (see the module's doc).
RANKING_MICROBATCHES = 32

def simulated_step_time(part: Partition, schedule: str | None = None, *, ranks: int | None = None,
                        microbatches: int | None = None) -> float:
    """Simulated step time of ``part`` under ``schedule`` (default: the one it was priced for), with
    ``microbatches`` instead of its own count if given."""
    kind = ScheduleKind.parse(schedule or part.schedule)
    graph = stage_graph_from_transfers(part.num_stages, part.transfers)
    m = microbatches or part.microbatches
    cap = part.active_microbatches if kind.value == part.schedule else None  # another kind: its own warm-up
    cap = cap if cap is not None and cap < m else None
    sched = make_schedule(kind, graph, m, num_ranks=(ranks or part.num_stages) if kind.interleaved
                          else None, active_microbatches=cap, check=False)  # simulated only: the walk checks
    return simulate(sched, stage_costs_from(part.stages, part.transfers), timeline=False).step_time


def _ranking_microbatches(m: int, stages: int, ranks: int | None) -> int:
    """The microbatches candidates are simulated with: ``m``, or fewer that keep a steady state
    (at least twice the pipeline ranks, a multiple of them for interleaved schedules)."""
    if m <= RANKING_MICROBATCHES:
        return m
    per = ranks or stages
    short = max(RANKING_MICROBATCHES, 2 * per)
    short -= short % per
    return short if 0 < short < m and m % per == 0 else m


def refine_simulations(stages: int, microbatches: int) -> int:
    """How many candidates the climb simulates for ``stages`` ranked on ``microbatches``: a fixed amount of work."""
    work = stages * microbatches
    if work <= REFINE_STAGE_MICROBATCHES:
        return REFINE_SIMULATIONS
    return max(REFINE_MIN_SIMULATIONS, REFINE_SIMULATIONS * REFINE_STAGE_MICROBATCHES // work)


def refine_step_time(prob: Problem, assign: Sequence[int], *, ranks: int | None = None,
                     frozen: Iterable[int] = (), simulations: int | None = None,
                     slack: float = 0.10) -> tuple[list[int], float, float]:
    """Hill-climb ``assign`` (a stage per position of ``prob.order``) on simulated step time.

    A move takes one op from stage s to s - 1 or s + 1 when every producer (or consumer)
    already lies on the far side, so the assignment stays a valid pipeline; stages never
    empty, memory limits hold, and ops in ``frozen`` (colocation groups) stay put.
    Candidates whose bottleneck exceeds the current one by more than ``slack`` are not
    simulated; at most ``simulations`` are (default :func:`refine_simulations`). Returns (assignment, step time
    before, step time after).
    """
    frozen = set(frozen)
    short = _ranking_microbatches(prob.microbatches, prob.p, ranks)
    left = refine_simulations(prob.p, short) if simulations is None else simulations
    current = list(assign)
    sizes = [0] * prob.p
    for s in current:
        sizes[s] += 1

    def step_of(candidate: list[int], exact: bool = False) -> float | None:
        nonlocal left
        left -= 1
        part = partition(prob, candidate)
        if not part.memory_ok:
            return None
        if exact or short == prob.microbatches:
            return simulated_step_time(part, ranks=ranks)
        return simulated_step_time(part, ranks=ranks, microbatches=short) + \
            (prob.microbatches - short) * part.bottleneck

    start_step = step_of(current, exact=True)
    if start_step is None:
        return current, float("nan"), float("nan")
    start = current
    best = start_step if short == prob.microbatches else step_of(current)
    assert best is not None
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
    if short != prob.microbatches:  # ranked on estimates: the end is simulated in full, and kept if faster
        if current == start:
            return start, start_step, start_step
        end_step = step_of(current, exact=True)
        assert end_step is not None
        return (current, start_step, end_step) if end_step < start_step else (start, start_step, start_step)
    return current, start_step, best
