"""The one walker of a Schedule's action lists: validation, timing, memory held, and the order to run them in.

Every consumer of a schedule goes through :func:`walk`: the validator (structure, then
the walk itself), the simulator (:func:`Walk.times` prices exactly the walked lists,
transfers included), the single-process runtime (it executes :attr:`Walk.sequence`),
and the printed table. A change to the IR therefore reaches all of them at once. What
a stage holds while the lists run (:func:`peak_held`, :func:`peak_held_bytes`) is
counted here too, once, for the cost model and the simulator alike.

The walk runs every rank's list in program order under *rendezvous* semantics: a
compute action runs when its inputs are on its rank (produced earlier on the rank, or
received by an earlier RECV); a SEND and its RECV complete together, when both ranks
have reached them. That is what NCCL's in-order point-to-point stream needs (a send
blocks its stream until the peer's matching receive runs), so a list that walks is
deadlock-free there and, a fortiori, on gloo. Timing uses the same dependencies with
asynchronous posts (see :meth:`Walk.times`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from partitioner.ir import (
    COLLECTIVE_KINDS,
    COMPUTE_KINDS,
    GATHER_KINDS,
    MATCHING_KIND,
    SEND_KINDS,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    made_action,
)

__all__ = ["Walk", "walk", "validate", "sharded_actions", "peak_held", "peak_held_bytes", "format_table", "format_program"]


# The kinds as module constants: ``ActionKind.F`` is a lookup on the enum class, a microsecond a time
_F, _B, _W, _ALLREDUCE = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.ALLREDUCE
_REDUCE_SCATTER, _ALLGATHER, _ALLGATHER_B = ActionKind.REDUCE_SCATTER, ActionKind.ALLGATHER, ActionKind.ALLGATHER_B
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
_TRANSFER = frozenset(MATCHING_KIND)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a block that allocates many acyclic objects.

    A walk of 64 ranks x 256 microbatches makes ~10^5 lists and tuples, which triggers
    full collections over everything the process holds (a search's graphs and plans):
    40% of the walk's time. Nothing made here forms a cycle, so reference counting frees
    it all; the collector is back on (if it was) when the block ends.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_gc_lock = threading.Lock()
_gc_open: list[tuple[int, int, int]] = []  # while spaced blocks are open (any thread): the thresholds before them


@contextlib.contextmanager
def gc_spaced(allocations: int) -> Iterator[None]:
    """Python's cyclic garbage collector run less often in a block: a young collection every ``allocations``
    container allocations (700 by default), so the full collections over everything the process holds come
    that much less often too; cycles are still collected, so memory stays bounded. The thresholds are back
    when the last open block ends (blocks overlapping in threads, searches run at once, end in any order); a
    collector the user turned off (threshold 0) stays off."""
    with _gc_lock:
        if not _gc_open:
            before = gc.get_threshold()
            if before[0]:
                gc.set_threshold(max(before[0], allocations), *before[1:])
        _gc_open.append(_gc_open[0] if _gc_open else before)  # one entry per open block, each the first's
    try:
        yield
    finally:
        with _gc_lock:
            first = _gc_open.pop()
            if not _gc_open:
                gc.set_threshold(*first)


def _key_action(key: tuple) -> Action:
    """The action a walker key names (for messages)."""
    return made_action(*key)


@dataclass
class Walk:
    """A schedule's actions, numbered rank by rank, with what each one waits for.

    Action ``i`` is ``actions[i]`` on rank ``rank[i]``. ``after[i]`` is the previous action
    of the same rank (-1 for the first); ``needs[i]`` the actions whose result it reads:
    producer computes on its rank, or the RECV that brought the data. ``mate[i]`` is the
    other end of a transfer (-1 for compute). ``sequence`` is an order in which running
    the actions one at a time, in one process, never uses anything before it exists: the
    order the rendezvous walk completed them in (a SEND right before its RECV).
    """

    schedule: Schedule
    actions: list[Action]
    rank: list[int]
    after: list[int]
    needs: list[list[int]]
    mate: list[int]
    sequence: list[int]

    @functools.cached_property
    def overlapped(self) -> dict[int, int]:
        """ALLREDUCE -> the B it overlaps: the stage's final backward right before it in the rank's program
        (only transfers between). Its gradient buckets are launched as the backward makes them final,
        so the all-reduce runs during that B; a split backward's W accumulates its gradients at its end,
        an all-reduce placed later waits for its place in the program, and a schedule made with
        ``meta["overlap_backward"]`` False (:func:`~partitioner.schedule.with_allreduce`) overlaps none."""
        out: dict[int, int] = {}
        if self.schedule.split_backward or not self.schedule.meta.get("overlap_backward", True):
            return out
        for i, a in enumerate(self.actions):
            if a.kind is not _ALLREDUCE:
                continue
            j = self.after[i]
            while j >= 0 and self.actions[j].is_transfer:
                j = self.after[j]
            if j >= 0 and self.actions[j].kind is ActionKind.B and self.actions[j].stage == a.stage:
                out[i] = j
        return out

    def rank_actions(self, r: int) -> list[int]:
        """Ids of rank ``r``'s actions, in program order."""
        return [i for i in range(len(self.actions)) if self.rank[i] == r]

    def times(self, duration: Callable[[Action], float],
              tail: Callable[[Action], float] | None = None) -> tuple[list[float], list[float]]:
        """Start and end of every action when ``duration(action)`` is its cost.

        A rank's program runs in order. A compute action starts when the rank has
        finished its previous compute action and its inputs are there; it occupies the
        rank for its duration. SEND and RECV are posted without waiting, when the rank's
        program reaches them (after the compute before them): a transfer starts when both
        ends are posted and takes ``duration`` of its SEND (the link time), overlapping
        compute on both ranks; data handed over within a rank costs nothing. Transfers
        do not contend for links. A collective (ALLREDUCE, REDUCE_SCATTER, ALLGATHER)
        starts when the rank's program reaches it and its previous collective has ended, and
        runs beside its later compute (a compute that needs its gathered parameters waits for
        it); an all-reduce that overlaps its backward (:attr:`overlapped`) may start with that
        B, but ends no earlier than ``tail(action)`` (its last bucket) after the B.
        """
        n = len(self.actions)
        start = [0.0] * n
        end = [0.0] * n
        clock = [0.0] * self.schedule.num_ranks
        reducing = [0.0] * self.schedule.num_ranks  # when each rank's last collective ends
        done = [False] * n
        actions, rank, needs = self.actions, self.rank, self.needs
        for i in self.sequence:
            if done[i]:
                continue
            a = actions[i]
            r = rank[i]
            if a.kind in COMPUTE_KINDS:
                t = clock[r]
                for d in needs[i]:
                    if end[d] > t:
                        t = end[d]
                start[i] = t
                end[i] = clock[r] = t + duration(a)
            elif a.kind in COLLECTIVE_KINDS:  # posted, it runs beside the rank's later compute
                # ... but after the rank's earlier collectives: they share its data-parallel group,
                # whose collectives run one after another (NCCL and gloo alike)
                during = self.overlapped.get(i) if tail is not None else None
                if during is None:
                    start[i] = max(clock[r], reducing[r])
                    end[i] = reducing[r] = start[i] + duration(a)
                else:
                    assert tail is not None
                    start[i] = max(start[during], reducing[r])
                    end[i] = reducing[r] = max(start[i] + duration(a), end[during] + tail(a))
            else:
                j = self.mate[i]
                send, recv = (i, j) if a.kind in SEND_KINDS else (j, i)
                posted = max(clock[rank[send]], clock[rank[recv]])
                start[send] = start[recv] = posted
                end[send] = end[recv] = posted + duration(actions[send])
                done[j] = True
            done[i] = True
        return start, end


