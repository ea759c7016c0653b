"""The schedule IR: actions, the stage graph, schedule kinds, and the per-rank Schedule."""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from partitioner.errors import PlanError
from partitioner.sharding import check_backward, check_sharding

__all__ = [
    "ActionKind",
    "Action",
    "made_action",
    "Edge",
    "StageGraph",
    "ScheduleKind",
    "Schedule",
    "ScheduleError",
    "stage_graph_from_transfers",
    "SCHEDULE_SCHEMA_VERSION",
    "COMPUTE_KINDS",
    "COLLECTIVE_KINDS",
    "GATHER_KINDS",
    "SEND_KINDS",
    "MATCHING_KIND",
]

SCHEDULE_SCHEMA_VERSION = 1


class ScheduleKind(str, enum.Enum):
    """The pipeline schedules smp generates; the one table of their names.

    The value is the name users type and plans store (``--schedule zb-h1``);
    :meth:`parse` also takes the older spellings.
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"

    @classmethod
    def parse(cls, name: str | ScheduleKind) -> ScheduleKind:
        """The kind for a user-typed name ('1F1B', 'interleaved_1f1b', 'zb_h1', ...)."""
        if isinstance(name, ScheduleKind):
            return name
        key = str(name).strip().lower().replace("_", "-")
        key = _ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            raise PlanError(f"unknown schedule {name!r}; choose "
                                f"{', '.join(k.value for k in cls)}") from None

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into B (input gradient) and W (weight gradient)."""
        return self is ScheduleKind.ZB_H1

    @property
    def interleaved(self) -> bool:
        """Whether each rank holds several (virtual) stages."""
        return self is ScheduleKind.INTERLEAVED

    def __str__(self) -> str:
        return self.value


_ALIASES = {"interleaved-1f1b": "interleaved", "zbh1": "zb-h1", "pipedream-flush": "1f1b"}


# --------------------------------------------------------------------------- actions


class ActionKind(str, enum.Enum):
    """What an action does. F/B/W are compute; SEND/RECV move one cut tensor for one microbatch;
    the collectives run over a stage's data-parallel replicas (:mod:`partitioner.sharding`):
    ALLREDUCE averages its gradients (sharding none), REDUCE_SCATTER leaves each replica its
    shard of them, ALLGATHER / ALLGATHER_B gather its parameters before a forward / a backward."""

    F = "F"  #: forward of (stage, mb)
    B = "B"  #: backward of (stage, mb): full backward, or only the input gradient when split
    W = "W"  #: weight gradient of (stage, mb) (split backward only)
    SEND_F = "SEND_F"  #: send activation of an edge, producer side
    RECV_F = "RECV_F"  #: receive activation of an edge, consumer side
    SEND_B = "SEND_B"  #: send the gradient of an edge back, consumer side
    RECV_B = "RECV_B"  #: receive the gradient of an edge, producer side
    ALLREDUCE = "ALLREDUCE"  #: all-reduce of a stage's gradients over the data-parallel group (once a step)
    REDUCE_SCATTER = "REDUCE_SCATTER"  #: reduce-scatter of a sharded stage's gradients (once a step)
    ALLGATHER = "ALLGATHER"  #: all-gather of a sharded stage's parameters before its forward of mb
    ALLGATHER_B = "ALLGATHER_B"  #: all-gather of a full_shard stage's parameters before its backward of mb

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_transfer(self) -> bool:
        return self in MATCHING_KIND


# Sets, not tuples of ``ActionKind.X``: a member looked up on the enum class costs a
# microsecond, and a walk asks these questions millions of times.
COMPUTE_KINDS = frozenset((ActionKind.F, ActionKind.B, ActionKind.W))
#: The collectives over a stage's replicas: posted by its rank, they run beside its compute.
COLLECTIVE_KINDS = frozenset((ActionKind.ALLREDUCE, ActionKind.REDUCE_SCATTER, ActionKind.ALLGATHER,
                              ActionKind.ALLGATHER_B))
#: The parameter all-gathers -> the compute each one serves (same stage and microbatch).
GATHER_KINDS = {ActionKind.ALLGATHER: ActionKind.F, ActionKind.ALLGATHER_B: ActionKind.B}
#: How a collective prints: ``AR3`` (once a step) or ``AG3.2`` (for one microbatch).
_COLLECTIVE_TAGS = {ActionKind.ALLREDUCE: "AR", ActionKind.REDUCE_SCATTER: "RS", ActionKind.ALLGATHER: "AG",
                    ActionKind.ALLGATHER_B: "AGB"}
