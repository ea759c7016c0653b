"""Pipeline schedule generators (GPipe, 1F1B, interleaved 1F1B, ZB-H1): per-rank action lists with transfers.

Each generator first fixes every rank's order of compute actions (which depends only on
the stage count, the microbatches and the layout, never on the model), then places the
SEND/RECV actions so that the lists walk without deadlock (:mod:`partitioner.walk`).
The IR types live in :mod:`partitioner.ir` and are re-exported here.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from partitioner.checks import whole
from partitioner.errors import PlanError
from partitioner.ir import (
    COLLECTIVE_KINDS,
    Action,
    ActionKind,
    Edge,
    Schedule,
    ScheduleError,
    ScheduleKind,
    StageGraph,
    made_action,
    stage_graph_from_transfers,
)
from partitioner.walk import Walk, gc_paused, peak_held, validate, walk

__all__ = [
    "ActionKind",
    "Action",
    "Edge",
    "StageGraph",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "stage_graph_from_transfers",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "make_schedule",
    "with_allreduce",
    "compute_orders",
    "peak_in_flight",
    "SCHEDULES",
    "CAPPABLE",
    "check_active_microbatches",
]

Orders = list[list[Action]]


def _F(s: int, mb: int) -> Action:
    return made_action(ActionKind.F, s, mb)


def _B(s: int, mb: int) -> Action:
    return made_action(ActionKind.B, s, mb)


def _W(s: int, mb: int) -> Action:
    return made_action(ActionKind.W, s, mb)


def _as_graph(graph: StageGraph | int) -> StageGraph:
    return StageGraph.chain(graph) if isinstance(graph, int) else graph


def _with_w(order: list[Action], split: bool) -> list[Action]:
    """Put W(s, mb) right after each B(s, mb) when the backward is split but W is not deferred."""
    if not split:
        return order
    out: list[Action] = []
    for a in order:
        out.append(a)
        if a.kind is ActionKind.B:
            out.append(_W(a.stage, a.mb))
    return out


# --------------------------------------------------------------------------- compute orders


def _warm_then_alternate(s: int, warm: int, m: int) -> list[Action]:
    """``warm`` forwards, then one forward and one backward at a time, then the remaining backwards:
    at most ``warm + 1`` microbatches in flight."""
    warm = min(warm, m)
    order = [_F(s, k) for k in range(warm)]
    for k in range(m - warm):
        order.append(_F(s, warm + k))
        order.append(_B(s, k))
    order.extend(_B(s, k) for k in range(m - warm, m))
    return order


def _gpipe_orders(S: int, m: int, split: bool, active: int | None = None) -> Orders:
    if active is not None and active < m:  # SMP v1's "simple" pipeline under active_microbatches
        # Stage s holds max(K - s, min(S - s, K)): never more than K, and one fewer than the stage
        # before it where K allows. Equal warm-ups would make each later forward wait for a
        # backward's round trip (4 stages, K = 4: 2.9x 1F1B's step); decreasing ones keep the
        # pipe full (K >= S: 1F1B's step). With K <= S this is the capped 1f1b.
        return [_with_w(_warm_then_alternate(s, max(active - s, min(S - s, active)) - 1, m), split)
                for s in range(S)]
    return [_with_w([_F(s, k) for k in range(m)] + [_B(s, k) for k in range(m)], split) for s in range(S)]


def _one_f_one_b_orders(S: int, m: int, split: bool, active: int | None = None) -> Orders:
    cap = S if active is None else active
    return [_with_w(_warm_then_alternate(s, min(S - s, cap) - 1, m), split) for s in range(S)]


def _interleaved_orders(S: int, m: int, p: int, split: bool) -> Orders:
    if p < 1 or S % p != 0:
        raise ValueError(f"interleaved_1f1b needs num_stages ({S}) to be a multiple of num_ranks ({p})")
    v = S // p
    # rounds of microbatches, each of size >= p (except when m < p: one round of m)
    n_rounds = max(1, m // p)
    sizes = [m // n_rounds + (1 if i < m % n_rounds else 0) for i in range(n_rounds)]
    fwd_seq: list[tuple[int, int]] = []  # (chunk, mb)
    bwd_seq: list[tuple[int, int]] = []
    first = 0
    for size in sizes:
        mbs = range(first, first + size)
        for chunk in range(v):
            fwd_seq.extend((chunk, k) for k in mbs)
        for chunk in reversed(range(v)):
            bwd_seq.extend((chunk, k) for k in mbs)
        first += size
    total = m * v
    orders = []
    for r in range(p):
        # Megatron's warm-up; with v = 1 it is plain 1F1B's p - 1 - r
        extra = 2 * (p - 1 - r) if v > 1 else p - 1 - r
        warm = min((v - 1) * sizes[0] + extra, total)
        fw = [_F(c * p + r, k) for c, k in fwd_seq]
        bw = [_B(c * p + r, k) for c, k in bwd_seq]
        order = fw[:warm]
        for i in range(total - warm):
            order.append(fw[warm + i])
            order.append(bw[i])
        order.extend(bw[total - warm:])
        orders.append(_with_w(order, split))
    return orders


def _zb_h1_orders(S: int, m: int) -> Orders:
    orders = []
    for i in range(S):
        warm = min(S - i - 1, m)
        order = [_F(i, k) for k in range(warm)]
        w = 0
        for k in range(m):
            if warm + k < m:
                order.append(_F(i, warm + k))
            order.append(_B(i, k))
            if k >= i:
                order.append(_W(i, w))
                w += 1
        order.extend(_W(i, k) for k in range(w, m))
        orders.append(order)
    return orders


def check_active_microbatches(kind: ScheduleKind | str, active_microbatches: int | None) -> None:
    """Refuse a cap on microbatches in flight (per stage) that is no whole number >= 1 or that the schedule kind
    cannot take, naming what can (a :class:`PlanError`, a ValueError)."""
    if active_microbatches is None:
        return
    kind = ScheduleKind.parse(kind)
    whole(active_microbatches, "active_microbatches")
    if kind not in CAPPABLE:
        raise PlanError(f"active_microbatches caps the warm-up of gpipe and 1f1b; {kind.value} fixes its own "
                         f"(its memory rule is in docs/schedules.md): use the 1f1b or gpipe schedule with the cap, "
                         "or drop it")


def compute_orders(kind: ScheduleKind | str, num_stages: int, num_microbatches: int, *,
                   num_ranks: int | None = None, active_microbatches: int | None = None
                   ) -> tuple[Orders, list[int]]:
    """Every rank's compute actions in order, and the rank of each stage, for a generated schedule.

    Depends only on the schedule kind, the stage count, the microbatches, (interleaved) the
    rank count and the cap on microbatches in flight: the same for every model, which is what
    lets the cost model read its memory rule off the schedule (:func:`peak_in_flight`) before
    any partition exists.
    """
    kind = ScheduleKind.parse(kind)
    S, m = num_stages, num_microbatches
    whole(m, "num_microbatches")
    check_active_microbatches(kind, active_microbatches)
    if kind is ScheduleKind.INTERLEAVED:
        p = num_ranks if num_ranks is not None else S
        return _interleaved_orders(S, m, p, False), [s % p for s in range(S)]
    if kind is ScheduleKind.GPIPE:
        return _gpipe_orders(S, m, False, active_microbatches), list(range(S))
    if kind is ScheduleKind.ONE_F_ONE_B:
        return _one_f_one_b_orders(S, m, False, active_microbatches), list(range(S))
    return _zb_h1_orders(S, m), list(range(S))


def peak_in_flight(kind: ScheduleKind | str, num_stages: int, num_microbatches: int, *,
                   num_ranks: int | None = None, training: bool = True,
                   active_microbatches: int | None = None) -> list[int]:
    """Most microbatches each stage holds activations for at once (F done, its last backward action not).

    Counted on the schedule's own compute orders (:func:`~partitioner.walk.peak_held`, the
    fold the simulator runs on whole programs), so it is exact for every kind: GPipe holds
    all m, 1F1B and ZB-H1 min(m, p - stage), interleaved 1F1B what Megatron's warm-up leaves
    in flight; a cap (``active_microbatches``) at most that many. Inference keeps one.
    """
    if not training:
        return [1] * num_stages
    return list(_peak_in_flight(ScheduleKind.parse(kind), num_stages, num_microbatches, num_ranks,
                                active_microbatches))


@functools.lru_cache(maxsize=256)
def _peak_in_flight(kind: ScheduleKind, num_stages: int, num_microbatches: int, num_ranks: int | None,
                    active_microbatches: int | None) -> tuple[int, ...]:
    """:func:`peak_in_flight` of a training step, once per schedule (a shape search builds a problem of the same
    schedule several times: each sharding mode, each recomputation rescue; at 32 stages x 256 microbatches the
    orders take a tenth of a second)."""
    orders, _ = compute_orders(kind, num_stages, num_microbatches, num_ranks=num_ranks,
                               active_microbatches=active_microbatches)
    return tuple(peak_held(orders, num_stages, kind.split_backward))


# --------------------------------------------------------------------------- transfers


@gc_paused()  # ~10^5 acyclic objects (see gc_paused)
def _insert_transfers(graph: StageGraph, stage_to_rank: Sequence[int], orders: Sequence[Sequence[Action]],
                      split: bool) -> tuple[tuple[Action, ...], ...]:
    """Add SEND/RECV actions so that the programs are deadlock-free under rendezvous semantics.

    The compute orders are walked with unit costs (F=1, B=2 or B=W=1 when split, free
    comm). Every compute action and every transfer is then put on one global
    sequence: a transfer at the moment its producer finishes, before computes that
    start at that moment. Each rank's program is that sequence projected on the
    rank, so executing the global sequence in order is a valid run in which every
    send meets its receive: no deadlock, and sends/receives between any two ranks
    come in the same order on both sides (as NCCL requires). Sends go right after
    their producer; receives are posted early (at the time the data is produced).
    """
    bare = Schedule("orders", graph, 1 + max((a.mb for o in orders for a in o), default=0), tuple(stage_to_rank),
                    tuple(tuple(o) for o in orders), split)
    w = walk(bare, implicit_transfers=True)
    unit = {ActionKind.F: 1.0, ActionKind.B: 1.0 if split else 2.0, ActionKind.W: 1.0}
    start, end = w.times(lambda a: unit[a.kind])
    first: dict[int, int] = {}
    for i, r in enumerate(w.rank):  # ids are numbered rank by rank, in program order
        first.setdefault(r, i)
    position = [i - first[r] for i, r in enumerate(w.rank)]
    # What each stage's F and B send: (position among the stage's edges, kind, from, to, tensor), cross-rank only.
    crossing = {e for e in graph.edges if stage_to_rank[e.src] != stage_to_rank[e.dst]}
    sends: dict[tuple[ActionKind, int], list[tuple[int, ActionKind, int, int, str]]] = {}
    for s in range(graph.num_stages):
        sends[ActionKind.F, s] = [(j, ActionKind.SEND_F, e.src, e.dst, e.tensor)
                                  for j, e in enumerate(graph.out_edges(s)) if e in crossing]
        sends[ActionKind.B, s] = [(j, ActionKind.SEND_B, e.dst, e.src, e.tensor)
                                  for j, e in enumerate(graph.in_edges(s)) if e in crossing]
    events: list[tuple[float, int, int, int, int, Action]] = []
    for i, a in enumerate(w.actions):
        r = w.rank[i]
        events.append((start[i], 1, r, position[i], 0, a))
        for j, send_kind, stage, peer, tensor in sends.get((a.kind, a.stage), ()):
            events.append((end[i], 0, r, position[i], j, made_action(send_kind, stage, a.mb, peer, tensor)))
    events.sort(key=lambda ev: ev[:5])
    progs: list[list[Action]] = [[] for _ in orders]
    for *_, a in events:
        progs[stage_to_rank[a.stage]].append(a)
        if not a.is_compute:
            recv = a.matching()
            progs[stage_to_rank[recv.stage]].append(recv)
    return tuple(tuple(p) for p in progs)


def _build(kind: ScheduleKind, graph: StageGraph, m: int, stage_to_rank: Sequence[int],
           orders: Sequence[Sequence[Action]], split: bool, check: bool = True, **meta: Any) -> Schedule:
    actions = _insert_transfers(graph, stage_to_rank, orders, split)
    sched = Schedule(kind.value, graph, m, tuple(stage_to_rank), actions, split, dict(meta))
    if check:
        validate(sched)
    return sched


# --------------------------------------------------------------------------- generators


def _cap_meta(active_microbatches: int | None) -> dict[str, Any]:
    return {} if active_microbatches is None else {"active_microbatches": active_microbatches}


def gpipe(graph: StageGraph | int, num_microbatches: int, *, split_backward: bool = False,
          active_microbatches: int | None = None, check: bool = True) -> Schedule:
    """GPipe (Huang et al., 2019): all forwards, then all backwards; stage j on rank j.

    Every rank holds the activations of all m microbatches at the peak. With
    ``active_microbatches`` K < m (SMP v1's cap), stage s runs max(K - s, min(p - s, K))
    forwards, then one backward before each further forward: K in flight at most.
    """
    g = _as_graph(graph)
    whole(num_microbatches, "num_microbatches")
    check_active_microbatches(ScheduleKind.GPIPE, active_microbatches)
    orders = _gpipe_orders(g.num_stages, num_microbatches, split_backward, active_microbatches)
    return _build(ScheduleKind.GPIPE, g, num_microbatches, range(g.num_stages), orders, split_backward, check,
                  **_cap_meta(active_microbatches))


def one_f_one_b(graph: StageGraph | int, num_microbatches: int, *, split_backward: bool = False,
                active_microbatches: int | None = None, check: bool = True) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al., 2021; DAPPLE, Fan et al., 2021); stage j on rank j.

    Stage i runs min(p - i - 1, m) warm-up forwards, then alternates one forward and
    one backward, then drains the backwards: at most min(m, p - i) microbatches in
    flight, with GPipe's bubble. ``active_microbatches`` K shortens the warm-up to
    K - 1 where it is longer: at most K in flight.
    """
    g = _as_graph(graph)
    whole(num_microbatches, "num_microbatches")
    check_active_microbatches(ScheduleKind.ONE_F_ONE_B, active_microbatches)
    orders = _one_f_one_b_orders(g.num_stages, num_microbatches, split_backward, active_microbatches)
    return _build(ScheduleKind.ONE_F_ONE_B, g, num_microbatches, range(g.num_stages), orders, split_backward,
                  check, **_cap_meta(active_microbatches))


def interleaved_1f1b(graph: StageGraph | int, num_microbatches: int, num_ranks: int, *,
                     split_backward: bool = False, check: bool = True) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC'21, Megatron-LM): v = S / p virtual stages per rank.

    Stage s lives on rank s mod p (chunk s // p). Microbatches go in rounds of at
    least p: a rank runs the forwards of a round on chunk 0, then chunk 1, ... and the
    backwards of a round from the last chunk down. Rank r warms up with
    (v - 1) * round + 2 * (p - 1 - r) forwards, then alternates. The bubble shrinks
    about v-fold, at the cost of v times as many transfers.
    """
    g = _as_graph(graph)
    whole(num_microbatches, "num_microbatches")
    S, p = g.num_stages, num_ranks
    orders = _interleaved_orders(S, num_microbatches, p, split_backward)
    return _build(ScheduleKind.INTERLEAVED, g, num_microbatches, [s % p for s in range(S)], orders, split_backward,
                  check, virtual_stages=S // p)


def zb_h1(graph: StageGraph | int, num_microbatches: int, *, check: bool = True) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism"); stage j on rank j.

    1F1B with the backward split into B (input gradient, on the critical path) and W
    (weight gradient, off it). Rank i defers its W's by i microbatches: it runs
    W(k - i) after B(k), and the last i + 1 W's fill the cool-down. With F = B = W
    the bubble is (p - 1) units instead of 1F1B's 3 (p - 1): about a third. Each
    rank keeps at most p microbatches stashed (F done, W not), 1F1B's peak (which
    1F1B reaches only on stage 0).
    """
    g = _as_graph(graph)
    whole(num_microbatches, "num_microbatches")
    orders = _zb_h1_orders(g.num_stages, num_microbatches)
    return _build(ScheduleKind.ZB_H1, g, num_microbatches, range(g.num_stages), orders, True, check)


#: Each schedule kind's generator.
SCHEDULES: dict[ScheduleKind, Callable[..., Schedule]] = {
    ScheduleKind.GPIPE: gpipe,
    ScheduleKind.ONE_F_ONE_B: one_f_one_b,
    ScheduleKind.INTERLEAVED: interleaved_1f1b,
    ScheduleKind.ZB_H1: zb_h1,
}

#: The kinds a cap on microbatches in flight (``active_microbatches``) applies to.
CAPPABLE = (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B)


def make_schedule(kind: ScheduleKind | str, graph: StageGraph | int, num_microbatches: int, *,
                  num_ranks: int | None = None, data_parallel: int = 1, sharding: str = "none",
                  active_microbatches: int | None = None, check: bool = True) -> Schedule:
    """Build a schedule by kind (any spelling :meth:`ScheduleKind.parse` takes); ``num_ranks`` for interleaved.

    With ``data_parallel`` > 1 replicas, each stage's gradient all-reduce is placed in its
    rank's program (:func:`with_allreduce`), under ``sharding`` (:mod:`partitioner.sharding`). ``active_microbatches`` caps the microbatches
    in flight (gpipe and 1f1b; :data:`CAPPABLE`). ``check=False`` skips the validator, for a
    caller that only simulates (the simulator walks the programs and stops at a deadlock
    itself) and builds thousands in a search; a plan's own schedule is always checked.
    """
    kind = ScheduleKind.parse(kind)
    check_active_microbatches(kind, active_microbatches)
    g = _as_graph(graph)
    ranks = (num_ranks if num_ranks is not None else g.num_stages) if kind is ScheduleKind.INTERLEAVED else None
    whole(num_microbatches, "num_microbatches")
    key = (kind, g.num_stages, tuple((e.src, e.dst) for e in g.edges), num_microbatches, ranks, data_parallel,
           sharding, active_microbatches)
    with _templates_lock:
        hit = _templates.get(key)
        if hit is not None:
            _templates.move_to_end(key)
    if hit is not None:
        template, checked = hit
        sched = _relabelled(template, g)
        if check and not checked:
            validate(sched)  # valid under one naming of the cut tensors, valid under every other
            with _templates_lock:
                _templates[key] = (template, True)
        return sched
    if data_parallel > 1:  # one replica's programs (a template too: each sharding mode and the refinement share it)
        sched = with_allreduce(make_schedule(kind, g, num_microbatches, num_ranks=num_ranks,
                                             active_microbatches=active_microbatches, check=check),
                               data_parallel, sharding=sharding)
    elif kind is ScheduleKind.INTERLEAVED:
        sched = interleaved_1f1b(g, num_microbatches, ranks, check=check)  # type: ignore[arg-type]
    elif kind in CAPPABLE:
        sched = SCHEDULES[kind](g, num_microbatches, active_microbatches=active_microbatches, check=check)
    else:
        sched = SCHEDULES[kind](g, num_microbatches, check=check)
    with _templates_lock:
        _templates[key] = (sched, check)
        while len(_templates) > TEMPLATES_KEPT:
            _templates.popitem(last=False)
    return sched


#: Schedules kept as templates (least recently used dropped): a plan search builds the same
#: programs again and again for cuts that differ only in which tensors cross them (the step-time
#: refinement moves one op at a time; the shape search tries each layout of a shape).
TEMPLATES_KEPT = 4
_templates: OrderedDict[tuple[Any, ...], tuple[Schedule, bool]] = OrderedDict()  # key -> (schedule, validated)
_templates_lock = threading.Lock()  # the shape search solves its finalists in threads


def _relabelled(template: Schedule, graph: StageGraph) -> Schedule:
    """``template``'s programs for ``graph``: the same stage pairs in the same order, other tensors.

    A generator's programs depend on the cut tensors only through each stage's edges in
    order (what it sends after an F or B, in :meth:`StageGraph.out_edges` order), never on
    their names or sizes: the i-th edge of ``graph`` takes the i-th edge's place. The walk,
    which depends on the programs' structure alone, is the template's too.
    """
    names = {old.key: new.tensor for old, new in zip(template.graph.edges, graph.edges)}

    def renamed(a: Action) -> Action:
        if a.tensor is None:
            return a
        src, dst = (a.stage, a.peer) if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) else (a.peer, a.stage)
        return made_action(a.kind, a.stage, a.mb, a.peer, names[src, dst, a.tensor])

    template_walk = walk(template)
    with gc_paused():
        programs = tuple(tuple(renamed(a) for a in prog) for prog in template.actions)
        sched = Schedule(template.name, graph, template.num_microbatches, template.stage_to_rank, programs,
                         template.split_backward, dict(template.meta), data_parallel=template.data_parallel,
                         sharding=template.sharding)
        sched._walk = Walk(sched, [a for prog in programs for a in prog], template_walk.rank, template_walk.after,
                           template_walk.needs, template_walk.mate, template_walk.sequence)
    return sched


def with_allreduce(schedule: Schedule, data_parallel: int, *, overlap: bool = True, sharding: str = "none") -> Schedule:
    """``schedule`` for ``data_parallel`` replicas (1: none) under ``sharding``: each stage's gradient
    synchronisation (all-reduce, or reduce-scatter when sharded) as early as it can.

    A stage's gradients are final when its last microbatch's weight gradients are (its
    last B, or W when the backward is split), so its ALLREDUCE goes right after that
    action and the transfers posted with it: the all-reduce then overlaps the rest of the
    rank's program (the other stages' cool-down), rather than waiting for the step to end.
    There, its buckets are launched while the final B makes them final (``Walk.overlapped``).
    ``overlap=False`` puts them all at the end of each rank's program instead, each after
    the backward is done (``meta["overlap_backward"]`` False), as DeepSpeed's pipeline
    engine does (the baseline of benchmarks/data_parallel.py).

    Sharded (:mod:`partitioner.sharding`), the gradients are reduce-scattered (REDUCE_SCATTER
    where ALLREDUCE would be) and the parameters all-gathered: under ``shard_grad_op`` once a
    step, an ALLGATHER first in the rank's program (it overlaps the wait for the pipeline to
    fill), before the stage's first forward; under ``full_shard`` right before each forward
    (ALLGATHER) and each backward (ALLGATHER_B) of each microbatch, after the receives that
    precede it: the stage's rank waits for it (one FSDP unit per stage has nothing to prefetch
    beside).
    """
    last = ActionKind.W if schedule.split_backward else ActionKind.B
    reduce = ActionKind.ALLREDUCE if sharding == "none" else ActionKind.REDUCE_SCATTER
    programs = []
    for prog in schedule.actions:
        prog = tuple(a for a in prog if a.kind not in COLLECTIVE_KINDS)  # a schedule for other replicas
        final = {a.stage: i for i, a in enumerate(prog) if a.kind is last} if data_parallel > 1 else {}
        if not overlap:
            final = {stage: len(prog) - 1 for stage in sorted(final, reverse=True)}
        out = list(prog)
        for stage, i in sorted(final.items(), key=lambda item: -item[1]):  # from the end: indices stay valid
            at = i + 1
            while at < len(prog) and prog[at].is_transfer:
                at += 1
            out.insert(at, Action(reduce, stage, 0))
        if data_parallel > 1:
            out = _with_gathers(out, sharding)
        programs.append(tuple(out))
    # not validated here: whoever runs or prices it does (a broken input is refused there, named)
    meta = {k: v for k, v in schedule.meta.items() if k != "overlap_backward"}
    if not overlap:
        meta["overlap_backward"] = False
    return Schedule(schedule.name, schedule.graph, schedule.num_microbatches, schedule.stage_to_rank,
                    tuple(programs), schedule.split_backward, meta, data_parallel=data_parallel, sharding=sharding)


def _with_gathers(program: list[Action], sharding: str) -> list[Action]:
    """A rank's program with its stages' parameter all-gathers (:func:`with_allreduce`)."""
    if sharding == "shard_grad_op":
        stages = list(dict.fromkeys(a.stage for a in program if a.kind is ActionKind.F))
        return [Action(ActionKind.ALLGATHER, s, 0) for s in stages] + program
    if sharding != "full_shard":
        return program
    out: list[Action] = []
    for a in program:
        if a.kind is ActionKind.F:  # right before it: after the receives of its inputs, posted already
            out.append(Action(ActionKind.ALLGATHER, a.stage, a.mb))
        elif a.kind is ActionKind.B:
            out.append(Action(ActionKind.ALLGATHER_B, a.stage, a.mb))
        out.append(a)
    return out
