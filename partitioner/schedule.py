"""Pipeline-schedule IR: per-rank action lists (F/B/W, SEND/RECV), generators, validator, printing."""

from __future__ import annotations

import enum
import heapq
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ActionKind",
    "Action",
    "Edge",
    "StageGraph",
    "Schedule",
    "ScheduleError",
    "stage_graph_from_transfers",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "make_schedule",
    "SCHEDULES",
    "validate",
    "format_table",
    "format_program",
]

SCHEDULE_SCHEMA_VERSION = 1


# --------------------------------------------------------------------------- actions


class ActionKind(str, enum.Enum):
    """What an action does. F/B/W are compute; the rest move one cut tensor for one microbatch."""

    F = "F"  #: forward of (stage, mb)
    B = "B"  #: backward of (stage, mb): full backward, or only the input gradient when split
    W = "W"  #: weight gradient of (stage, mb) (split backward only)
    SEND_F = "SEND_F"  #: send activation of an edge, producer side
    RECV_F = "RECV_F"  #: receive activation of an edge, consumer side
    SEND_B = "SEND_B"  #: send the gradient of an edge back, consumer side
    RECV_B = "RECV_B"  #: receive the gradient of an edge, producer side

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B, ActionKind.W)


_COMPUTE = (ActionKind.F, ActionKind.B, ActionKind.W)
_COMM = (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)
_MATCH = {
    ActionKind.SEND_F: ActionKind.RECV_F,
    ActionKind.RECV_F: ActionKind.SEND_F,
    ActionKind.SEND_B: ActionKind.RECV_B,
    ActionKind.RECV_B: ActionKind.SEND_B,
}
_COMPUTE_RE = re.compile(r"^(F|B|W)(\d+)\.(\d+)$")
_COMM_RE = re.compile(r"^(SEND_F|RECV_F|SEND_B|RECV_B)\[(\d+)->(\d+) t=(\S+) mb=(\d+)\]$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of a rank's program.

    ``stage`` is always the stage *on the rank that executes the action*; ``peer`` is
    the stage on the other side of a transfer. For the four transfer kinds, the edge
    is the forward cut edge ``(src, dst, tensor)``:

    - ``SEND_F``: stage = src, peer = dst (runs on src's rank)
    - ``RECV_F``: stage = dst, peer = src (runs on dst's rank)
    - ``SEND_B``: stage = dst, peer = src (gradient of ``tensor`` flows dst -> src)
    - ``RECV_B``: stage = src, peer = dst

    Compact string form: ``F3.2`` (forward of stage 3, microbatch 2), ``B3.2``,
    ``W3.2``, and ``SEND_F[3->5 t=add_7 mb=2]`` where the arrow is the direction the
    data moves (so ``SEND_B[5->3 t=add_7 mb=2]`` sends the gradient of ``add_7``
    from stage 5 back to stage 3). :meth:`parse` reads it back.
    """

    kind: ActionKind
    stage: int
    mb: int
    peer: int | None = None
    tensor: str | None = None

    def __post_init__(self) -> None:
        kind = ActionKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"stage and mb must be >= 0, got stage={self.stage} mb={self.mb}")
        if kind.is_compute:
            if self.peer is not None or self.tensor is not None:
                raise ValueError(f"compute action {kind.value} takes no peer/tensor")
        else:
            if self.peer is None or self.tensor is None:
                raise ValueError(f"{kind.value} needs a peer stage and a tensor name")
            if not self.tensor or any(c.isspace() for c in self.tensor):
                raise ValueError(f"tensor name must be non-empty without whitespace: {self.tensor!r}")
            src, dst = self.edge[0], self.edge[1]
            if not src < dst:
                raise ValueError(
                    f"{kind.value}: forward edge must go from a lower to a higher stage, got {src}->{dst}"
                )

    # -- views
    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    @property
    def is_send(self) -> bool:
        return self.kind in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self.kind in (ActionKind.RECV_F, ActionKind.RECV_B)

    @property
    def edge(self) -> tuple[int, int, str]:
        """Forward cut edge ``(src, dst, tensor)`` a transfer action moves (data or its gradient)."""
        if self.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
            return (self.stage, self.peer, self.tensor)  # type: ignore[return-value]
        if self.kind in (ActionKind.RECV_F, ActionKind.SEND_B):
            return (self.peer, self.stage, self.tensor)  # type: ignore[return-value]
        raise ValueError(f"{self} is a compute action, it has no edge")

    def matching(self) -> Action:
        """The counterpart on the peer rank: SEND_F <-> RECV_F, SEND_B <-> RECV_B."""
        if self.is_compute:
            raise ValueError(f"{self} is a compute action, it has no counterpart")
        return Action(_MATCH[self.kind], self.peer, self.mb, self.stage, self.tensor)  # type: ignore[arg-type]

    # -- text / json
    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.kind.value}{self.stage}.{self.mb}"
        if self.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            a, b = self.stage, self.peer
        else:
            a, b = self.peer, self.stage
        return f"{self.kind.value}[{a}->{b} t={self.tensor} mb={self.mb}]"

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of ``str(action)``."""
        s = text.strip()
        m = _COMPUTE_RE.match(s)
        if m:
            return Action(ActionKind(m.group(1)), int(m.group(2)), int(m.group(3)))
        m = _COMM_RE.match(s)
        if m:
            kind = ActionKind(m.group(1))
            a, b = int(m.group(2)), int(m.group(3))
            if kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                stage, peer = a, b
            else:
                stage, peer = b, a
            return Action(kind, stage, int(m.group(5)), peer, m.group(4))
        raise ValueError(
            f"cannot parse action {text!r}: expected e.g. 'F3.2', 'B3.2', 'W3.2' or "
            "'SEND_F[3->5 t=add_7 mb=2]'"
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind.value, "stage": self.stage, "mb": self.mb}
        if not self.is_compute:
            d["peer"] = self.peer
            d["tensor"] = self.tensor
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Action:
        return Action(ActionKind(d["kind"]), int(d["stage"]), int(d["mb"]), d.get("peer"), d.get("tensor"))


def _F(s: int, mb: int) -> Action:
    return Action(ActionKind.F, s, mb)


def _B(s: int, mb: int) -> Action:
    return Action(ActionKind.B, s, mb)


def _W(s: int, mb: int) -> Action:
    return Action(ActionKind.W, s, mb)


# --------------------------------------------------------------------------- stage graph


@dataclass(frozen=True)
class Edge:
    """A cut tensor: produced on stage ``src``, consumed on the later stage ``dst``."""

    src: int
    dst: int
    tensor: str
    bytes: int = 0

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.src, self.dst, self.tensor)


@dataclass(frozen=True)
class StageGraph:
    """Stages ``0..num_stages-1`` in pipeline order and the cut tensors between them.

    Any DAG cut is allowed: a stage may send to any later stage (skip connections).
    Stage 0 reads the batch; a stage without outgoing edges (normally the last)
    starts its backward from the loss.
    """

    num_stages: int
    edges: tuple[Edge, ...] = ()

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"need at least one stage, got num_stages={self.num_stages}")
        seen: dict[tuple[int, int, str], Edge] = {}
        for e in self.edges:
            if not (0 <= e.src < e.dst < self.num_stages):
                raise ValueError(
                    f"edge {e.src}->{e.dst} ({e.tensor}): need 0 <= src < dst < {self.num_stages} "
                    "(stages are numbered in pipeline order; data flows to higher stages)"
                )
            if not e.tensor or any(c.isspace() for c in e.tensor):
                raise ValueError(f"edge {e.src}->{e.dst}: tensor name must be non-empty without whitespace")
            if e.key in seen:
                raise ValueError(f"duplicate edge {e.src}->{e.dst} t={e.tensor}")
            seen[e.key] = e
        object.__setattr__(self, "edges", tuple(sorted(self.edges, key=lambda e: (e.src, e.dst, e.tensor))))

    @staticmethod
    def chain(num_stages: int, bytes: int = 0) -> StageGraph:
        """A plain chain: stage j sends one tensor ``s{j}_out`` to stage j+1."""
        return StageGraph(num_stages, tuple(Edge(j, j + 1, f"s{j}_out", bytes) for j in range(num_stages - 1)))

    def in_edges(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.dst == stage]

    def out_edges(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.src == stage]

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_stages": self.num_stages,
            "edges": [[e.src, e.dst, e.tensor, e.bytes] for e in self.edges],
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> StageGraph:
        return StageGraph(int(d["num_stages"]), tuple(Edge(int(a), int(b), str(t), int(n)) for a, b, t, n in d["edges"]))


def stage_graph_from_transfers(num_stages: int, transfers: Iterable[Any]) -> StageGraph:
    """Build a StageGraph from the optimizer's transfers (duck typed).

    Each transfer needs ``.src_stage``, ``.dst_stage``, ``.node`` (a name, or an fx
    Node with ``.name``) and ``.bytes``. Repeated (src, dst, node) triples are merged
    (bytes taken from the first).
    """
    edges: dict[tuple[int, int, str], Edge] = {}
    for t in transfers:
        node = getattr(t.node, "name", t.node)
        e = Edge(int(t.src_stage), int(t.dst_stage), str(node), int(getattr(t, "bytes", 0) or 0))
        edges.setdefault(e.key, e)
    return StageGraph(num_stages, tuple(edges.values()))


def _as_graph(graph: StageGraph | int) -> StageGraph:
    return StageGraph.chain(graph) if isinstance(graph, int) else graph


# --------------------------------------------------------------------------- schedule


class ScheduleError(ValueError):
    """A broken schedule. ``rank``/``index``/``action`` name the first bad action (when there is one)."""

    def __init__(self, message: str, rank: int | None = None, index: int | None = None,
                 action: Action | None = None) -> None:
        where = ""
        if rank is not None:
            where = f"rank {rank}"
            if index is not None:
                where += f" step {index}"
            if action is not None:
                where += f" ({action})"
            where += ": "
        super().__init__(where + message)
        self.rank = rank
        self.index = index
        self.action = action


@dataclass(eq=False)
class Schedule:
    """Per-rank ordered action lists plus what is needed to interpret them.

    ``actions[r]`` is rank r's program. ``stage_to_rank[s]`` is the rank holding stage
    s. With ``split_backward`` every (stage, mb) has a B (input gradient) and a W
    (weight gradient); otherwise B is the full backward and there is no W. Edges
    between two stages of the same rank need no SEND/RECV: the tensor is handed
    over locally (see :meth:`local_edges`).
    """

    name: str
    graph: StageGraph
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    split_backward: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stage_to_rank = tuple(int(r) for r in self.stage_to_rank)
        self.actions = tuple(tuple(a) for a in self.actions)
        if len(self.stage_to_rank) != self.graph.num_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for {self.graph.num_stages} stages"
            )
        if self.stage_to_rank and (min(self.stage_to_rank) < 0 or max(self.stage_to_rank) >= len(self.actions)):
            raise ValueError(f"stage_to_rank {self.stage_to_rank} names a rank outside 0..{len(self.actions) - 1}")
        self._compiled: Any = None  # cache for the simulator

    @property
    def num_stages(self) -> int:
        return self.graph.num_stages

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def local_edges(self, rank: int | None = None) -> list[Edge]:
        """Edges whose two stages share a rank (handed over in memory, no SEND/RECV)."""
        return [e for e in self.graph.edges
                if self.stage_to_rank[e.src] == self.stage_to_rank[e.dst]
                and (rank is None or self.stage_to_rank[e.src] == rank)]

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def validate(self) -> None:
        validate(self)

    def format_table(self, **kw: Any) -> str:
        return format_table(self, **kw)

    def __str__(self) -> str:
        return format_table(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEDULE_SCHEMA_VERSION,
            "name": self.name,
            "num_microbatches": self.num_microbatches,
            "split_backward": self.split_backward,
            "graph": self.graph.to_dict(),
            "stage_to_rank": list(self.stage_to_rank),
            "actions": [[str(a) for a in rank] for rank in self.actions],
            "meta": dict(self.meta),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Schedule:
        if d.get("schema", SCHEDULE_SCHEMA_VERSION) != SCHEDULE_SCHEMA_VERSION:
            raise ValueError(f"unknown schedule schema {d.get('schema')}, expected {SCHEDULE_SCHEMA_VERSION}")
        return Schedule(
            name=str(d["name"]),
            graph=StageGraph.from_dict(d["graph"]),
            num_microbatches=int(d["num_microbatches"]),
            stage_to_rank=tuple(d["stage_to_rank"]),
            actions=tuple(
                tuple(Action.parse(a) if isinstance(a, str) else Action.from_dict(a) for a in rank)
                for rank in d["actions"]
            ),
            split_backward=bool(d.get("split_backward", False)),
            meta=dict(d.get("meta", {})),
        )


# --------------------------------------------------------------------------- dependency core
# Shared by the generators (to place transfers) and the simulator (to time actions).


@dataclass
class _Compiled:
    """Compute actions of a schedule as a DAG in a topological order (for fast timing)."""

    nodes: list[tuple[int, ActionKind, int, int]]  # (rank, kind, stage, mb)
    index: dict[tuple[ActionKind, int, int], int]  # (kind, stage, mb) -> node id
    deps: list[list[tuple[int, tuple[int, int, str] | None]]]  # (pred id, cross-rank edge key | None)
    topo: list[int]
    position: list[int]  # node id -> position in its rank's compute order


def _compile_orders(graph: StageGraph, stage_to_rank: Sequence[int],
                    orders: Sequence[Sequence[Action]], split: bool) -> _Compiled:
    """Dependency DAG of per-rank compute orders; raises ScheduleError if they cannot all run."""
    nodes: list[tuple[int, ActionKind, int, int]] = []
    index: dict[tuple[ActionKind, int, int], int] = {}
    position: list[int] = []
    for r, order in enumerate(orders):
        for i, a in enumerate(order):
            key = (a.kind, a.stage, a.mb)
            if key in index:
                raise ScheduleError("duplicate compute action", r, i, a)
            index[key] = len(nodes)
            nodes.append((r, a.kind, a.stage, a.mb))
            position.append(i)
    ins = [graph.in_edges(s) for s in range(graph.num_stages)]
    outs = [graph.out_edges(s) for s in range(graph.num_stages)]
    deps: list[list[tuple[int, tuple[int, int, str] | None]]] = [[] for _ in nodes]
    prev_on_rank: dict[int, int] = {}
    for n, (r, kind, s, mb) in enumerate(nodes):
        d = deps[n]
        if r in prev_on_rank:
            d.append((prev_on_rank[r], None))
        prev_on_rank[r] = n

        def need(k: ActionKind, st: int, edge: tuple[int, int, str] | None, what: str) -> None:
            p = index.get((k, st, mb))
            if p is None:
                a = Action(kind, s, mb)
                raise ScheduleError(f"{what} {k.value}{st}.{mb} is never run", r, position[n], a)
            d.append((p, edge if edge is not None and stage_to_rank[st] != r else None))

        if kind is ActionKind.F:
            for e in ins[s]:
                need(ActionKind.F, e.src, e.key, "needs the activation from")
        elif kind is ActionKind.B:
            need(ActionKind.F, s, None, "needs its forward")
            for e in outs[s]:
                need(ActionKind.B, e.dst, e.key, "needs the gradient from")
        else:
            need(ActionKind.B, s, None, "needs its input-gradient backward")
    # Kahn's algorithm; ties broken by (position on rank, rank) for determinism.
    indeg = [len(d) for d in deps]
    succ: list[list[int]] = [[] for _ in nodes]
    for n, d in enumerate(deps):
        for p, _ in d:
            succ[p].append(n)
    heap = [(position[n], nodes[n][0], n) for n in range(len(nodes)) if indeg[n] == 0]
    heapq.heapify(heap)
    topo: list[int] = []
    while heap:
        _, _, n = heapq.heappop(heap)
        topo.append(n)
        for q in succ[n]:
            indeg[q] -= 1
            if indeg[q] == 0:
                heapq.heappush(heap, (position[q], nodes[q][0], q))
    if len(topo) != len(nodes):
        done = set(topo)
        stuck = min((position[n], nodes[n][0], n) for n in range(len(nodes)) if n not in done)[2]
        r, kind, s, mb = nodes[stuck]
        raise ScheduleError(
            "compute order can never run: it waits (directly or through other ranks) on an action "
            "that comes after it", r, position[stuck], Action(kind, s, mb))
    return _Compiled(nodes, index, deps, topo, position)


def _times(c: _Compiled, dur: Sequence[float], comm: Mapping[tuple[int, int, str], float] | None = None
           ) -> tuple[list[float], list[float]]:
    """Start/end of every compute node: as early as its rank and its inputs allow."""
    n = len(c.nodes)
    start = [0.0] * n
    end = [0.0] * n
    deps = c.deps
    for i in c.topo:
        t = 0.0
        for p, key in deps[i]:
            v = end[p]
            if key is not None and comm:
                v += comm.get(key, 0.0)
            if v > t:
                t = v
        start[i] = t
        end[i] = t + dur[i]
    return start, end


def _insert_transfers(graph: StageGraph, stage_to_rank: Sequence[int],
                      orders: Sequence[Sequence[Action]], split: bool) -> tuple[tuple[Action, ...], ...]:
    """Add SEND/RECV actions so that the programs are deadlock-free under rendezvous semantics.

    The compute orders are timed with unit costs (F=1, B=2 or B=W=1 when split, free
    comm). Every compute action and every transfer is then put on one global
    sequence: a transfer at the moment its producer finishes, before computes that
    start at that moment. Each rank's program is that sequence projected on the
    rank, so executing the global sequence in order is a valid run in which every
    send meets its receive: no deadlock, and sends/receives between any two ranks
    come in the same order on both sides (as NCCL requires). Sends go right after
    their producer; receives are posted early (at the time the data is produced).
    """
    c = _compile_orders(graph, stage_to_rank, orders, split)
    bw = 1.0 if split else 2.0
    dur = [1.0 if k is ActionKind.F else (bw if k is ActionKind.B else 1.0) for (_, k, _, _) in c.nodes]
    start, end = _times(c, dur)
    events: list[tuple[float, int, int, int, int, Action]] = []
    for n, (r, kind, s, mb) in enumerate(c.nodes):
        events.append((start[n], 1, r, c.position[n], 0, Action(kind, s, mb)))
        if kind is ActionKind.F:
            moves = [(e, ActionKind.SEND_F) for e in graph.out_edges(s)]
        elif kind is ActionKind.B:
            moves = [(e, ActionKind.SEND_B) for e in graph.in_edges(s)]
        else:
            moves = []
        for j, (e, send_kind) in enumerate(moves):
            if stage_to_rank[e.src] == stage_to_rank[e.dst]:
                continue
            if send_kind is ActionKind.SEND_F:
                send = Action(ActionKind.SEND_F, e.src, mb, e.dst, e.tensor)
            else:
                send = Action(ActionKind.SEND_B, e.dst, mb, e.src, e.tensor)
            events.append((end[n], 0, r, c.position[n], j, send))
    events.sort(key=lambda ev: ev[:5])
    progs: list[list[Action]] = [[] for _ in orders]
    for *_, a in events:
        if a.is_compute:
            progs[stage_to_rank[a.stage]].append(a)
        else:
            recv = a.matching()
            progs[stage_to_rank[a.stage]].append(a)
            progs[stage_to_rank[recv.stage]].append(recv)
    return tuple(tuple(p) for p in progs)


def _build(name: str, graph: StageGraph, m: int, stage_to_rank: Sequence[int],
           orders: Sequence[Sequence[Action]], split: bool, **meta: Any) -> Schedule:
    actions = _insert_transfers(graph, stage_to_rank, orders, split)
    sched = Schedule(name, graph, m, tuple(stage_to_rank), actions, split, dict(meta))
    validate(sched)
    return sched


def _check_m(m: int) -> None:
    if m < 1:
        raise ValueError(f"need at least one microbatch, got {m}")


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


# --------------------------------------------------------------------------- generators


def gpipe(graph: StageGraph | int, num_microbatches: int, *, split_backward: bool = False) -> Schedule:
    """GPipe (Huang et al., 2019): all forwards, then all backwards; stage j on rank j.

    Every rank holds the activations of all m microbatches at the peak.
    """
    g = _as_graph(graph)
    m = num_microbatches
    _check_m(m)
    orders = []
    for s in range(g.num_stages):
        order = [_F(s, k) for k in range(m)] + [_B(s, k) for k in range(m)]
        orders.append(_with_w(order, split_backward))
    return _build("gpipe", g, m, range(g.num_stages), orders, split_backward)


def _one_f_one_b_order(s: int, p: int, m: int) -> list[Action]:
    warm = min(p - s - 1, m)
    order = [_F(s, k) for k in range(warm)]
    for k in range(m - warm):
        order.append(_F(s, warm + k))
        order.append(_B(s, k))
    order.extend(_B(s, k) for k in range(m - warm, m))
    return order


def one_f_one_b(graph: StageGraph | int, num_microbatches: int, *, split_backward: bool = False) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al., 2021; DAPPLE, Fan et al., 2021); stage j on rank j.

    Stage i runs min(p - i - 1, m) warm-up forwards, then alternates one forward and
    one backward, then drains the backwards: at most min(m, p - i) microbatches in
    flight, with GPipe's bubble.
    """
    g = _as_graph(graph)
    m = num_microbatches
    _check_m(m)
    p = g.num_stages
    orders = [_with_w(_one_f_one_b_order(s, p, m), split_backward) for s in range(p)]
    return _build("1f1b", g, m, range(p), orders, split_backward)


def interleaved_1f1b(graph: StageGraph | int, num_microbatches: int, num_ranks: int, *,
                     split_backward: bool = False) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC'21, Megatron-LM): v = S / p virtual stages per rank.

    Stage s lives on rank s mod p (chunk s // p). Microbatches go in rounds of at
    least p: a rank runs the forwards of a round on chunk 0, then chunk 1, ... and the
    backwards of a round from the last chunk down. Rank r warms up with
    (v - 1) * round + 2 * (p - 1 - r) forwards, then alternates. The bubble shrinks
    about v-fold, at the cost of v times as many transfers.
    """
    g = _as_graph(graph)
    m = num_microbatches
    _check_m(m)
    p = num_ranks
    S = g.num_stages
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
        orders.append(_with_w(order, split_backward))
    return _build("interleaved_1f1b", g, m, [s % p for s in range(S)], orders, split_backward,
                  virtual_stages=v)