def walk(schedule: Schedule, *, implicit_transfers: bool = False) -> Walk:
    """Walk ``schedule``'s lists under rendezvous semantics; ScheduleError at the first action that cannot run.

    ``implicit_transfers``: the lists hold compute actions only and a value made on another
    rank is simply there once its producer ran (what the generators time before they
    place the transfers). The result is cached on the schedule (treat it as immutable).
    """
    cached = schedule._walk
    if isinstance(cached, Walk) and not implicit_transfers:
        return cached
    with gc_paused():
        result = _Walker(schedule, implicit_transfers).run()
    if not implicit_transfers:
        schedule._walk = result
    return result


class _Walker:
    """The rendezvous walk itself (see :func:`walk`)."""

    def __init__(self, schedule: Schedule, implicit: bool) -> None:
        self.sch = schedule
        self.implicit = implicit
        g = schedule.graph
        self.ins = [g.in_edges(s) for s in range(g.num_stages)]
        self.outs = [g.out_edges(s) for s in range(g.num_stages)]
        self.actions: list[Action] = []
        self.rank: list[int] = []
        self.after: list[int] = []
        self.first: list[int] = []
        for r, prog in enumerate(schedule.actions):
            self.first.append(len(self.actions))
            for k, a in enumerate(prog):
                self.after.append(len(self.actions) - 1 if k else -1)
                self.actions.append(a)
                self.rank.append(r)
        # Plain-tuple keys (an Action's dataclass hash is a Python call; a schedule of 64 ranks x
        # 256 microbatches has ~10^5 actions, each looked up a few times).
        self.compute_id: dict[tuple[ActionKind, int, int], int] = {}  # the parameter all-gathers too
        self.transfer_id: dict[tuple[int, ActionKind, int, int, int | None, str | None], int] = {}
        for i, a in enumerate(self.actions):
            if a.kind in COMPUTE_KINDS or a.kind in GATHER_KINDS:
                self.compute_id[a.kind, a.stage, a.mb] = i
            elif a.kind not in COLLECTIVE_KINDS:
                self.transfer_id[self.rank[i], a.kind, a.stage, a.mb, a.peer, a.tensor] = i

    def _inputs(self, a: Action) -> list[Action]:
        """What ``a`` reads: the actions that must have completed, on ``a``'s rank or (implicit) anywhere."""
        return [_key_action(key) for key in self._input_keys(a)]

    def _input_keys(self, a: Action) -> list[tuple]:
        """:meth:`_inputs` as keys: (kind, stage, mb) for a compute, (kind, stage, mb, peer, tensor) for a RECV."""
        s2r = self.sch.stage_to_rank
        here = s2r[a.stage]
        mb = a.mb
        kind = a.kind
        if kind is _F:
            return [(_F, e.src, mb) if self.implicit or s2r[e.src] == here
                    else (_RECV_F, a.stage, mb, e.src, e.tensor) for e in self.ins[a.stage]] + self._gathered(a)
        if kind is _B:
            return [(_F, a.stage, mb)] + [
                (_B, e.dst, mb) if self.implicit or s2r[e.dst] == here
                else (_RECV_B, a.stage, mb, e.dst, e.tensor) for e in self.outs[a.stage]] + self._gathered(a)
        if kind is _W:
            return [(_B, a.stage, mb)]
        if kind is _SEND_F:
            return [(_F, a.stage, mb)]
        if kind is _SEND_B:
            return [(_B, a.stage, mb)]
        if kind is _ALLREDUCE or kind is _REDUCE_SCATTER:  # every microbatch's weight gradients are final
            last = _W if self.sch.split_backward else _B
            return [(last, a.stage, k) for k in range(self.sch.num_microbatches)]
        return []

    def _gathered(self, a: Action) -> list[tuple]:
        """The all-gather of its stage's parameters a forward or backward waits for (sharded schedules):
        shard_grad_op's once a step, before the first forward; full_shard's, before each F and B."""
        sch = self.sch
        if self.implicit or sch.data_parallel < 2 or sch.forward_only or sch.sharding == "none":
            return []
        if sch.sharding == "full_shard":
            return [(_ALLGATHER if a.kind is _F else _ALLGATHER_B, a.stage, a.mb)]
        return [(_ALLGATHER, a.stage, 0)] if a.kind is _F and a.mb == 0 else []

    def _input_ids(self, i: int) -> list[int]:
        """Ids of action i's inputs (-1 where no action of the schedule makes it)."""
        r = self.rank[i]
        compute, transfer = self.compute_id, self.transfer_id
        return [compute.get(key, -1) if len(key) == 3 else transfer.get((r, *key), -1)  # type: ignore[arg-type]
                for key in self._input_keys(self.actions[i])]

    def run(self) -> Walk:
        n = len(self.actions)
        needs: list[list[int]] = [[] for _ in range(n)]
        mate = [-1] * n
        done = [False] * n
        sequence: list[int] = []
        progs = self.sch.actions
        pc = [0] * len(progs)
        s2r = self.sch.stage_to_rank
        rank = self.rank
        inputs: list[list[int] | None] = [None] * n  # each action's input ids, found once

        def ready(i: int) -> bool:
            """Whether action i's inputs are there; ScheduleError if they can never be (same rank, later)."""
            deps = inputs[i]
            if deps is None:
                deps = inputs[i] = self._input_ids(i)
            r = rank[i]
            for k, j in enumerate(deps):
                if j < 0 or (rank[j] == r and not done[j]):
                    need = self._inputs(self.actions[i])[k]
                    raise ScheduleError(f"uses the result of {need} before it is available on this rank "
                                        "(dependency not satisfied)", r, i - self.first[r], self.actions[i])
                if not done[j]:
                    return False  # made on another rank (implicit transfers), not yet run
            needs[i] = deps
            return True

        def complete(i: int) -> None:
            done[i] = True
            sequence.append(i)
            pc[rank[i]] += 1

        remaining = n
        while remaining:
            progressed = False
            for r in range(len(progs)):
                prog = progs[r]
                while pc[r] < len(prog):
                    i = self.first[r] + pc[r]
                    a = self.actions[i]
                    if a.kind not in _TRANSFER:
                        if not ready(i):
                            break
                        complete(i)
                        remaining -= 1
                        progressed = True
                        continue
                    peer = s2r[a.peer]  # type: ignore[index]
                    j = self.transfer_id.get((peer, MATCHING_KIND[a.kind], a.peer, a.mb, a.stage, a.tensor), -1)
                    if j < 0 or pc[peer] != j - self.first[peer]:
                        break
                    send, recv = (i, j) if a.kind in SEND_KINDS else (j, i)
                    ready(send)
                    mate[i], mate[j] = j, i
                    needs[recv] = [send]
                    complete(send)
                    complete(recv)
                    remaining -= 2
                    progressed = True
            if not progressed:
                raise self._stuck(pc)
        return Walk(self.sch, self.actions, self.rank, self.after, needs, mate, sequence)

    def _stuck(self, pc: list[int]) -> ScheduleError:
        progs = self.sch.actions
        s2r = self.sch.stage_to_rank
        blocked = [(r, pc[r]) for r in range(len(progs)) if pc[r] < len(progs[r])]
        if all(not progs[r][i].is_transfer for r, i in blocked):
            r, i = min(blocked, key=lambda ri: (ri[1], ri[0]))
            return ScheduleError("compute order can never run: it waits (directly or through other ranks) on an "
                                 "action that comes after it", r, i, progs[r][i])
        lines = []
        for r, i in blocked:
            a = progs[r][i]
            if not a.is_transfer:
                lines.append(f"rank {r} at {a} waits for its inputs")
                continue
            peer = s2r[a.peer]  # type: ignore[index]
            at = progs[peer][pc[peer]] if pc[peer] < len(progs[peer]) else "its end"
            lines.append(f"rank {r} at {a} waits for rank {peer} to reach {a.matching()} (rank {peer} is at {at})")
        r, i = next((ri for ri in blocked if progs[ri[0]][ri[1]].is_transfer), blocked[0])
        return ScheduleError("deadlock under blocking point-to-point semantics: " + "; ".join(lines),
                             r, i, progs[r][i])


