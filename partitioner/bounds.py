"""Provable lower bounds on the best bottleneck and on the memory any assignment needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from partitioner.cost import Problem

__all__ = ["trivial_lower_bound", "named_lower_bounds", "comm_lower_bound", "neighbourhood_lower_bound",
           "broadcast_lower_bound", "memory_lower_bound"]


def named_lower_bounds(prob: Problem) -> dict[str, float]:
    """Each closed-form bound by name; every one holds for every valid assignment.

    - ``work``: Σ_s compute_s · speed_s = total work, so some stage has compute >= total / Σ speed
      (communication only adds to a stage's time);
    - ``largest op``: the largest op sits on some device, at best the fastest;
    - ``pigeonhole``: among the p + 1 largest ops two share a stage, so some stage holds at
      least the p-th and (p+1)-th largest;
    - ``communication``: :func:`comm_lower_bound`;
    - ``neighbourhood``: :func:`neighbourhood_lower_bound`;
    - ``broadcast``: :func:`broadcast_lower_bound`.

    An op's work is its least on any stage (``Problem.least_work``: its forward and
    backward, plus the recomputation every allowed choice runs).
    """
    work = prob.least_work
    fastest = float(prob.speed.max())
    top = np.sort(work)[::-1]
    bounds = {"work": float(work.sum()) / float(prob.speed.sum()),
              "largest op": float(top[0]) / fastest if prob.n else 0.0,
              "communication": comm_lower_bound(prob), "neighbourhood": neighbourhood_lower_bound(prob),
              "broadcast": broadcast_lower_bound(prob)}
    if prob.n > prob.p:
        bounds["pigeonhole"] = float(top[prob.p - 1] + top[prob.p]) / fastest
    return bounds


def trivial_lower_bound(prob: Problem) -> float:
    """The largest of :func:`named_lower_bounds`."""
    return max(named_lower_bounds(prob).values())


def comm_lower_bound(prob: Problem) -> float:
    """(total work + the least communication any p-stage assignment pays) / Σ speeds.

    Take any valid assignment and a topological order. The first op v of a stage has all
    its producers on earlier stages, and each producer that outputs bytes is a transfer
    into the stage of its own: the stage pays at least v's incoming cost, the sum over
    its producers of ``directions`` x (bytes / fastest bandwidth + least latency). It pays
    nothing only if v is a "free source" (no producer outputs bytes). Likewise the last
    op w of a stage sends its output to a later stage unless it has no consumer or
    outputs nothing (a "free sink"). So at least p - #free sources stages pay the least
    incoming cost of a non-free op, and p - #free sinks stages the least outgoing one.
    With time_s = compute_s / speed_s + comm_s <= B on every stage,
    B x Σ speed >= total work + min speed x Σ comm.
    """
    if prob.p < 2:
        return 0.0
    upper = np.triu_indices(prob.p, 1)
    max_bw = float(prob.bw[upper].max())
    min_lat = float(prob.lat[upper].min())
    out = prob.out_bytes
    send = [prob.directions * (float(out[i]) / max_bw + min_lat) if out[i] > 0 and prob.succ[i] else 0.0
            for i in range(prob.n)]
    incoming = [sum(send[j] for j in prob.pred[i]) for i in range(prob.n)]
    paid_in = [c for c in incoming if c > 0]
    paid_out = [c for c in send if c > 0]
    if not paid_out:
        return 0.0
    free_sources = prob.n - len(paid_in)
    free_sinks = prob.n - len(paid_out)
    comm = max(0, prob.p - free_sources) * min(paid_in) + max(0, prob.p - free_sinks) * min(paid_out)
    return (float(prob.least_work.sum()) + float(prob.speed.min()) * comm) / float(prob.speed.sum())


def neighbourhood_lower_bound(prob: Problem) -> float:
    """max over ops v of what the stage holding v pays for v and its neighbours, at least.

    Each producer u of v is either on v's stage (its work counts there) or not (then v's
    stage receives u's output: a transfer priced on the fastest link); and either every
    consumer of v is on v's stage (their work counts) or v's output is sent at least once.
    These are distinct terms of that stage's time, so it is at least
    work(v) + Σ_u min(work(u), recv(u)) + min(Σ_w work(w), send(v)), work at the fastest
    device's speed. The largest op plus what it cannot shed: it lifts the bound where one
    op (an LM head, an embedding) dominates the bottleneck.
    """
    fastest = float(prob.speed.max())
    work = prob.least_work / fastest
    if prob.p > 1:
        upper = np.triu_indices(prob.p, 1)
        max_bw, min_lat = float(prob.bw[upper].max()), float(prob.lat[upper].min())
        out = prob.out_bytes
        transfer = np.where(out > 0, prob.directions * (out / max_bw + min_lat), 0.0)
    else:
        transfer = np.full(prob.n, np.inf)  # one stage: nothing can leave it
    best = 0.0
    for v in range(prob.n):
        producers = sum(min(work[u], transfer[u]) for u in prob.pred[v])
        consumers = min(sum(work[w] for w in prob.succ[v]), transfer[v]) if prob.succ[v] else 0.0
        best = max(best, work[v] + producers + consumers)
    return float(best)


def broadcast_lower_bound(prob: Problem) -> float:
    """The least B at which the tensors read by a chain of consumers (a position bias, an encoder
    output read by every layer) can reach them all, summed over the stages.

    Let ``c_1 → … → c_m`` be consumers of one tensor, each reachable from the one before. Two
    of them share a stage only with every op on the paths between them (stages are convex),
    so a stage holding ``c_a..c_b`` holds their hull, and at bottleneck B its work is at
    most B × the fastest speed: the consumers need at least ``g(B)`` stages, the fewest
    intervals of the chain whose hulls fit (greedy is exact for intervals). The tensor is
    then sent to at least ``g(B) − 1`` stages, each copy paid by sender and receiver, at
    least ``directions × (bytes / fastest bandwidth + least latency)``. Summing over
    tensors as :func:`comm_lower_bound` does, ``B × Σ speed >= total work + min speed ×
    Σ 2 (g(B) − 1) × copy``; both sides move with B, so the bound is the least B that
    satisfies it (bisection; g only falls as B grows).
    """
    if prob.p < 2:
        return 0.0
    chains = _consumer_chains(prob)
    if not chains:
        return 0.0
    upper = np.triu_indices(prob.p, 1)
    max_bw, min_lat = float(prob.bw[upper].max()), float(prob.lat[upper].min())
    fastest, total_speed, slowest = float(prob.speed.max()), float(prob.speed.sum()), float(prob.speed.min())
    work = float(prob.least_work.sum())
    copies = [(2 * prob.directions * (float(prob.out_bytes[u]) / max_bw + min_lat), hulls)
              for u, hulls in chains]

    def shortfall(bound: float) -> float:
        """How far ``bound`` is below what the stages must hold at that bottleneck (> 0: too low)."""
        cap = bound * fastest
        comm = 0.0
        for copy, hulls in copies:
            groups, start = 1, 0
            for b in range(1, len(hulls)):
                if hulls[start][b] > cap:  # c_start..c_b cannot share a stage: a new one starts at b
                    groups, start = groups + 1, b
            comm += (groups - 1) * copy
        return (work + slowest * comm) / total_speed - bound

    low, high = work / total_speed, work / total_speed + sum(c * len(h) for c, h in copies)
    if shortfall(low) <= 0:
        return low
    for _ in range(60):  # to a part in 10^18 of the range: the bound is as tight as floats allow
        mid = 0.5 * (low + high)
        low, high = (mid, high) if shortfall(mid) > 0 else (low, mid)
    return high


def _consumer_chains(prob: Problem) -> list[tuple[int, list[list[float]]]]:
    """Per tensor read by a chain of two or more consumers: (producer, hull work of c_a..c_b for a <= b).

    The chain is greedy in program order (each consumer kept when reachable from the last kept):
    any chain of consumers gives a valid bound. Reachability as bitsets of ancestors and
    descendants, one pass each; a hull is ``descendants(c_a) & ancestors(c_b)`` with both ends.
    """
    n = prob.n
    candidates = [u for u in range(n) if prob.out_bytes[u] > 0 and len(prob.succ[u]) > 1]
    if not candidates:
        return []
    ancestors, descendants = [0] * n, [0] * n
    for v in range(n):  # positions are a topological order
        for u in prob.pred[v]:
            ancestors[v] |= ancestors[u] | (1 << u)
    for v in range(n - 1, -1, -1):
        for w in prob.succ[v]:
            descendants[v] |= descendants[w] | (1 << w)
    work = prob.least_work
    nbytes = (n + 7) // 8

    def mass(mask: int) -> float:
        bits = np.unpackbits(np.frombuffer(mask.to_bytes(nbytes, "little"), dtype=np.uint8), bitorder="little")
        return float(work @ bits[:n])

    out = []
    budget = _BROADCAST_HULLS
    for u in sorted(candidates, key=lambda u: -prob.out_bytes[u]):  # the largest tensors first
        chain: list[int] = []
        for c in sorted(prob.succ[u]):
            if not chain or (ancestors[c] >> chain[-1]) & 1:
                chain.append(c)
        if len(chain) > _BROADCAST_CHAIN:  # an evenly spread sub-chain is a chain too
            chain = [chain[round(k * (len(chain) - 1) / (_BROADCAST_CHAIN - 1))] for k in range(_BROADCAST_CHAIN)]
        if len(chain) < 2 or len(chain) ** 2 > budget:
            continue
        budget -= len(chain) ** 2
        hulls = [[mass((descendants[ca] & ancestors[cb]) | (1 << ca) | (1 << cb)) for cb in chain] for ca in chain]
        out.append((u, hulls))
    return out


#: Consumers kept per chain, and hulls weighed over all tensors: a count, so the bound costs the
#: same on any machine (about 0.2 s at 9,000 ops).
_BROADCAST_CHAIN = 16
_BROADCAST_HULLS = 4_000


def memory_lower_bound(prob: Problem) -> tuple[float, float]:
    """(bytes some device needs under any assignment, bytes the largest op alone needs).

    Every op sits on some stage holding at least min(in_flight) microbatches (and
    recomputing at least min(recomputing)) under one of the stages' allowed recomputation
    choices; a stage's memory is at least the sum over its ops of their least share, and
    the stages share the total: max_s memory_s >= Σ_v least_v / p. A stage's memory is
    also at least its state and optimizer-step workspace (``step_mem``), shared the same way.
    """
    least, least_rec = min(prob.in_flight), min(prob.recomputing)
    union = {c for opts in prob.choices for c in opts}
    per_op = prob.fixed_mem + np.min([least * prob.rec.kept[c] + least_rec * prob.rec.remade[c] for c in union],
                                     axis=0)
    largest = float(np.maximum(per_op, prob.step_mem).max())
    share = max(float(per_op.sum()), float(prob.step_mem.sum())) / prob.p  # max(Σ, Σ), not Σ max
    return max(largest, share), largest
