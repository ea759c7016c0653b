"""Provable lower bounds on the best bottleneck and on the memory any assignment needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from partitioner.cost import Problem

__all__ = ["trivial_lower_bound", "memory_lower_bound"]


def trivial_lower_bound(prob: Problem) -> float:
    """max(total work / Σ speeds, largest op / fastest speed, pigeonhole on the p+1 largest ops).

    Valid for every assignment because communication only adds to a stage's time:
    Σ_s compute_s · speed_s = total work, so some stage has compute >= total / Σ speed;
    the largest op sits on some device, at best the fastest; among the p + 1 largest ops
    two share a stage, so some stage holds at least the p-th and (p+1)-th largest.
    """
    work = prob.work
    total = float(work.sum())
    fastest = float(prob.speed.max())
    bound = total / float(prob.speed.sum())
    if prob.n:
        top = sorted(work.tolist(), reverse=True)
        bound = max(bound, top[0] / fastest)
        if prob.n > prob.p:
            bound = max(bound, (top[prob.p - 1] + top[prob.p]) / fastest)
    return bound


def memory_lower_bound(prob: Problem) -> tuple[float, float]:
    """(bytes some device needs under any assignment, bytes the largest op alone needs).

    Every op sits on some stage holding at least min(in_flight) microbatches, and the
    stages share the total: max_s memory_s >= (Σ fixed + min in-flight × Σ activations) / p.
    """
    least = min(prob.in_flight)
    per_op = prob.fixed_mem + least * prob.out_bytes
    largest = float(per_op.max())
    share = float(per_op.sum()) / prob.p
    return max(largest, share), largest
