"""The problem in arrays: a graph and the settings of what is asked of it, and what an assignment costs per stage."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import networkx as nx
import numpy as np

from partitioner.checks import positive, whole
from partitioner.cluster import Cluster, Link
from partitioner.errors import InvalidAssignmentError, PlanningError, StageCountError
from partitioner.graph import KERNEL_FIELDS, OUTPUT_OP, SELECTIVE_FWD, OpGraph
from partitioner.ir import ScheduleKind
from partitioner.recompute import CHOICES, OFFLOAD, RECOMPUTING, check_mode, op_recompute, peak_recomputing
from partitioner.schedule import check_active_microbatches, peak_in_flight
from partitioner.sharding import GRADIENT_BYTES, OPTIMIZER_BYTES, PARAMETER_BYTES

__all__ = ["Problem", "ProblemSettings", "StageTerms", "graph_order", "host_link", "DEFAULT_STATE_FACTOR",
           "DEFAULT_WORKSPACE_FACTOR"]

#: Bytes kept per parameter byte when training: the weights, their gradients and Adam's
#: two moments, all in the parameters' dtype (fp32 training, or the fp32 part of mixed
#: precision counted at the stored dtype) -> 1 + 1 + 2 (unsharded: partitioner/sharding.py).
DEFAULT_STATE_FACTOR = PARAMETER_BYTES + GRADIENT_BYTES + OPTIMIZER_BYTES

#: Bytes the optimizer's step allocates for a while per parameter byte it updates: AdamW's
#: foreach implementation (torch's default on GPUs) builds one temporary list of the
#: parameters' size (sqrt of the second moment), measured in tests/test_memory_model.py.
#: The step runs after the last backward, when the stashed activations are gone, so a
#: stage's peak is its state + max(activations, workspace). 0 for a fused optimizer.
DEFAULT_WORKSPACE_FACTOR = 1.0


def graph_order(graph: OpGraph | nx.DiGraph) -> tuple[nx.DiGraph, list[Hashable]]:
    """The networkx graph and a deterministic topological order of its nodes.

    An OpGraph's program order (``index``); for a plain DiGraph, ``index`` when every node
    has one and it is topological, else networkx's lexicographic topological sort by name.
    """
    if isinstance(graph, OpGraph):
        return graph.nx, graph.topological_order()
    if not isinstance(graph, nx.DiGraph):
        raise PlanningError(f"expected an OpGraph or a networkx.DiGraph, got {type(graph).__name__}")
    if not nx.is_directed_acyclic_graph(graph):
        raise PlanningError(f"the op graph has a cycle {nx.find_cycle(graph)}; a pipeline needs a DAG")
    g = graph
    if g.number_of_nodes() and all("index" in d for _, d in g.nodes(data=True)):
        order = sorted(g.nodes, key=lambda n: (g.nodes[n]["index"], str(n)))
        pos = {n: i for i, n in enumerate(order)}
        if all(pos[u] < pos[v] for u, v in g.edges):
            return g, order
    return g, list(nx.lexicographical_topological_sort(g, key=str))


class StageTerms(NamedTuple):
    """One stage's cost under its recomputation choice (see :meth:`Problem.stage_report`)."""

    choice: str
    time: float
    memory: float
    kept: float  # bytes kept per microbatch in flight, the stage's cut included
    remade: float  # bytes one microbatch's recomputation re-creates
    recompute_time: float  # seconds of forward run again inside one backward
    workspace: float = 0.0  # bytes the optimizer's step allocates (instead of the activations)
    working: float = 0.0  # bytes held only while the stage computes (sharding's gathered parameters, whole gradients)


class _StageArrays(NamedTuple):
    """:class:`StageTerms`' fields over all the stages (``choice`` a list, the others arrays)."""

    choice: list[str]
    time: np.ndarray
    memory: np.ndarray
    kept: np.ndarray
    remade: np.ndarray
    recompute_time: np.ndarray
    workspace: np.ndarray
    working: np.ndarray