# --------------------------------------------------------------------------- validator


def validate(schedule: Schedule) -> None:
    """Check a schedule; raise ScheduleError naming the first bad action.

    Checks, in order: every action belongs on its rank and names a real stage,
    microbatch and cut edge; each (stage, mb) has exactly one F and one B (and one W
    when the backward is split; only F when forward-only); each cross-rank edge has
    exactly one SEND and one RECV per direction and microbatch; then walks all ranks
    (:func:`walk`) and fails at the first action whose inputs are not there yet (a
    dependency used before it is produced or received) or, if ranks block each other,
    at the first blocked action (deadlock).
    """
    _check_structure(schedule)
    walk(schedule)


def _check_structure(sch: Schedule) -> None:
    g = sch.graph
    S, m, split = g.num_stages, sch.num_microbatches, sch.split_backward
    s2r = sch.stage_to_rank
    edges = {e.key for e in g.edges}
    backward = (ActionKind.B, ActionKind.W, ActionKind.SEND_B, ActionKind.RECV_B)
    seen: dict[Action, tuple[int, int]] = {}
    for r, prog in enumerate(sch.actions):
        for i, a in enumerate(prog):
            if not isinstance(a, Action):
                raise ScheduleError(f"not an Action: {a!r}", r, i)
            if a.stage >= S or (a.peer is not None and a.peer >= S):
                raise ScheduleError(f"stage out of range 0..{S - 1}", r, i, a)
            if a.mb >= m:
                raise ScheduleError(f"microbatch out of range 0..{m - 1}", r, i, a)
            if s2r[a.stage] != r:
                raise ScheduleError(f"stage {a.stage} lives on rank {s2r[a.stage]}, not here", r, i, a)
            if a.kind is ActionKind.W and not split:
                raise ScheduleError("W in a schedule whose backward is not split (split_backward=False)", r, i, a)
            if sch.forward_only and a.kind in backward:
                raise ScheduleError("backward action in a forward-only schedule", r, i, a)
            if a.kind in COLLECTIVE_KINDS and (sch.data_parallel < 2 or sch.forward_only):
                raise ScheduleError(f"{a.kind.value} in a schedule without data-parallel replicas to reduce over",
                                    r, i, a)
            if a.kind in COLLECTIVE_KINDS and (a.kind not in _SHARDED_KINDS[sch.sharding] or (
                    a.kind is _ALLGATHER and a.mb and sch.sharding == "shard_grad_op")):
                raise ScheduleError(f"{a.kind.value} does not belong to a schedule under sharding={sch.sharding!r}",
                                    r, i, a)
            if a.is_transfer:
                if a.edge not in edges:
                    raise ScheduleError("no such cut edge in the stage graph", r, i, a)
                if s2r[a.peer] == r:  # type: ignore[index]
                    raise ScheduleError("both stages are on this rank: a local hand-off needs no SEND/RECV",
                                        r, i, a)
            if a in seen:
                pr, pi = seen[a]
                raise ScheduleError(f"duplicate: already at rank {pr} step {pi}", r, i, a)
            seen[a] = (r, i)
    if sch.forward_only:
        kinds: tuple[ActionKind, ...] = (ActionKind.F,)
    else:
        kinds = (ActionKind.F, ActionKind.B, ActionKind.W) if split else (ActionKind.F, ActionKind.B)
    for s in range(S):
        for k in range(m):
            for kind in kinds:
                a = Action(kind, s, k)
                if a not in seen:
                    raise ScheduleError(f"missing {a}: rank {s2r[s]} never runs it", s2r[s], None, a)
        if sch.data_parallel > 1 and not sch.forward_only:
            for a in sharded_actions(sch, s):
                if a not in seen:
                    what = "gradients are never reduced" if a.kind in (_ALLREDUCE, _REDUCE_SCATTER) else \
                        "parameters are not gathered for it"
                    raise ScheduleError(f"missing {a}: stage {s}'s {what} over its {sch.data_parallel} replicas "
                                        f"(sharding={sch.sharding!r})", s2r[s], None, a)
    for a, (r, i) in seen.items():
        if a.is_transfer and a.matching() not in seen:
            what = "send without a matching receive" if a.is_send else "receive without a matching send"
            raise ScheduleError(f"{what} {a.matching()} on rank {s2r[a.peer]}", r, i, a)  # type: ignore[index]
    for e in g.edges:
        if s2r[e.src] == s2r[e.dst]:
            continue
        for k in range(m):
            moves = [Action(ActionKind.SEND_F, e.src, k, e.dst, e.tensor)]
            if not sch.forward_only:
                moves.append(Action(ActionKind.SEND_B, e.dst, k, e.src, e.tensor))
            for a in moves:
                if a not in seen:
                    raise ScheduleError(f"cut edge {e.src}->{e.dst} t={e.tensor} mb={k} is never sent: "
                                        f"missing {a}", s2r[a.stage], None, a)


