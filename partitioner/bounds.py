"""Provable lower bounds on the best bottleneck and on the memory any assignment needs."""

from __future__ import annotations

import math
import weakref

import numpy as np

from partitioner.problem import Problem

__all__ = ["trivial_lower_bound", "named_bounds", "strongest_bound", "named_lower_bounds", "comm_lower_bound",
           "neighbourhood_lower_bound", "broadcast_lower_bound", "memory_lower_bound", "cheapest_links",
           "ConsumerChains", "consumer_chains", "closures", "masked_sum"]

#: Per problem, while it lives, its closed-form bounds and its consumer chains: the problem's alone, so computed
#: once (the solvers each start from them, and a search prices hundreds of partitions of one problem; at 9,000 ops
#: the bounds take about 1 s, the chains about 0.25 s).
_NAMED_BOUNDS: weakref.WeakKeyDictionary[Problem, dict[str, float]] = weakref.WeakKeyDictionary()
_CONSUMER_CHAINS: weakref.WeakKeyDictionary[Problem, ConsumerChains] = weakref.WeakKeyDictionary()


def named_bounds(prob: Problem) -> dict[str, float]:
    """:func:`named_lower_bounds` of ``prob``, computed once per problem (a copy each call)."""
    if prob not in _NAMED_BOUNDS:
        _NAMED_BOUNDS[prob] = named_lower_bounds(prob)
    return dict(_NAMED_BOUNDS[prob])


def strongest_bound(prob: Problem) -> tuple[str, float]:
    """(name, value) of the strongest of :func:`named_bounds`."""
    return max(named_bounds(prob).items(), key=lambda kv: kv[1])