_ONCE_A_STEP = frozenset((ActionKind.ALLREDUCE, ActionKind.REDUCE_SCATTER))
SEND_KINDS = frozenset((ActionKind.SEND_F, ActionKind.SEND_B))
_RECV_KINDS = frozenset((ActionKind.RECV_F, ActionKind.RECV_B))
_FORWARD_EDGE_KINDS = frozenset((ActionKind.SEND_F, ActionKind.RECV_B))  # stage is the edge's source
_BACKWARD_EDGE_KINDS = frozenset((ActionKind.RECV_F, ActionKind.SEND_B))  # stage is the edge's destination

#: Each transfer kind -> the kind of its counterpart on the peer rank (its keys are the transfer kinds).
MATCHING_KIND = {
    ActionKind.SEND_F: ActionKind.RECV_F,
    ActionKind.RECV_F: ActionKind.SEND_F,
    ActionKind.SEND_B: ActionKind.RECV_B,
    ActionKind.RECV_B: ActionKind.SEND_B,
}


@functools.lru_cache(maxsize=1 << 16)
def _counterpart(kind: ActionKind, stage: int, mb: int, peer: int, tensor: str) -> Action:
    """The matching transfer of a transfer action, made once: schedule building and every walk ask for it."""
    return made_action(MATCHING_KIND[kind], peer, mb, stage, tensor)


def made_action(kind: ActionKind, stage: int, mb: int, peer: int | None = None, tensor: str | None = None) -> Action:
    """An action made by smp's own code from fields valid by construction (a generator, the walk),
    without ``Action``'s checks: a 256-microbatch schedule's walk makes millions of them."""
    action = _new_object(Action)
    fields = action.__dict__  # written directly: the frozen dataclass's __setattr__ refuses, and
    fields["kind"] = kind     # object.__setattr__ per field costs twice as much
    fields["stage"] = stage
    fields["mb"] = mb
    fields["peer"] = peer
    fields["tensor"] = tensor
    return action


_new_object = object.__new__