#: The collectives each sharding mode runs (:func:`sharded_actions` says which, per stage).
_SHARDED_KINDS = {"none": frozenset((_ALLREDUCE,)), "shard_grad_op": frozenset((_ALLGATHER, _REDUCE_SCATTER)),
                  "full_shard": frozenset((_ALLGATHER, _ALLGATHER_B, _REDUCE_SCATTER))}


def sharded_actions(sch: Schedule, stage: int) -> list[Action]:
    """The collectives a training schedule with replicas runs for ``stage`` under its sharding
    (:func:`~partitioner.schedule.with_allreduce` places them)."""
    if sch.sharding == "none":
        return [Action(_ALLREDUCE, stage, 0)]
    gathers = [Action(_ALLGATHER, stage, 0)] if sch.sharding == "shard_grad_op" else \
        [Action(kind, stage, k) for k in range(sch.num_microbatches) for kind in (_ALLGATHER, _ALLGATHER_B)]
    return gathers + [Action(_REDUCE_SCATTER, stage, 0)]


# --------------------------------------------------------------------------- memory held

Amount = TypeVar("Amount", int, float)


def peak_held(programs: Sequence[Sequence[Action]], num_stages: int, split_backward: bool, *,
              taken_at: ActionKind = ActionKind.F) -> list[int]:
    """Most microbatches each stage holds at once while every rank runs its program in order.

    A microbatch is held on a stage from its ``taken_at`` action there (its F: the activations
    autograd saves; its B: what a recomputing B re-creates) to its last backward action there
    (its B, or its W when ``split_backward``). ``programs`` are the ranks' action lists in
    program order: a Schedule's ``actions``, or a generator's bare compute orders.
    """
    one = [1] * num_stages
    return _peak(programs, num_stages, False, {taken_at: one}, _release(split_backward), one, 0)