def consumer_chains(prob: Problem) -> ConsumerChains:
    """The chains of consumers of each tensor read on several stages (:class:`ConsumerChains`), read by the
    ``broadcast`` bound and the ideal DP: built once per problem."""
    if prob not in _CONSUMER_CHAINS:
        _CONSUMER_CHAINS[prob] = ConsumerChains(prob)
    return _CONSUMER_CHAINS[prob]


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
    """The largest of :func:`named_lower_bounds` (computed once per problem: :func:`named_bounds`)."""
    return max(named_bounds(prob).values())


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
    output read by every layer) can reach them all: summed over the stages, and at their sender.

    Let ``c_1 → … → c_m`` be consumers of one tensor ``u``, each reachable from the one before.
    Two of them share a stage only with every op on the paths between them (stages are
    convex), so a stage holding ``c_a..c_b`` holds their hull, and at bottleneck B its work is
    at most B × the fastest speed: the consumers span at least ``g(B)`` stages, the fewest
    intervals of the chain whose hulls fit (greedy is exact for intervals). Consumers on one
    stage are contiguous in the chain, so at most one interval shares ``u``'s stage ``a`` and
    ``u`` is sent to at least ``g(B) − 1`` distinct later stages ``t``, each copy costing
    ``directions × (bytes / bandwidth(a, t) + latency(a, t))`` at each end. Whatever ``a`` is,
    those copies cost at least the ``g(B) − 1`` cheapest links out of ``a`` (``a`` needs that
    many later stages), which on a cluster of nodes prices the copies that must cross a node
    boundary on the network. Two conditions follow, each solved for the least B:

    - *summed*: ``B × Σ speed >= total work + min speed × Σ_u 2 × copies_u(B)``, as
      :func:`comm_lower_bound` argues;
    - *at the sender*: ``B >= work(u) / speed(a) + copies_u(B)`` for some stage ``a``: the stage
      holding ``u`` computes it and sends every copy (an encoder output sent to 30 decoder
      stages is the bottleneck of its sender).

    Both sides move with B and ``g`` only falls as B grows, so the bound is found by bisection.
    """
    if prob.p < 2:
        return 0.0
    chains = consumer_chains(prob)
    if not chains.tensors:
        return 0.0
    fastest, total_speed, slowest = float(prob.speed.max()), float(prob.speed.sum()), float(prob.speed.min())
    work = float(prob.least_work.sum())
    per_byte, per_tensor = cheapest_links(prob)
    upstream = [chains.upstream(u) for u in chains.tensors]

    def shortfall(bound: float) -> float:
        """How far ``bound`` is below what the conditions need at that bottleneck (> 0: too low)."""
        cap = bound * fastest
        summed, sender = 0.0, 0.0
        for k, u in enumerate(chains.tensors):
            copies = chains.groups(k, cap) - 1
            if copies <= 0:
                continue
            if copies >= prob.p:  # more stages than there are
                return math.inf
            # Per sender stage; inf where too few stages follow it.
            cost = float(prob.out_bytes[u]) * per_byte[:, copies] + per_tensor[:, copies]
            # Stages 0..a hold u and all its ancestors, each at most cap: a is at least this.
            cost[:max(0, math.ceil(upstream[k] / cap * (1 - 1e-12)) - 1)] = math.inf
            summed += 2 * float(cost.min())
            sender = max(sender, float((prob.least_work[u] / prob.speed + cost).min()))
        return max((work + slowest * summed) / total_speed, sender) - bound

    low = work / total_speed
    high = work / slowest  # every hull fits a stage at this B: no copy is forced
    if shortfall(low) <= 0:
        return low
    for _ in range(60):  # to a part in 10^18 of the range: as tight as floats allow
        mid = 0.5 * (low + high)
        low, high = (mid, high) if shortfall(mid) > 0 else (low, mid)
    return low  # shortfall(low) > 0: no plan has a bottleneck of low or less


def cheapest_links(prob: Problem) -> tuple[np.ndarray, np.ndarray]:
    """[a, j]: the least per-byte and per-tensor price of j copies sent from stage a to j distinct
    later stages, one end (inf where fewer than j stages follow a).

    The j cheapest of ``bytes × per_byte + per_tensor`` cost at least the j smallest per-byte
    prices times the bytes plus the j smallest per-tensor prices (exact when the slower link is
    also the later one, as across the nodes of a cluster), so one table serves every tensor.
    """
    p = prob.p
    later = np.triu(np.ones((p, p), dtype=bool), 1)
    tables = []
    for price in (prob.directions / np.where(later, prob.bw, 1.0), prob.directions * prob.lat):
        table = np.full((p, p), np.inf)
        table[:, 0] = 0.0
        table[:, 1:] = np.cumsum(np.sort(np.where(later, price, np.inf), axis=1)[:, :p - 1], axis=1)
        tables.append(table)
    return tables[0], tables[1]


class ConsumerChains:
    """Per tensor read by a chain of two or more consumers, the fewest stages the chain spans at a cap.

    The chain is greedy in program order (each consumer kept when reachable from the last kept):
    any chain of consumers gives a valid bound. A hull is ``descendants(c_a) & ancestors(c_b)``
    with both ends. On a short chain (up to ``_EXACT_CHAIN`` consumers) every hull is weighed.
    On a longer one only the consecutive hulls ``c_i..c_{i+1}``: a hull ``c_a..c_b`` holds them
    all and they meet only at their shared ends (an op in two of them would close a cycle), so
    its work is at least their sum less the shared ends, a lower estimate read off prefix
    sums; it can only lower the count of stages, so the bound stays valid, and it is exact
    where every path from one consumer to a later one runs through those between (a residual
    stream). At most ``_BROADCAST_HULLS`` hulls are weighed, largest tensors first: a count,
    so the bound is the same on any machine.
    """

    def __init__(self, prob: Problem):
        n = prob.n
        self.tensors: list[int] = []
        self.chains: list[list[int]] = []  # per tensor, its chain of consumers in program order
        self.starts: list[np.ndarray] = []  # per chain, X[a]: the estimate of c_0..c_a less c_a's own work
        self.ends: list[np.ndarray] = []  # per chain, Y[b] = X[b] + work(c_b); est(a, b) = Y[b] - X[a]
        self.exact: list[list[list[float]] | None] = []  # per short chain, every hull's work
        candidates = [u for u in range(n) if prob.out_bytes[u] > 0 and len(prob.succ[u]) > 1]
        if not candidates:
            return
        self.ancestors, self.descendants = closures(prob)
        self.work = prob.least_work
        budget = _BROADCAST_HULLS
        for u in sorted(candidates, key=lambda u: -prob.out_bytes[u]):  # the largest tensors first
            chain: list[int] = []
            for c in sorted(prob.succ[u]):
                if not chain or (self.ancestors[c] >> chain[-1]) & 1:
                    chain.append(c)
            if len(chain) > _BROADCAST_CHAIN:  # an evenly spread sub-chain is a chain too
                chain = [chain[round(k * (len(chain) - 1) / (_BROADCAST_CHAIN - 1))] for k in range(_BROADCAST_CHAIN)]
            m = len(chain)
            weighed = m * (m - 1) // 2 if m <= _EXACT_CHAIN else m - 1
            if m < 2 or weighed > budget:
                continue
            budget -= weighed
            self.tensors.append(u)
            self.chains.append(chain)
            if m <= _EXACT_CHAIN:
                self.exact.append([[self._hull(a, b) if j > i else 0.0 for j, b in enumerate(chain)]
                                   for i, a in enumerate(chain)])
                self.starts.append(np.empty(0))
                self.ends.append(np.empty(0))
                continue
            own = np.array([float(self.work[c]) for c in chain])
            hulls = np.array([self._hull(a, b) for a, b in zip(chain, chain[1:])])
            starts = np.concatenate([[0.0], np.cumsum(hulls - own[1:])])
            self.exact.append(None)
            self.starts.append(starts)
            self.ends.append(np.maximum.accumulate(starts + own))

    def upstream(self, u: int) -> float:
        """The work of ``u`` and all its ancestors."""
        return self._mass(self.ancestors[u] | (1 << u))

    def groups(self, k: int, cap: float, first: int = 0) -> int:
        """The fewest intervals of chain ``k`` from its consumer ``first`` on whose hulls each weigh at
        most ``cap`` (greedy, on the lower estimates; the 1e-9 slack absorbs the prefix sums' rounding)."""
        if first >= len(self.chains[k]):
            return 0
        exact = self.exact[k]
        if exact is not None:
            groups, start = 1, first
            for b in range(first + 1, len(exact)):
                if exact[start][b] > cap:  # c_start..c_b cannot share a stage: a new one starts at b
                    groups, start = groups + 1, b
            return groups
        starts, ends = self.starts[k], self.ends[k]
        m, groups, a = len(ends), 1, first
        while True:
            b = max(a + 1, int(np.searchsorted(ends, starts[a] + cap * (1 + 1e-9), side="right")))
            if b >= m:
                return groups
            groups, a = groups + 1, b  # c_a..c_b cannot share a stage: a new one starts at b

    def _hull(self, a: int, b: int) -> float:
        return self._mass((self.descendants[a] & self.ancestors[b]) | (1 << a) | (1 << b))

    def _mass(self, mask: int) -> float:
        return float(masked_sum(self.work, mask))


def closures(prob: Problem) -> tuple[list[int], list[int]]:
    """Per op, its ancestors and its descendants (itself left out), as bitsets over positions."""
    n = prob.n
    ancestors, descendants = [0] * n, [0] * n
    for v in range(n):  # positions are a topological order
        for u in prob.pred[v]:
            ancestors[v] |= ancestors[u] | (1 << u)
    for v in range(n - 1, -1, -1):
        for w in prob.succ[v]:
            descendants[v] |= descendants[w] | (1 << w)
    return ancestors, descendants


def masked_sum(values: np.ndarray, mask: int) -> np.generic:
    """The sum of ``values`` at the positions set in the bitset ``mask`` (in ``values``' dtype)."""
    nbytes = (len(values) + 7) // 8
    bits = np.unpackbits(np.frombuffer(mask.to_bytes(nbytes, "little"), dtype=np.uint8), bitorder="little")
    return values @ bits[:len(values)]


#: Consumers kept per chain (evenly spread), the longest chain whose every hull is weighed, and
#: hulls weighed over all tensors: counts, so the bound costs the same on any machine.
_BROADCAST_CHAIN = 128
_EXACT_CHAIN = 8
_BROADCAST_HULLS = 12_000


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