_COMPUTE_RE = re.compile(r"^(F|B|W)(\d+)\.(\d+)$")
_COLLECTIVE_RE = re.compile(r"^(AR|RS|AGB|AG)(\d+)(?:\.(\d+))?$")
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
        kind = self.kind
        if not isinstance(kind, ActionKind):  # a string from JSON or a hand-written list
            kind = ActionKind(kind)
            object.__setattr__(self, "kind", kind)
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"stage and mb must be >= 0, got stage={self.stage} mb={self.mb}")
        if not kind.is_transfer:
            if self.peer is not None or self.tensor is not None:
                raise ValueError(f"{kind.value} takes no peer/tensor")
            if kind in _ONCE_A_STEP and self.mb != 0:
                raise ValueError(f"{kind.value} is once a step, for every microbatch: mb must be 0")
        else:
            if self.peer is None or self.tensor is None:
                raise ValueError(f"{kind.value} needs a peer stage and a tensor name")
            if not self.tensor or self.tensor.split() != [self.tensor]:  # empty, or has whitespace
                raise ValueError(f"tensor name must be non-empty without whitespace: {self.tensor!r}")
            src, dst = self.edge[0], self.edge[1]
            if not src < dst:
                raise ValueError(
                    f"{kind.value}: forward edge must go from a lower to a higher stage, got {src}->{dst}"
                )

    # -- views
    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_transfer(self) -> bool:
        return self.kind in MATCHING_KIND

    @property
    def is_send(self) -> bool:
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self.kind in _RECV_KINDS

    @property
    def edge(self) -> tuple[int, int, str]:
        """Forward cut edge ``(src, dst, tensor)`` a transfer action moves (data or its gradient)."""
        if self.kind in _FORWARD_EDGE_KINDS:
            return (self.stage, self.peer, self.tensor)  # type: ignore[return-value]
        if self.kind in _BACKWARD_EDGE_KINDS:
            return (self.peer, self.stage, self.tensor)  # type: ignore[return-value]
        raise ValueError(f"{self} moves no cut tensor, it has no edge")

    def matching(self) -> Action:
        """The counterpart on the peer rank: SEND_F <-> RECV_F, SEND_B <-> RECV_B."""
        if not self.is_transfer:
            raise ValueError(f"{self} moves no cut tensor, it has no counterpart")
        return _counterpart(self.kind, self.stage, self.mb, self.peer, self.tensor)  # type: ignore[arg-type]

    # -- text / json
    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.kind.value}{self.stage}.{self.mb}"
        tag = _COLLECTIVE_TAGS.get(self.kind)
        if tag is not None:
            return f"{tag}{self.stage}" if self.kind in _ONCE_A_STEP else f"{tag}{self.stage}.{self.mb}"
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
        m = _COLLECTIVE_RE.match(s)
        if m:
            kind = next(k for k, tag in _COLLECTIVE_TAGS.items() if tag == m.group(1))
            if (m.group(3) is None) != (kind in _ONCE_A_STEP):
                raise ValueError(f"cannot parse action {text!r}: {m.group(1)} takes "
                                 + ("no microbatch" if kind in _ONCE_A_STEP else "a microbatch, e.g. AG3.2"))
            return Action(kind, int(m.group(2)), int(m.group(3) or 0))
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
            f"cannot parse action {text!r}: expected e.g. 'F3.2', 'B3.2', 'W3.2', 'AR3', 'RS3', 'AG3.2', 'AGB3.2' or "
            "'SEND_F[3->5 t=add_7 mb=2]'"
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind.value, "stage": self.stage, "mb": self.mb}
        if self.is_transfer:
            d["peer"] = self.peer
            d["tensor"] = self.tensor
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Action:
        return Action(ActionKind(d["kind"]), int(d["stage"]), int(d["mb"]), d.get("peer"), d.get("tensor"))


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

    ``actions[r]`` is rank r's program: the single source of truth that the validator,
    the simulator and the runtime all walk (:mod:`partitioner.walk`). ``stage_to_rank[s]``
    is the rank holding stage s. With ``split_backward`` every (stage, mb) has a B (input
    gradient) and a W (weight gradient); otherwise B is the full backward and there is no
    W. A ``forward_only`` schedule (inference) has only F and the activation transfers.
    Edges between two stages of the same rank need no SEND/RECV: the tensor is handed
    over locally (see :meth:`local_edges`). ``name`` is a :class:`ScheduleKind` value for
    generated schedules (any text for hand-written ones).
    """

    name: str
    graph: StageGraph
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    split_backward: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    forward_only: bool = False
    data_parallel: int = 1
    sharding: str = "none"  # how the replicas hold each stage's state (partitioner.sharding)

    def __post_init__(self) -> None:
        check_sharding(self.sharding, self.data_parallel)
        check_backward(self.sharding, self.name, self.split_backward)
        self.stage_to_rank = tuple(int(r) for r in self.stage_to_rank)
        self.actions = tuple(tuple(a) for a in self.actions)
        if len(self.stage_to_rank) != self.graph.num_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for {self.graph.num_stages} stages"
            )
        if self.stage_to_rank and (min(self.stage_to_rank) < 0 or max(self.stage_to_rank) >= len(self.actions)):
            raise ValueError(f"stage_to_rank {self.stage_to_rank} names a rank outside 0..{len(self.actions) - 1}")
        if self.forward_only and self.split_backward:
            raise ValueError("a forward-only schedule has no backward to split")
        self._walk: Any = None  # the compiled walk (partitioner.walk), made on first use

    @property
    def kind(self) -> ScheduleKind | None:
        """The generator this schedule came from (None for a hand-written one)."""
        try:
            return ScheduleKind.parse(self.name)
        except PlanError:
            return None

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

    def forward(self) -> Schedule:
        """This schedule's forward pass alone (inference): its F and activation transfers, in order."""
        if self.forward_only:
            return self
        keep = (ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F)
        return Schedule(self.name, self.graph, self.num_microbatches, self.stage_to_rank,
                        tuple(tuple(a for a in prog if a.kind in keep) for prog in self.actions),
                        False, dict(self.meta), forward_only=True, data_parallel=self.data_parallel,
                        sharding=self.sharding)

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
            "forward_only": self.forward_only,
            "data_parallel": self.data_parallel,
            "sharding": self.sharding,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Schedule:
        if d.get("schema", SCHEDULE_SCHEMA_VERSION) != SCHEDULE_SCHEMA_VERSION:
            raise ValueError(f"unknown schedule schema {d.get('schema')}, expected {SCHEDULE_SCHEMA_VERSION}")
        name = str(d["name"])
        try:  # plans before the ScheduleKind table spelled generated schedules "zb_h1", "interleaved_1f1b"
            name = ScheduleKind.parse(name).value
        except PlanError:
            pass
        return Schedule(
            name=name,
            graph=StageGraph.from_dict(d["graph"]),
            num_microbatches=int(d["num_microbatches"]),
            stage_to_rank=tuple(d["stage_to_rank"]),
            actions=tuple(
                tuple(Action.parse(a) if isinstance(a, str) else Action.from_dict(a) for a in rank)
                for rank in d["actions"]
            ),
            split_backward=bool(d.get("split_backward", False)),
            meta=dict(d.get("meta", {})),
            forward_only=bool(d.get("forward_only", False)),
            data_parallel=int(d.get("data_parallel", 1)),
            sharding=str(d.get("sharding", "none")),
        )