def peak_held_bytes(programs: Sequence[Sequence[Action]], split_backward: bool, act: Sequence[float],
                    remade: Sequence[float], *, per_rank: bool = False) -> list[float]:
    """Most activation bytes each stage (``per_rank``: each rank) holds at once while the programs run in order.

    A microbatch's F on stage s takes ``act[s]`` (what the stage keeps per microbatch in
    flight), its B ``remade[s]`` (the activations a recomputing B re-creates); its last
    backward action (B, or W when ``split_backward``) frees both.
    """
    size = len(programs) if per_rank else len(act)
    freed = [kept + again for kept, again in zip(act, remade)]
    return _peak(programs, size, per_rank, {ActionKind.F: act, ActionKind.B: remade}, _release(split_backward),
                 freed, 0.0)


def _release(split_backward: bool) -> ActionKind:
    """A microbatch's last backward action on a stage, which frees what it holds there."""
    return _W if split_backward else _B


def _peak(programs: Sequence[Sequence[Action]], size: int, per_rank: bool,
          taken: Mapping[ActionKind, Sequence[Amount]], release: ActionKind, freed: Sequence[Amount],
          zero: Amount) -> list[Amount]:
    """The one memory fold: an action of kind k on stage s takes ``taken[k][s]``, a ``release`` frees ``freed[s]``
    (all its microbatch took there); the most each stage (or rank) holds, read after each action runs, before
    its release frees. A stage's actions all sit on one rank, so each rank's program order is enough."""
    current = [zero] * size
    best = [zero] * size
    for r, program in enumerate(programs):
        for a in program:
            kind, stage = a.kind, a.stage
            k = r if per_rank else stage
            add = taken.get(kind)
            if add is not None:
                current[k] += add[stage]
            if current[k] > best[k]:
                best[k] = current[k]
            if kind is release:
                current[k] -= freed[stage]
    return best