def zb_h1(graph: StageGraph | int, num_microbatches: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism"); stage j on rank j.

    1F1B with the backward split into B (input gradient, on the critical path) and W
    (weight gradient, off it). Rank i defers its W's by i microbatches: it runs
    W(k - i) after B(k), and the last i + 1 W's fill the cool-down. With F = B = W
    the bubble is (p - 1) units instead of 1F1B's 3 (p - 1): about a third. Each
    rank keeps at most p microbatches stashed (F done, W not), 1F1B's peak (which
    1F1B reaches only on stage 0).
    """
    g = _as_graph(graph)
    m = num_microbatches
    _check_m(m)
    p = g.num_stages
    orders = []
    for i in range(p):
        warm = min(p - i - 1, m)
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
    return _build("zb_h1", g, m, range(p), orders, True)


SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
}


def make_schedule(name: str, graph: StageGraph | int, num_microbatches: int, **kw: Any) -> Schedule:
    """Build a schedule by name: 'gpipe', '1f1b', 'interleaved_1f1b' (needs num_ranks=), 'zb_h1'."""
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None
    return fn(graph, num_microbatches, **kw)  # type: ignore[operator]


# --------------------------------------------------------------------------- validator


def validate(schedule: Schedule) -> None:
    """Check a schedule; raise ScheduleError naming the first bad action.

    Checks, in order: every action belongs on its rank and names a real stage,
    microbatch and cut edge; each (stage, mb) has exactly one F and one B (and one
    W when the backward is split); each cross-rank edge has exactly one SEND and one
    RECV per direction and microbatch; then runs all ranks with rendezvous
    semantics (a send completes only together with its receive; everything else
    in program order) and fails at the first action whose inputs are not there yet
    (a dependency used before it is produced) or, if ranks block each other, at the
    first blocked action (deadlock).
    """
    sch = schedule
    g = sch.graph
    S, m, split = g.num_stages, sch.num_microbatches, sch.split_backward
    s2r = sch.stage_to_rank
    edges = {e.key: e for e in g.edges}
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
            if not a.is_compute:
                if a.edge not in edges:
                    raise ScheduleError("no such cut edge in the stage graph", r, i, a)
                if s2r[a.peer] == r:  # type: ignore[index]
                    raise ScheduleError("both stages are on this rank: a local hand-off needs no SEND/RECV",
                                        r, i, a)
            if a in seen:
                pr, pi = seen[a]
                raise ScheduleError(f"duplicate: already at rank {pr} step {pi}", r, i, a)
            seen[a] = (r, i)
    # completeness of compute
    kinds = (ActionKind.F, ActionKind.B, ActionKind.W) if split else (ActionKind.F, ActionKind.B)
    for s in range(S):
        for k in range(m):
            for kind in kinds:
                a = Action(kind, s, k)
                if a not in seen:
                    raise ScheduleError(f"missing {a}: rank {s2r[s]} never runs it", s2r[s], None, a)
    # every send has its receive and vice versa, every cross-rank edge is moved
    for a, (r, i) in seen.items():
        if not a.is_compute and a.matching() not in seen:
            what = "send without a matching receive" if a.is_send else "receive without a matching send"
            raise ScheduleError(f"{what} {a.matching()} on rank {s2r[a.peer]}", r, i, a)  # type: ignore[index]
    for e in g.edges:
        if s2r[e.src] == s2r[e.dst]:
            continue
        for k in range(m):
            for a in (Action(ActionKind.SEND_F, e.src, k, e.dst, e.tensor),
                      Action(ActionKind.SEND_B, e.dst, k, e.src, e.tensor)):
                if a not in seen:
                    raise ScheduleError(f"cut edge {e.src}->{e.dst} t={e.tensor} mb={k} is never sent: "
                                        f"missing {a}", s2r[a.stage], None, a)
    _run_rendezvous(sch)


def _run_rendezvous(sch: Schedule) -> None:
    g = sch.graph
    s2r = sch.stage_to_rank
    ins = [g.in_edges(s) for s in range(g.num_stages)]
    outs = [g.out_edges(s) for s in range(g.num_stages)]
    R = sch.num_ranks
    progs = sch.actions
    pc = [0] * R
    done: set[Action] = set()  # finished actions (compute, and received transfers)

    def check_ready(r: int) -> None:
        a = progs[r][pc[r]]
        need: list[Action] = []
        if a.kind is ActionKind.F:
            for e in ins[a.stage]:
                need.append(_F(e.src, a.mb) if s2r[e.src] == r
                            else Action(ActionKind.RECV_F, a.stage, a.mb, e.src, e.tensor))
        elif a.kind is ActionKind.B:
            need.append(_F(a.stage, a.mb))
            for e in outs[a.stage]:
                need.append(_B(e.dst, a.mb) if s2r[e.dst] == r
                            else Action(ActionKind.RECV_B, a.stage, a.mb, e.dst, e.tensor))
        elif a.kind is ActionKind.W:
            need.append(_B(a.stage, a.mb))
        elif a.kind is ActionKind.SEND_F:
            need.append(_F(a.stage, a.mb))
        elif a.kind is ActionKind.SEND_B:
            need.append(_B(a.stage, a.mb))
        for n in need:
            if n not in done:
                raise ScheduleError(f"uses the result of {n} before it is available on this rank "
                                    "(dependency not satisfied)", r, pc[r], a)

    remaining = sum(len(p) for p in progs)
    while remaining:
        progressed = False
        for r in range(R):
            while pc[r] < len(progs[r]):
                a = progs[r][pc[r]]
                check_ready(r)
                if a.is_compute:
                    done.add(a)
                    pc[r] += 1
                    remaining -= 1
                    progressed = True
                    continue
                peer = s2r[a.peer]  # type: ignore[index]
                mate = a.matching()
                if pc[peer] < len(progs[peer]) and progs[peer][pc[peer]] == mate:
                    if mate.is_send:
                        check_ready(peer)
                    done.add(a)
                    done.add(mate)
                    pc[r] += 1
                    pc[peer] += 1
                    remaining -= 2
                    progressed = True
                    continue
                break
        if not progressed:
            blocked = [(r, pc[r]) for r in range(R) if pc[r] < len(progs[r])]
            lines = []
            for r, i in blocked:
                a = progs[r][i]
                peer = s2r[a.peer]  # type: ignore[index]
                at = progs[peer][pc[peer]] if pc[peer] < len(progs[peer]) else "its end"
                lines.append(f"rank {r} at {a} waits for rank {peer} to reach {a.matching()} "
                             f"(rank {peer} is at {at})")
            r, i = blocked[0]
            raise ScheduleError("deadlock under blocking point-to-point semantics: " + "; ".join(lines),
                                r, i, progs[r][i])


# --------------------------------------------------------------------------- printing


def format_table(schedule: Schedule, *, durations: tuple[int, int, int] = (1, 1, 1),
                 stage_labels: bool | None = None) -> str:
    """Rank x time-step table of the compute actions, as pipelines are drawn.

    Time steps come from running the program with integer costs ``durations`` =
    (F, B, W) and free communication; an action longer than one step continues
    with ``-``; idle steps print ``.``. Cells read ``F<mb>`` when each rank holds one
    stage, ``F<stage>.<mb>`` otherwise (or when ``stage_labels`` is True).
    """
    sch = schedule
    orders = [sch.compute_actions(r) for r in range(sch.num_ranks)]
    c = _compile_orders(sch.graph, sch.stage_to_rank, orders, sch.split_backward)
    dmap = {ActionKind.F: durations[0], ActionKind.B: durations[1], ActionKind.W: durations[2]}
    dur = [float(dmap[k]) for (_, k, _, _) in c.nodes]
    start, end = _times(c, dur)
    steps = int(max(end)) if end else 0
    if stage_labels is None:
        stage_labels = sch.num_stages != sch.num_ranks
    grid = [["." for _ in range(steps)] for _ in range(sch.num_ranks)]
    for n, (r, kind, s, mb) in enumerate(c.nodes):
        label = f"{kind.value}{s}.{mb}" if stage_labels else f"{kind.value}{mb}"
        t0, t1 = int(start[n]), int(end[n])
        grid[r][t0] = label
        for t in range(t0 + 1, t1):
            grid[r][t] = "-"
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
