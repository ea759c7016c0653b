"""A lower bound from stages taken in groups: CP-SAT on an aggregated model small enough to solve.

CP-SAT's model of the whole problem (one 0/1 variable per op and stage) proves little on
graphs whose stages pay for many tensors (random layered DAGs, T5): its linear relaxation
spreads every op over all stages and pays no communication. This relaxation keeps the
communication and drops the detail instead. Split the p stages into G groups of
consecutive stages (stages ``b_{j-1} .. b_j - 1``). In any valid plan the ops of groups 1..j
form an ideal ``I_j`` (closed under producers), ``I_1 ⊆ … ⊆ I_{G-1}``; group j holds
``I_j \\ I_{j-1}``. Every tensor made in group j is sent by a stage of group j at least once to
each later group that reads it (a copy goes to every consuming stage, and the groups' stages
are distinct); every tensor read in group j and made in an earlier group is
received at least once by a stage of group j, each transfer priced at least at
``directions × (bytes / fastest link + least latency)`` between the groups. As in
:func:`partitioner.bounds.comm_lower_bound`, a stage's time is compute / speed + what it
pays to send and receive, so at bottleneck B::

    B × Σ_{s in group j} speed_s  >=  work(group j) + min_{s in j} speed_s × (its sends + receives)

for every group at once. The least B over every chain of ideals is a lower bound on every
valid plan; CP-SAT's proven bound on it (``BestObjectiveBound``) is one too, solved or not.
Four groups keep the model to 3 ideals and prove where one group per stage (still a relaxation:
memory and colocation dropped, each receive priced on the fastest link from any earlier stage)
does not: on the random layered DAG of 100 ops at 8 stages the bound rises
from 0.767 (closed-form) to 0.902 ms in 2.4-6.7 deterministic seconds, where the full model
stays at 0.753 after 20; on T5-small at 8 stages from 0.339 to 0.380 ms. Over 750 ops ``auto``
asks for two groups (one boundary), which finish where four do not.

Integers round in the direction that keeps the bound valid: work and prices down, the speed
sum up, and one unit is taken off the result.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from partitioner.problem import Problem
from partitioner.solve.cpsat_model import NS_PER_SECOND, least_end_price, proof_solver

__all__ = ["GROUPS", "GroupBound", "group_lower_bound"]

#: How many groups of consecutive stages by default (fewer when there are fewer stages).
GROUPS = 4
_SPEED = 1000  # speeds to integer thousandths


@dataclass
class GroupBound:
    """The bound, the groups' first stages, how the solve ended, and the grouped model's least bottleneck found
    (``relaxed``, inf where none was: no bound from these groups can exceed it)."""

    lower_bound: float
    starts: tuple[int, ...]
    status: str
    deterministic_seconds: float
    wall_stopped: bool
    relaxed: float = math.inf


def group_lower_bound(prob: Problem, *, budget: float, wall_limit: float, groups: int = GROUPS,
                      starts: Sequence[int] | None = None, hint: Sequence[int] | None = None, workers: int = 1,
                      seed: int = 0) -> GroupBound | None:
    """The least bottleneck of the grouped model (see the module docstring) with ``groups`` groups (fewer
    under that many stages) spread evenly, or the groups whose first stages are ``starts``; None under 2 stages.

    ``hint``: a plan (stage of each op), whose groups start the search: a good solution early
    lets CP-SAT prove the least one sooner."""
    p = prob.p
    if p < 2:
        return None
    t0 = time.perf_counter()
    if starts is not None:
        if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= p:
            raise ValueError(f"group starts {list(starts)}: give increasing first stages from 0, each below {p}")
        cuts = [*starts, p]
    else:
        g = min(groups, p)
        cuts = [round(j * p / g) for j in range(g + 1)]  # group j: stages cuts[j] .. cuts[j + 1] - 1
    g = len(cuts) - 1
    m = cp_model.CpModel()
    # inside[j][v]: v is in the first j groups (inside[0] empty, inside[g] everything)
    inside = [[m.NewConstant(0)] * prob.n]
    inside += [[m.NewBoolVar("") for _ in range(prob.n)] for _ in range(g - 1)]
    inside += [[m.NewConstant(1)] * prob.n]
    for j in range(1, g):
        for u in range(prob.n):
            for c in prob.succ[u]:
                m.Add(inside[j][c] <= inside[j][u])  # an ideal: a consumer inside means its producer is
            if j > 1:
                m.Add(inside[j - 1][u] <= inside[j][u])
    sent = [u for u in range(prob.n) if prob.out_bytes[u] > 0 and prob.succ[u]]
    ops = [v for v in range(prob.n) if not prob.is_output[v]]
    work = [math.floor(float(w) * NS_PER_SECOND) for w in prob.least_work]
    total = sum(work)
    per_group = []  # (its speed sum, its slowest speed, its work, what it pays), integers
    for j in range(g):
        lo, hi = cuts[j], cuts[j + 1]
        pays = []
        for k in range(j + 1, g):  # sends: one copy to each later group that reads the tensor
            pays += [(least_end_price(prob, u, slice(lo, hi), slice(cuts[k], cuts[k + 1])),
                      _sends(m, inside, j, k, u, prob.succ[u])) for u in sent]
        if j > 0:  # receives from the earlier groups
            pays += [(least_end_price(prob, u, slice(0, lo), slice(lo, hi)), _receives(m, inside, j, u, prob.succ[u]))
                     for u in sent]
        held = sum(work[v] * (inside[j + 1][v] - inside[j][v]) for v in range(prob.n))
        # every stage holds an op other than the model's output node
        m.Add(sum(inside[j + 1][v] - inside[j][v] for v in ops) >= hi - lo)
        per_group.append((math.ceil(float(prob.speed[lo:hi].sum()) * _SPEED),
                       math.floor(float(prob.speed[lo:hi].min()) * _SPEED), held, pays))
    # A domain above any group's need (all the work, every transfer paid): it must not cut off the optimum.
    most = max((_SPEED * total + slowest * sum(price for price, _ in pays)) // speed_sum + 1
               for speed_sum, slowest, _, pays in per_group)
    bottleneck = m.NewIntVar(0, most, "bottleneck")
    for speed_sum, slowest, held, pays in per_group:
        m.Add(speed_sum * bottleneck >= _SPEED * held + slowest * sum(price * lit for price, lit in pays))
    m.Minimize(bottleneck)
    if hint is not None:
        for j in range(1, g):
            for v in range(prob.n):
                m.AddHint(inside[j][v], int(hint[v] < cuts[j]))
    solver = proof_solver(budget=budget, wall_left=wall_limit - (time.perf_counter() - t0), workers=workers,
                          seed=seed)
    # Only the bound is wanted, and a stronger relaxation proves it: at the default level CP-SAT solved
    # T5-small at 8 stages from one starting plan in 5 deterministic seconds and from two others not in 15;
    # at level 2 from all three in 1.6-7 (docs/optimizer.md).
    solver.parameters.linearization_level = 2
    status = solver.Solve(m)
    det = float(solver.response_proto.deterministic_time)
    done = status in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    bound = max(0.0, (solver.BestObjectiveBound() - 1) / NS_PER_SECOND) if found else 0.0
    # The best grouped plan found: no bound this model reports (its proven bound less a unit) can exceed it
    relaxed = solver.ObjectiveValue() / NS_PER_SECOND if found else math.inf
    return GroupBound(bound, tuple(cuts[:-1]), solver.StatusName(status), det, not done and det < budget * 0.99,
                      relaxed)


def _sends(m: cp_model.CpModel, inside: list, j: int, k: int, u: int, consumers: list[int]) -> cp_model.IntVar:
    """1 if group j holds u and group k (a later one) holds a consumer."""
    lit = m.NewBoolVar("")
    for c in consumers:
        m.Add(lit >= inside[j + 1][u] - inside[j][u] + inside[k + 1][c] - inside[k][c] - 1)
    return lit


def _receives(m: cp_model.CpModel, inside: list, j: int, u: int, consumers: list[int]) -> cp_model.IntVar:
    """1 if an earlier group holds u and some consumer is in group j."""
    lit = m.NewBoolVar("")
    for c in consumers:
        m.Add(lit >= inside[j][u] + inside[j + 1][c] - inside[j][c] - 1)
    return lit
