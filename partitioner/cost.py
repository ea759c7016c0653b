"""What an op -> stage assignment costs, reported per stage and overall (see docs/cost-model.md)."""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from partitioner.bounds import strongest_bound
from partitioner.cluster import Cluster
from partitioner.errors import InvalidAssignmentError
from partitioner.graph import OpGraph
from partitioner.problem import DEFAULT_WORKSPACE_FACTOR, Problem, ProblemSettings
from partitioner.units import format_bytes

__all__ = ["Transfer", "StageStats", "Partition", "partition", "evaluate", "module_range", "OPTIMAL_RTOL"]

#: A plan is called optimal when a proven lower bound is within this fraction of its value
#: (one part per million: CP-SAT's integer scaling rounds each term by under 1e-9 of it).
OPTIMAL_RTOL = 1e-6

# ---------------------------------------------------------------------- results


@dataclass
class Transfer:
    """One cut tensor: ``node``'s output sent from ``src_stage`` to ``dst_stage`` once per microbatch.

    ``seconds`` is one direction (bytes / bandwidth + latency); when training the gradient
    of the same size flows back over the same link.
    """

    src_stage: int
    dst_stage: int
    node: str
    bytes: float
    seconds: float


@dataclass
class StageStats:
    """Per-microbatch cost of one stage and its peak memory estimate.

    ``time = compute + recompute_time + comm_in_time + comm_out_time``. ``recompute`` is the
    stage's activation recomputation (:data:`partitioner.recompute.CHOICES`), which the
    runtime executes: ``recompute_time`` is the forward run again inside each backward (under
    "offload": the stash's copies to host memory and back), ``activations`` what the stage keeps
    per microbatch in flight, ``recompute_bytes`` what one microbatch's recomputation re-creates
    (offload: copies back), held for ``recomputing`` microbatches at
    the peak, ``workspace`` what the optimizer's step allocates after the backward, ``working``
    what sharding holds while the stage computes and frees before the step (partitioner/sharding.py):
    ``memory = state + max(working + in_flight × activations + recomputing × recompute_bytes, workspace)``.
    """

    index: int
    device: int
    ops: list[str]
    modules: str
    fwd: float
    bwd: float
    bwd_w: float
    compute: float
    comm_in_bytes: float
    comm_out_bytes: float
    comm_in_time: float
    comm_out_time: float
    time: float
    params: float
    buffers: float
    activations: float
    in_flight: int
    memory: float
    memory_limit: float | None
    recompute: str = "none"
    recompute_time: float = 0.0
    recompute_bytes: float = 0.0
    recomputing: int = 0
    workspace: float = 0.0
    working: float = 0.0

    @property
    def fits(self) -> bool:
        return self.memory_limit is None or self.memory <= self.memory_limit * (1 + 1e-12)

    @property
    def activation_peak(self) -> float:
        """Bytes of activations held at the stage's peak: in flight plus those being recomputed."""
        return self.in_flight * self.activations + self.recomputing * self.recompute_bytes

    @property
    def state(self) -> float:
        """Bytes held for the whole step: parameters, gradients, optimizer state, buffers."""
        return self.memory - max(self.working + self.activation_peak, self.workspace)