def _option_groups(options: Sequence[tuple[str, ...]]) -> list[tuple[tuple[str, ...], np.ndarray]]:
    """The stages grouped by their allowed recomputation choices: (choices, the stages' indices), in first-seen
    order."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for s, opts in enumerate(options):
        groups.setdefault(tuple(opts), []).append(s)
    return [(opts, np.array(stages, dtype=np.int64)) for opts, stages in groups.items()]


def _distinct(values: np.ndarray, bound: int) -> np.ndarray:
    """``np.unique(values)`` for integers in [0, ``bound``): marked in a table when it is small (a tenth of
    np.unique's time on the few hundred values a plan sends)."""
    if bound > 1 << 16:
        return np.unique(values)
    seen = np.zeros(bound, dtype=bool)
    seen[values] = True
    return np.flatnonzero(seen)


def host_link(cluster: Cluster) -> Link | None:
    """The link offloading copies over: the slowest of the devices' host links (one price for every stage);
    None when some device has none (its memory is host memory: nothing to offload to)."""
    links = [d.host_link for d in cluster.devices]
    if any(lk is None for lk in links):
        return None
    return Link("host", min(lk.bandwidth for lk in links), max(lk.latency for lk in links))  # type: ignore[union-attr]


def _shared_readers(g: nx.DiGraph, order: Sequence[Hashable]) -> tuple[dict[str, int], list[tuple[int, tuple[str, ...]]]]:
    """(each shared parameter's first reader, by the name it was counted under; each later reader in
    order with the names of the shared parameters it reads)."""
    first: dict[str, int] = {}
    later: list[tuple[int, tuple[str, ...]]] = []
    for i, v in enumerate(order):
        data = g.nodes[v]
        shared = set(data.get("shared_params", ()) or ())
        for name in data.get("param_names", ()) or ():
            if name not in shared:
                first.setdefault(name, i)
        if data.get("shared_from"):
            later.append((i, tuple(data["shared_from"])))
    return first, later


@dataclass(frozen=True)
class ProblemSettings:
    """What is asked of a partition beside the graph, with its defaults, checked once here (one rule for bounds).

    ``stages`` pipeline stages on ``cluster`` (None: free links and no memory limit), ``microbatches``
    per step under ``schedule`` (``ranks``: the pipeline ranks an interleaved schedule spreads the
    stages over; ``active_microbatches``: a cap on microbatches in flight, gpipe and 1f1b), for
    ``training`` (else inference), within ``memory_limit`` bytes per device (None: the cluster
    devices' memory). ``state_factor``, ``workspace_factor`` and ``working_factor``: bytes per
    parameter byte held the whole step, allocated by the optimizer's step, and held only while a
    stage computes (partitioner/sharding.py). ``recompute``: one mode for every stage
    (:data:`partitioner.recompute.MODES`) or one choice per stage. The planning request builds
    these once (partitioner/compile.py); ``solve``, ``evaluate`` and :class:`Problem` also build
    them from their keywords, and a variant is ``dataclasses.replace`` of them.
    """

    stages: int
    cluster: Cluster | None = None
    microbatches: int = 1
    schedule: str = "1f1b"
    training: bool = True
    memory_limit: float | None = None
    state_factor: float = DEFAULT_STATE_FACTOR
    workspace_factor: float = DEFAULT_WORKSPACE_FACTOR
    working_factor: float = 0.0
    ranks: int | None = None
    recompute: str | tuple[str, ...] = "none"
    active_microbatches: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", whole(self.stages, "stages", error=StageCountError))
        object.__setattr__(self, "microbatches", whole(self.microbatches, "microbatches", error=PlanningError))
        if not self.working_factor >= 0:
            raise PlanningError(f"working_factor must be >= 0 (0: nothing gathered), got {self.working_factor}")
        if not self.state_factor > 0 or self.state_factor + self.working_factor < 1:
            raise PlanningError(f"state_factor must be >= 1 (parameters themselves), got {self.state_factor}" +
                                (f" (+ working_factor {self.working_factor})" if self.working_factor else ""))
        if not self.workspace_factor >= 0:
            raise PlanningError(f"workspace_factor must be >= 0 (0: a fused optimizer), got {self.workspace_factor}")
        for name in ("state_factor", "workspace_factor", "working_factor"):
            object.__setattr__(self, name, float(getattr(self, name)))
        positive(self.memory_limit, "memory_limit", "bytes", error=PlanningError)
        object.__setattr__(self, "schedule", ScheduleKind.parse(self.schedule).value)
        check_active_microbatches(self.schedule, self.active_microbatches)
        mode = check_mode(self.recompute, self.stages)
        if not self.training and (mode not in ("auto", "none") if isinstance(mode, str)
                                  else any(c != "none" for c in mode)):
            raise PlanningError("recomputation applies to training only; plan inference with recompute='none'"
                                if isinstance(mode, tuple) else f"recompute={mode!r} applies to training only; "
                                "plan inference with recompute='none' (or 'auto')")
        object.__setattr__(self, "recompute", mode)

    @classmethod
    def of(cls, settings: ProblemSettings | int | None = None, **options: Any) -> ProblemSettings:
        """``settings`` with ``options`` in place of its fields, or (a stage count) the settings ``options`` name."""
        if isinstance(settings, ProblemSettings):
            return replace(settings, **options) if options else settings
        return cls(**options) if settings is None else cls(settings, **options)


class Problem:
    """A graph and its :class:`ProblemSettings` (``settings``), flattened into arrays over a topological order.

    Every solver and :func:`~partitioner.cost.evaluate` read costs from here, so there is one cost model.
    Position ``i`` is the i-th node of ``order``; ``succ[i]`` are consumer positions.
    ``recompute``: "none", "selective", "full" or "offload" on every stage, "auto" (each stage takes
    the fastest choice that fits its memory, see :meth:`stage_report`), or one choice per stage.
    """

    def __init__(self, graph: OpGraph | nx.DiGraph, settings: ProblemSettings | int | None = None, *,
                 order: Sequence[Hashable] | None = None, **options: Any):
        """``settings``, or a stage count with ``options`` naming the other :class:`ProblemSettings` fields
        (``cluster=``, ``microbatches=``, ...; beside a ProblemSettings, the fields they change)."""
        self.settings = ProblemSettings.of(settings, **options)
        g, default_order = graph_order(graph)
        self.graph = graph
        self.g = g
        self.order: list[Hashable] = list(order) if order is not None else default_order
        n = len(self.order)
        if n == 0:
            raise PlanningError("the op graph is empty; trace a model with at least one op")
        if order is not None:
            if set(self.order) != set(g.nodes) or len(set(self.order)) != n:
                raise PlanningError("the given order must list every node of the graph exactly once")
        self.pos: dict[Hashable, int] = {v: i for i, v in enumerate(self.order)}
        if order is not None and any(self.pos[u] >= self.pos[v] for u, v in g.edges):
            raise PlanningError("the given order is not topological (some edge points backward)")
        settings = self.settings
        stages, training = settings.stages, settings.training
        if stages > n:
            raise StageCountError(f"{stages} stages but the graph has only {n} ops: every stage needs "
                                  f"at least one op; use at most {n} stages or a finer graph")
        self.n, self.p = n, stages
        self.cluster = (settings.cluster or Cluster.free(stages)).for_stages(stages)
        # the settings every solver and the cost report read, by their names
        self.microbatches, self.training, self.schedule = settings.microbatches, training, settings.schedule
        self.ranks, self.active_microbatches = settings.ranks, settings.active_microbatches
        self.state_factor, self.workspace_factor = settings.state_factor, settings.workspace_factor
        self.working_factor = settings.working_factor

        def attr(key: str, default: float = 0.0) -> np.ndarray:
            return np.array([float(g.nodes[v].get(key, default) or 0.0) for v in self.order])

        self.fwd, self.bwd, self.bwd_w = attr("fwd"), attr("bwd"), attr("bwd_w")
        self.params, self.buffers, self.out_bytes = attr("params"), attr("buffers"), attr("out_bytes")
        for name, arr in (("fwd", self.fwd), ("bwd", self.bwd), ("params", self.params),
                          ("out_bytes", self.out_bytes), ("buffers", self.buffers), ("bwd_w", self.bwd_w)):
            if (arr < 0).any() or not np.isfinite(arr).all():
                bad = self.order[int(np.argmax((arr < 0) | ~np.isfinite(arr)))]
                raise PlanningError(f"node {bad!r} has {name}={g.nodes[bad].get(name)}; costs must be "
                                    "finite and >= 0 (re-profile the model)")
        # Activation memory per microbatch: what autograd keeps for the backward (the profiler's
        # saved_bytes) when training on a graph that has it, else the op outputs (a proxy).
        saved = isinstance(graph, OpGraph) and graph.meta.get("activations") == "saved_bytes" and training
        self.act_bytes = attr("saved_bytes") if saved else self.out_bytes
        # With exact activations, memory also depends on the cut: a stage keeps the tensors it
        # receives until its backward, and the whole of each tensor it sends (the backward's
        # roots), of which only the part some consumer saves is in the producer's saved bytes.
        self.keeps_received = bool(saved)
        # The storage a sent output lives in (an op's own, or the one it views).
        self.root = [self.pos.get(g.nodes[v].get("view_of") or v, i) for i, v in enumerate(self.order)]
        self._roots = np.array(self.root, dtype=np.int64)
        self._edges: tuple[np.ndarray, np.ndarray] | None = None
        # What each recomputation choice keeps, re-creates and runs again, per op (offloading over the host link).
        self.host = host_link(self.cluster)
        self.rec = op_recompute(self.fwd, attr("flops"), self.act_bytes,
                                attr("saved_output_bytes") if saved else self.out_bytes,
                                attr("storage_bytes") if saved else self.out_bytes, exact=saved,
                                kernel=tuple(attr(k, -1.0) for k in KERNEL_FIELDS),  # type: ignore[arg-type]
                                host=self.host, selective_fwd=attr(SELECTIVE_FWD, -1.0))
        self.modules = [str(g.nodes[v].get("module", "") or "") for v in self.order]
        # The model's output node (OpGraph.OUTPUT_OP) is no op: a stage must hold a real one.
        self.is_output = [g.nodes[v].get("op") == OUTPUT_OP for v in self.order]
        self.work = self.fwd + (self.bwd if training else 0.0)
        self.succ: list[list[int]] = [sorted(self.pos[w] for w in g.successors(v)) for v in self.order]
        self.pred: list[list[int]] = [sorted(self.pos[w] for w in g.predecessors(v)) for v in self.order]
        self.speed = np.array(self.cluster.speeds, dtype=float)
        # Activation and gradient both cross a cut when training.
        self.directions = 2 if training else 1
        self.bw = np.full((stages, stages), math.inf)
        self.lat = np.zeros((stages, stages))
        for a in range(stages):
            for t in range(a + 1, stages):
                lk = self.cluster.link(a, t)
                self.bw[a, t], self.lat[a, t] = lk.bandwidth, lk.latency
        # Microbatches each stage holds at its peak, read off the schedule's own order
        # (interleaved: ``ranks`` pipeline ranks hold the ``stages`` stages round robin).
        self.in_flight = peak_in_flight(self.schedule, stages, self.microbatches, num_ranks=self.ranks,
                                        training=training, active_microbatches=self.active_microbatches)
        self.recomputing = peak_recomputing(self.schedule, stages, self.microbatches, num_ranks=self.ranks,
                                            training=training)
        factor = self.state_factor if training else 1.0
        self.held_factor = factor
        # A parameter read on several stages (a tied embedding and LM head) is held, with
        # its gradient and optimizer state, by every stage that reads it; ``params`` counts
        # it once on its first reader, ``shared_bytes`` on each later one. For the solvers
        # two readers on one stage are counted twice: conservative, and it keeps memory per
        # node. Every feasibility check (stage_report, fits, the recomputation choice) is the
        # solvers'; a plan's reported memory (cost.partition) counts it once (``shared_counted_twice``).
        self.shared = attr("shared_bytes")
        self.held = self.params + self.shared
        state_mem = self.held * factor + self.buffers  # per node, independent of the stage
        # Sharding's working copies (partitioner/sharding.py: the gathered parameters, the whole
        # gradients) are held while the stage computes, beside its activations, and freed before
        # the optimizer's step.
        self.working_per_held = self.working_factor if training else 0.0
        self.working = self.held * self.working_per_held
        self.fixed_mem = state_mem + self.working if self.working_per_held else state_mem
        # The optimizer's step workspace: a stage's peak is state + max(working + activations,
        # workspace), so fitting is two sums within the limit: with the activations
        # (node_memory), and ``step_mem`` (state and workspace) at the step.
        self.step_workspace_per_held = self.workspace_factor if training else 0.0
        self.step_workspace = self.held * self.step_workspace_per_held
        self.step_mem = state_mem + self.step_workspace
        self._first_reader, self._later_readers = _shared_readers(g, self.order)
        self._shared_names = [name for name in dict.fromkeys(n for _, names in self._later_readers for n in names)
                              if name in self._first_reader]
        if settings.memory_limit is not None:
            self.mem_limit: list[float | None] = [float(settings.memory_limit)] * stages
        else:
            self.mem_limit = [d.memory for d in self.cluster.devices]
        self.recompute_mode, self.choices = self._stage_choices(settings.recompute)
        # the same, as arrays over the stages (what _stage_arrays reads)
        self._in_flight = np.array(self.in_flight, dtype=float)
        self._recomputing = np.array(self.recomputing, dtype=float)
        self._unlimited = np.array([lim is None for lim in self.mem_limit])
        self._limit_with_tolerance = np.array([math.inf if lim is None else lim * (1 + 1e-12) for lim in self.mem_limit])
        self._option_groups = _option_groups(self.choices)
        self._columns: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # Per op, the least time it costs on any stage (recomputation included): what bounds may count.
        union = sorted({c for opts in self.choices for c in opts}, key=CHOICES.index)
        self.least_work = self.work + np.min([self.rec.seconds[c] for c in union], axis=0)

    def _stage_choices(self, mode: str | tuple[str, ...]) -> tuple[str, list[tuple[str, ...]]]:
        """(the mode, each stage's allowed recomputation choices, fastest first)."""
        if isinstance(mode, tuple):
            return "given", [(c,) for c in mode]
        if not self.training:
            return mode, [("none",)] * self.p
        if mode == "auto":  # where memory is unlimited the fastest choice, none, is the only one worth taking
            # offloading only where it moves the stash off the device (a host link)
            limited = CHOICES if self.host is not None else RECOMPUTING
            return mode, [limited if lim is not None else RECOMPUTING[:1] for lim in self.mem_limit]
        return mode, [(mode,)] * self.p

    # ---------------------------------------------------------------- pieces

    def transfer_seconds(self, a: int, t: int, nbytes: float) -> float:
        """One direction of one tensor from stage a to stage t."""
        if nbytes <= 0 or a == t:
            return 0.0
        return nbytes / self.bw[a, t] + self.lat[a, t]

    def node_memory(self, i: int, s: int, choice: str = "none") -> float:
        """Op ``i``'s own share of stage ``s``'s memory during the pipeline under ``choice`` (the cut's tensors
        come on top); at the optimizer's step its share is ``step_mem[i]`` (both must fit)."""
        return (self.fixed_mem[i] + self.in_flight[s] * self.rec.kept[choice][i]
                + self.recomputing[s] * self.rec.remade[choice][i])

    # ---------------------------------------------------------------- fast costs

    def stage_costs(self, assign: Sequence[int], choices: Sequence[str] | None = None
                    ) -> tuple[list[float], list[float]]:
        """Per-stage time and memory of ``assign`` (stage per position); no validity checks."""
        terms = self._stage_arrays(assign, choices)
        return terms.time.tolist(), terms.memory.tolist()

    def stage_report(self, assign: Sequence[int], choices: Sequence[str] | None = None) -> list[StageTerms]:
        """Each stage's time and memory under its recomputation choice.

        Without ``choices`` each stage takes, among its allowed choices, the fastest that fits
        its memory limit (a stage's choice changes nothing on other stages): the first
        recomputing choice that fits (they come fastest first), or offloading where it fits
        and is strictly faster; the one needing least memory when none fits.
        """
        a = self._stage_arrays(assign, choices)
        return [StageTerms(*row) for row in zip(a.choice, *(x.tolist() for x in a[1:]))]

    def _stage_arrays(self, assign: Sequence[int], choices: Sequence[str] | None) -> _StageArrays:
        """:meth:`stage_report` as arrays over the stages: numpy, as every plan a search prices comes through here
        (tens of thousands at 64 stages); each stage's arithmetic is the scalar one, element by element."""
        p = self.p
        a = np.asarray(assign, dtype=np.int64)
        groups = self._option_groups if choices is None else _option_groups([(c,) for c in check_mode(choices, p)])
        used = sorted({c for opts, _ in groups for c in opts}, key=CHOICES.index)
        speed = self.speed
        columns, received, _ = self._choice_columns(tuple(used))
        # every op's columns summed per stage: one bincount each (sums op by op, in order)
        sums = np.array([np.bincount(a, weights=column, minlength=p) for column in columns])
        comp, fixed, workspace = sums[0], sums[1], sums[2]
        working = sums[3] if self.working_per_held else np.zeros(p)
        c = len(used)
        kept, remade, seconds = sums[4:4 + c], sums[4 + c:4 + 2 * c], sums[4 + 2 * c:]
        # One transfer per (producer, consuming stage) pair, paid by both ends: the pairs of
        # the edges that leave their producer's stage, deduplicated.
        eu, ev = self._sending_edges()
        src, dst = a[eu], a[ev]
        crossing = dst != src
        pairs = _distinct(eu[crossing] * p + dst[crossing], self.n * p)
        senders, to = pairs // p, pairs % p
        frm = a[senders]
        nbytes = self.out_bytes[senders]
        cost = self.directions * (nbytes / self.bw[frm, to] + self.lat[frm, to])
        t = comp / speed + np.bincount(frm, weights=cost, minlength=p) + np.bincount(to, weights=cost, minlength=p)
        recv = np.bincount(to, weights=nbytes, minlength=p)
        # (pairs are sorted, so their senders are too: distinct where they change)
        views = senders[np.concatenate(([True], senders[1:] != senders[:-1]))] if len(senders) else senders
        sent = self._kept_for_sending(a, views, tuple(used))
        # every stage under every choice weighed (rows: choices in ``used``), element by element as one stage's
        kept = np.where(received[:, None], kept + recv, kept) + sent
        rec_t = seconds / speed
        time = t + rec_t
        # fixed holds the working copies: at the step only the workspace comes on top of the state
        memory = fixed + np.maximum(self._in_flight * kept + self._recomputing * remade, workspace - working)
        which = np.empty(p, dtype=np.int64)  # each stage's choice, as its row in ``used``
        for opts, stages in groups:
            every = len(stages) == p  # (the usual case: no stage picked out)
            fitting = np.full(len(stages), -1)  # the fastest choice that fits (see stage_report)
            fitting_time = np.zeros(len(stages))
            least = np.full(len(stages), -1)  # else the one needing least memory
            least_memory = np.zeros(len(stages))
            unlimited = self._unlimited if every else self._unlimited[stages]
            limit = self._limit_with_tolerance if every else self._limit_with_tolerance[stages]
            for choice in opts:
                k = used.index(choice)
                k_time, k_memory = (time[k], memory[k]) if every else (time[k, stages], memory[k, stages])
                fits = unlimited | (k_memory <= limit)
                take = fits & ((fitting < 0) | ((k_time < fitting_time) if choice == OFFLOAD else False))
                fitting[take], fitting_time[take] = k, k_time[take]
                smaller = ~fits & ((least < 0) | (k_memory < least_memory))
                least[smaller], least_memory[smaller] = k, k_memory[smaller]
            which[stages] = np.where(fitting >= 0, fitting, least)
        on = np.arange(p)
        return _StageArrays([used[k] for k in which.tolist()], time[which, on], memory[which, on], kept[which, on],
                            remade[which, on], rec_t[which, on], workspace, working)

    def _choice_columns(self, used: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows over the ops: work, fixed memory, step workspace, working copies, then kept, remade and
        recomputation seconds under each of ``used``; whether each choice keeps what it receives; rows of the
        bytes each op keeps for sending under each), built once per set of choices."""
        got = self._columns.get(used)
        if got is None:
            rec = self.rec
            columns = np.array([self.work, self.fixed_mem, self.step_workspace, self.working,
                                *(rec.kept[c] for c in used), *(rec.remade[c] for c in used),
                                *(rec.seconds[c] for c in used)], dtype=float)
            sent = np.array([rec.sent[c] for c in used], dtype=float).reshape(len(used), self.n)
            got = self._columns[used] = (columns, np.array([bool(rec.received[c]) for c in used]), sent)
        return got

    def shared_counted_twice(self, assign: Sequence[int]) -> np.ndarray:
        """Per stage, the shared parameter bytes ``held`` counts again for a later reader on a stage that
        already holds them (its first reader, or an earlier reader, is there): held once, not twice.

        A reader of several shared parameters is let off only when the stage holds all of
        them (its ``shared_bytes`` is one sum): conservative otherwise."""
        twice = np.zeros(self.p)
        # only the parameters some later reader shares (a model has thousands of others)
        holding = {name: {assign[self._first_reader[name]]} for name in self._shared_names}
        for i, names in self._later_readers:
            s = assign[i]
            if all(s in holding.get(name, ()) for name in names):
                twice[s] += self.shared[i]
            else:
                for name in names:
                    holding.setdefault(name, set()).add(s)
        return twice

    def _sending_edges(self) -> tuple[np.ndarray, np.ndarray]:
        """(producers, consumers) of every edge whose producer outputs bytes, as arrays (built once)."""
        if self._edges is None:
            pairs = [(u, v) for u, succ in enumerate(self.succ) if self.out_bytes[u] > 0 for v in succ]
            self._edges = (np.array([u for u, _ in pairs], dtype=np.int64), np.array([v for _, v in pairs], dtype=np.int64))
        return self._edges

    def kept_for_sending(self, assign: Sequence[int], sent: Iterable[int],
                         choices: Iterable[str] = ("none",)) -> dict[str, np.ndarray]:
        """Per choice and stage, the bytes a stage keeps because it sends them (the backward's roots) beyond
        what the choice keeps anyway.

        Each storage once: several sent views of one tensor keep one storage, and a view of
        a tensor received from an earlier stage keeps nothing more (the received copy is counted).
        """
        choices = tuple(choices)
        kept = self._kept_for_sending(np.asarray(assign, dtype=np.int64), np.fromiter(sent, dtype=np.int64), choices)
        return dict(zip(choices, kept))

    def _kept_for_sending(self, a: np.ndarray, views: np.ndarray, choices: tuple[str, ...]) -> np.ndarray:
        """:meth:`kept_for_sending` as one array (``choices`` x stages)."""
        roots = self._roots[views]
        kept = _distinct(roots[a[roots] == a[views]], self.n)  # storages sent by a view on their own stage
        per_op = self._choice_columns(choices)[2]
        return np.array([np.bincount(a[kept], weights=column[kept], minlength=self.p) for column in per_op])

    def bottleneck(self, assign: Sequence[int]) -> float:
        return max(self.stage_costs(assign)[0])

    def fits(self, mem: Sequence[float]) -> bool:
        return all(lim is None or m <= lim * (1 + 1e-12) for m, lim in zip(mem, self.mem_limit))

    def check(self, assign: Sequence[int]) -> list[str]:
        """Why ``assign`` is not a valid pipeline assignment (empty list when it is)."""
        problems = []
        used = {s for s, out in zip(assign, self.is_output) if not out}
        empty = [s for s in range(self.p) if s not in used]
        if empty:
            problems.append(f"stages {empty} have no ops")
        bad = [(self.order[u], self.order[v]) for u in range(self.n) for v in self.succ[u]
               if assign[u] > assign[v]]
        if bad:
            u, v = bad[0]
            problems.append(f"{len(bad)} edges flow backward, e.g. {u!r} (stage {assign[self.pos[u]]}) -> "
                            f"{v!r} (stage {assign[self.pos[v]]})")
        return problems

    def assignment(self, stage_of: Mapping[Hashable, int]) -> list[int]:
        """Positions -> stage from a node -> stage mapping (keys may be names as strings)."""
        missing = [v for v in self.order if v not in stage_of and str(v) not in stage_of]
        if missing:
            raise InvalidAssignmentError(f"{len(missing)} ops have no stage, e.g. {missing[:3]}; "
                                         "stage_of must map every node of the graph")
        assign = []
        for v in self.order:
            s = stage_of[v] if v in stage_of else stage_of[str(v)]
            if not isinstance(s, (int, np.integer)) or not 0 <= s < self.p:
                raise InvalidAssignmentError(f"op {v!r} has stage {s!r}; stages are integers 0..{self.p - 1}")
            assign.append(int(s))
        return assign