# --------------------------------------------------------------------------- printing


def format_table(schedule: Schedule, *, durations: tuple[int, int, int] = (1, 1, 1),
                 stage_labels: bool | None = None) -> str:
    """Rank x time-step table of the compute actions, as pipelines are drawn.

    Time steps come from walking the program with integer costs ``durations`` =
    (F, B, W) and free communication; an action longer than one step continues
    with ``-``; idle steps print ``.``. Cells read ``F<mb>`` when each rank holds one
    stage, ``F<stage>.<mb>`` otherwise (or when ``stage_labels`` is True).
    """
    sch = schedule
    w = walk(sch)
    cost = {ActionKind.F: durations[0], ActionKind.B: durations[1], ActionKind.W: durations[2]}
    start, end = w.times(lambda a: float(cost.get(a.kind, 0)))
    steps = int(max(end)) if end else 0
    if stage_labels is None:
        stage_labels = sch.num_stages != sch.num_ranks
    grid = [["." for _ in range(steps)] for _ in range(sch.num_ranks)]
    for i, a in enumerate(w.actions):
        if not a.is_compute:
            continue
        label = f"{a.kind.value}{a.stage}.{a.mb}" if stage_labels else f"{a.kind.value}{a.mb}"
        t0, t1 = int(start[i]), int(end[i])
        grid[w.rank[i]][t0] = label
        for t in range(t0 + 1, t1):
            grid[w.rank[i]][t] = "-"
    width = max([len(x) for row in grid for x in row] + [1])
    head = "       " + " ".join(f"{t:>{width}}" for t in range(steps))
    rows = [head] + [f"rank {r:<2}" + " ".join(f"{x:>{width}}" for x in row) for r, row in enumerate(grid)]
    return "\n".join(rows)


def format_program(schedule: Schedule) -> str:
    """Each rank's full program, transfers included, one action per line."""
    out = []
    for r, prog in enumerate(schedule.actions):
        out.append(f"rank {r} (stages {schedule.stages_of(r)}):")
        out.extend(f"  {i:4d}  {a}" for i, a in enumerate(prog))
    return "\n".join(out)