@dataclass
class Partition:
    """An assignment of ops to stages with its cost (from :func:`evaluate`) and solver report."""

    stage_of: dict[Any, int]
    stages: list[StageStats]
    transfers: list[Transfer]
    bottleneck: float
    bottleneck_stage: int
    lower_bound: float
    optimal: bool
    gap: float
    method: str
    solve_seconds: float
    cluster: dict[str, Any]
    microbatches: int
    schedule: str
    training: bool
    memory_limit: float | None
    state_factor: float
    notes: list[str] = field(default_factory=list)
    #: Optimizer-step workspace per parameter byte the memory was counted under.
    workspace_factor: float = DEFAULT_WORKSPACE_FACTOR
    #: Bytes per parameter byte held only while a stage computes (sharding's gathered parameters and whole
    #: gradients, partitioner/sharding.py), on top of ``state_factor``.
    working_factor: float = 0.0
    #: What the plan was chosen for: "bottleneck" (the solvers' min-max), or "step_time"
    #: (then picked and refined by simulated step time, see partitioner/refine.py).
    objective: str = "bottleneck"
    #: The quantity ``lower_bound``, ``gap`` and ``optimal`` speak of; no other is proven.
    bound_on: str = "bottleneck"
    #: Which bound ``lower_bound`` is (e.g. "cpsat", "dp (single order)", "work").
    bound_by: str = ""
    #: Simulated step time under ``schedule`` (seconds), when the solver simulated it
    #: (objective "step_time"); a Plan simulates every partition itself.
    simulated_step: float | None = None
    #: With ``objective="step_time"``: the solver's bottleneck plan this one was weighed
    #: against ({"method", "bottleneck", "simulated_step", "optimal"}); None otherwise.
    bottleneck_plan: dict[str, Any] | None = None
    #: What was asked of recomputation: "auto" (chosen per stage), a choice forced on every
    #: stage, or "given" (one choice per stage, from the caller); each stage's is in ``stages``.
    recompute_mode: str = "none"
    #: The cap on microbatches in flight the memory was counted under (None: the schedule's own).
    active_microbatches: int | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def recompute(self) -> list[str]:
        """Each stage's activation recomputation: "none", "selective", "full" or "offload"."""
        return [s.recompute for s in self.stages]

    def settings(self, ranks: int | None = None) -> ProblemSettings:
        """The settings this partition was priced under, each stage's recomputation as chosen (``ranks``: an
        interleaved plan's pipeline ranks, which a Partition does not record)."""
        return ProblemSettings(self.num_stages, cluster=Cluster.from_dict(self.cluster),
                               microbatches=self.microbatches, schedule=self.schedule, training=self.training, memory_limit=self.memory_limit,
                               state_factor=self.state_factor, workspace_factor=self.workspace_factor,
                               working_factor=self.working_factor, ranks=ranks, recompute=tuple(self.recompute),
                               active_microbatches=self.active_microbatches)

    @property
    def memory_ok(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def ratio(self) -> float:
        """bottleneck / lower_bound (1.0 = proven optimal by the bound)."""
        return self.bottleneck / self.lower_bound if self.lower_bound > 0 else math.inf

    def with_report(self, *, lower_bound: float | None = None, bound_by: str = "",
                    optimal: bool | None = None, method: str | None = None,
                    solve_seconds: float | None = None, notes: Iterable[str] = ()) -> Partition:
        """Set the solver's part of the report (bound, optimality, method, time) in place.

        ``lower_bound`` raises the bound when larger (``bound_by`` names it); a bound above
        the plan's own bottleneck is an internal inconsistency and raises, beyond float
        noise. A bound within ``OPTIMAL_RTOL`` of the bottleneck proves ``optimal``.
        """
        if lower_bound is not None:
            if lower_bound > self.bottleneck * (1 + OPTIMAL_RTOL) + 1e-300:
                raise RuntimeError(
                    f"internal inconsistency: the lower bound {lower_bound!r} ({bound_by or 'given'}) exceeds the "
                    f"bottleneck {self.bottleneck!r} of the plan it bounds; this is a bug in smp, please report it")
            if lower_bound > self.lower_bound:
                self.lower_bound, self.bound_by = min(lower_bound, self.bottleneck), bound_by
        if optimal is not None:
            self.optimal = optimal
        if self.bottleneck > 0 and self.lower_bound >= self.bottleneck * (1 - OPTIMAL_RTOL):
            self.optimal = True
        self.gap = 0.0 if self.optimal or self.bottleneck <= 0 else max(
            0.0, (self.bottleneck - self.lower_bound) / self.bottleneck)
        if method is not None:
            self.method = method
        if solve_seconds is not None:
            self.solve_seconds = solve_seconds
        self.notes.extend(notes)
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stage_of"] = {str(k): v for k, v in self.stage_of.items()}
        d["kind"] = "smp.Partition"
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Partition:
        d = dict(d)
        d.pop("kind", None)
        d["stages"] = [StageStats(**s) for s in d["stages"]]
        d["transfers"] = [Transfer(**t) for t in d["transfers"]]
        d["stage_of"] = {str(k): int(v) for k, v in d["stage_of"].items()}
        d["notes"] = list(d.get("notes", []))
        d.setdefault("workspace_factor", 0.0)  # saved before the optimizer's workspace was counted
        return cls(**d)

    def table(self) -> str:
        """A plain-text table of the stages, for logs and the CLI."""
        rows = [f"{'stage':>5} {'ops':>5} {'modules':<24} {'compute ms':>11} {'recompute':>14} {'comm ms':>9} "
                f"{'time ms':>9} {'memory':>11} {'limit':>11}"]
        for s in self.stages:
            mark = "*" if s.index == self.bottleneck_stage else " "
            rec = s.recompute if s.recompute == "none" else f"{s.recompute} {s.recompute_time * 1e3:.3f}"
            rows.append(f"{s.index:>4}{mark} {len(s.ops):>5} {s.modules[:24]:<24} {s.compute * 1e3:>11.3f} "
                        f"{rec:>14} {(s.comm_in_time + s.comm_out_time) * 1e3:>9.3f} {s.time * 1e3:>9.3f} "
                        f"{format_bytes(s.memory):>11} {format_bytes(s.memory_limit):>11}")
        rows.append(f"bottleneck {self.bottleneck * 1e3:.3f} ms, lower bound {self.lower_bound * 1e3:.3f} ms "
                    f"({self.bound_by or 'none'}), gap {self.gap:.2%}"
                    f"{' (bottleneck proven optimal)' if self.optimal else ''}, {self.method}, "
                    f"{self.solve_seconds:.2f} s")
        if self.simulated_step is not None:
            rows.append(f"simulated step {self.simulated_step * 1e3:.3f} ms ({self.schedule}, "
                        f"{self.microbatches} microbatches); plan chosen for the {self.objective}")
        return "\n".join(rows)



def partition(prob: Problem, assign: Sequence[int], *, method: str = "manual", solve_seconds: float = 0.0,
              choices: Sequence[str] | None = None) -> Partition:
    """The full report of ``assign`` (stage per position) on ``prob``: every stage's cost, the transfers, and the
    strongest closed-form bound (``choices``: each stage's recomputation, else each stage's own pick)."""
    p, k = prob.p, prob.directions
    speed = prob.speed
    ops: list[list[int]] = [[] for _ in range(p)]
    for i, s in enumerate(assign):
        ops[s].append(i)
    transfers: list[Transfer] = []
    cin_b, cout_b = [0.0] * p, [0.0] * p
    cin_t, cout_t = [0.0] * p, [0.0] * p
    for u, succ in enumerate(prob.succ):
        b = float(prob.out_bytes[u])
        if b <= 0 or not succ:
            continue
        a = assign[u]
        dsts = sorted({assign[v] for v in succ} - {a})
        for dst in dsts:
            sec = prob.transfer_seconds(a, dst, b)
            transfers.append(Transfer(a, dst, str(prob.order[u]), b, sec))
            cout_b[a] += b
            cin_b[dst] += b
            cout_t[a] += k * sec
            cin_t[dst] += k * sec
    terms = prob.stage_report(assign, choices)
    twice = prob.shared_counted_twice(assign)
    stats = []
    for s in range(p):
        idx, term = ops[s], terms[s]
        # The pipeline's peak or the step's, each with a tied weight held once.
        rinfl = prob.recomputing[s] if term.choice != "none" else 0
        during = term.memory - max(prob.in_flight[s] * term.kept + rinfl * term.remade, term.workspace - term.working)
        workspace = term.workspace - prob.step_workspace_per_held * twice[s]
        working = term.working - prob.working_per_held * twice[s]
        state = during - term.working - prob.held_factor * twice[s]
        fwd = float(prob.fwd[idx].sum()) / speed[s]
        bwd = float(prob.bwd[idx].sum()) / speed[s] if prob.training else 0.0
        bwd_w = float(prob.bwd_w[idx].sum()) / speed[s] if prob.training else 0.0
        compute = float(prob.work[idx].sum()) / speed[s]
        stats.append(StageStats(
            index=s, device=s, ops=[str(prob.order[i]) for i in idx],
            modules=module_range(tuple(prob.modules[i] for i in idx)),
            fwd=fwd, bwd=bwd, bwd_w=bwd_w, compute=compute,
            comm_in_bytes=cin_b[s], comm_out_bytes=cout_b[s],
            comm_in_time=cin_t[s], comm_out_time=cout_t[s],
            time=compute + term.recompute_time + cin_t[s] + cout_t[s],
            params=float(prob.held[idx].sum() - twice[s]), buffers=float(prob.buffers[idx].sum()),
            activations=term.kept, in_flight=prob.in_flight[s],
            memory=state + max(working + prob.in_flight[s] * term.kept + rinfl * term.remade, workspace),
            memory_limit=prob.mem_limit[s], recompute=term.choice, recompute_time=term.recompute_time,
            recompute_bytes=term.remade, recomputing=rinfl, workspace=workspace, working=working))
    times = [st.time for st in stats]
    worst = int(np.argmax(times))
    part = Partition(
        stage_of={prob.order[i]: int(s) for i, s in enumerate(assign)},
        stages=stats, transfers=transfers, bottleneck=times[worst], bottleneck_stage=worst,
        lower_bound=0.0, optimal=False, gap=1.0, method=method, solve_seconds=solve_seconds,
        cluster=prob.cluster.to_dict(), microbatches=prob.microbatches, schedule=prob.schedule,
        training=prob.training, memory_limit=prob.settings.memory_limit, state_factor=prob.state_factor,
        workspace_factor=prob.workspace_factor, working_factor=prob.working_factor, recompute_mode=prob.recompute_mode if choices is None else "given",
        active_microbatches=prob.active_microbatches)
    name, bound = strongest_bound(prob)
    part.with_report(lower_bound=bound, bound_by=name)
    over = [st.index for st in stats if not st.fits]
    if over:
        part.notes.append(f"stages {over} exceed their memory limit")
    return part


def module_range(modules: Sequence[str]) -> str:
    """A short human label for the module paths of a stage's ops, e.g. "embed, layers.0–5".

    Numbered modules (``layers.3.attn``) are grouped by prefix into runs of consecutive
    numbers. A range never spans numbers the stage does not hold: when a prefix has several
    runs, the run with the most ops is the label and the others are listed with their op
    count, "layers.0–1 (+1 op of 3)", because a stray op (a parameterless mask or rotary
    computation of a later layer) must not read as the layers in between.
    """
    return _module_range(tuple(modules))


@functools.lru_cache(maxsize=1024)  # a search re-labels the stages a move did not change
def _module_range(modules: tuple[str, ...]) -> str:
    groups: dict[str, dict[int, int]] = {}  # prefix -> layer number -> ops
    for m in modules:
        if not m:
            continue
        parts = m.split(".")
        k = next((j for j, x in enumerate(parts) if x.isdigit()), None)
        if k is None:
            groups.setdefault(parts[0], {})
        else:
            counts = groups.setdefault(".".join(parts[:k]), {})
            counts[int(parts[k])] = counts.get(int(parts[k]), 0) + 1
    labels: list[str] = []
    numbered: list[bool] = []
    for prefix, counts in groups.items():
        numbered.append(bool(counts))
        if not counts:
            labels.append(prefix)
            continue
        runs: list[list[int]] = []
        for n in sorted(counts):
            if runs and n == runs[-1][-1] + 1:
                runs[-1].append(n)
            else:
                runs.append([n])
        main = max(runs, key=lambda run: sum(counts[n] for n in run))
        head = f"{prefix}." if prefix else ""
        label = head + _span(main)
        strays = [f"{sum(counts[n] for n in run)} op{'s' if sum(counts[n] for n in run) > 1 else ''} of {_span(run)}"
                  for run in runs if run is not main]
        labels.append(label + (f" (+{', '.join(strays)})" if strays else ""))
    if len(labels) <= 3:
        return ", ".join(labels)
    # Layer ranges say most about a stage: keep them all, plus the first and last label,
    # and mark what was left out between them.
    keep = [i for i in range(len(labels)) if numbered[i] or i in (0, len(labels) - 1)]
    parts: list[str] = []
    for a, i in enumerate(keep):
        if a and i != keep[a - 1] + 1:
            parts.append("…")
        parts.append(labels[i])
    return ", ".join(parts)


def _span(run: Sequence[int]) -> str:
    return f"{run[0]}" if len(run) == 1 else f"{run[0]}–{run[-1]}"



def evaluate(graph: OpGraph | nx.DiGraph, stage_of: Mapping[Hashable, int],
             settings: ProblemSettings | None = None, *, method: str = "manual", **options: Any) -> Partition:
    """The cost of any assignment ``stage_of`` (node -> stage index), per stage and overall.

    ``settings`` (:class:`~partitioner.problem.ProblemSettings`), or ``options`` naming its fields
    (``cluster=``, ``microbatches=``, ``schedule=``, ...; beside ``settings``, the fields they
    change). ``stages`` defaults to the largest stage index + 1; ``ranks`` is the pipeline ranks an
    interleaved schedule spreads them over (default: one stage per rank). ``recompute``:
    one choice for every stage ("none", the default, "selective", "full", "offload"), one per stage, or "auto"
    (each stage the fastest choice that fits its memory). ``active_microbatches``: a cap on
    microbatches in flight (gpipe, 1f1b). Raises
    :class:`~partitioner.errors.InvalidAssignmentError` when the assignment is not a
    pipeline (an op without a stage, an empty stage, an edge flowing to an earlier
    stage). Memory over the limit is reported (``Partition.memory_ok``, ``notes``), not
    raised: this function measures, solvers enforce.
    """
    if settings is None and options.get("stages") is None:
        if not stage_of:
            raise InvalidAssignmentError("stage_of is empty; map every node to a stage")
        options["stages"] = int(max(stage_of.values())) + 1
    prob = Problem(graph, settings, **options)
    assign = prob.assignment(stage_of)
    problems = prob.check(assign)
    if problems:
        raise InvalidAssignmentError("not a valid pipeline assignment: " + "; ".join(problems)
                                     + ". Every stage needs an op and data may only flow to the same or a later stage.")
    return partition(prob, assign, method=method)
