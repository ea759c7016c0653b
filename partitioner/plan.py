"""The Plan: the compiler's artifact (partition, per-rank schedule, simulated figures) and its JSON form."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import Any

from partitioner.buckets import BUCKET_BYTES, gradient_buckets
from partitioner.checks import whole
from partitioner.cluster import Cluster, Link
from partitioner.cost import Partition, evaluate
from partitioner.errors import InvalidAssignmentError, PlanError
from partitioner.graph import OUTPUT_OP, OpGraph
from partitioner.ir import Schedule, ScheduleError, ScheduleKind, stage_graph_from_transfers
from partitioner.profile_measured import unstable_timing_warning
from partitioner.recompute import CHOICES
from partitioner.schedule import CAPPABLE, check_active_microbatches, make_schedule
from partitioner.sharding import state_bytes
from partitioner.simulate import SimResult, simulate, stage_costs_from
from partitioner.timeline import Timeline
from partitioner.units import format_bytes
from partitioner.walk import validate

__all__ = ["Plan", "PlanError", "ModelInfo", "PLAN_SCHEMA_VERSION", "PLACEMENTS", "package_version",
           "schedule_for", "simulate_partition"]

#: 2: typed model section; microbatches, ranks and fx_stage_of derived, not stored.
PLAN_SCHEMA_VERSION = 2

#: How D x P ranks are laid out (SMP v1's names): "cluster" puts each pipeline on consecutive
#: ranks (inside a node when it fits: activations cross the fast links, gradients the slower
#: ones), "spread" puts each stage's replicas on consecutive ranks (gradients on the fast links).
PLACEMENTS = ("cluster", "spread")


def package_version() -> str:
    """The installed smp version (plans record which version wrote them)."""
    try:
        return metadata.version("smp")
    except metadata.PackageNotFoundError:  # a bare checkout on sys.path
        return "0+unknown"


@dataclass(frozen=True)
class ModelInfo:
    """What a plan was made for: the traced model's identity, its step batch and how it was profiled.

    ``fingerprint`` (:func:`partitioner.program.fingerprint`) identifies the traced ops and
    parameter shapes; the runtime refuses a plan whose fingerprint is not the model's.
    ``batch_size`` is the whole batch of one training step (all microbatches). ``compiled``: priced
    for stages compiled with ``torch.compile``, which the runtime then compiles.
    """

    name: str = "model"
    fingerprint: str = "unknown"
    class_name: str | None = None
    frontend: str | None = None
    leaf_modules: tuple[str, ...] = ()
    batch_size: int | None = None
    inputs: Mapping[str, Any] | None = None
    num_params: int | None = None
    param_bytes: int | None = None
    training: bool = True
    timing: str | None = None
    profiled_on: str | None = None
    compiled: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["leaf_modules"] = list(self.leaf_modules)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelInfo:
        d = dict(d)
        if "class" in d:  # schema 1 spelled it "class"
            d.setdefault("class_name", d.pop("class"))
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["leaf_modules"] = tuple(kwargs.get("leaf_modules") or ())
        return cls(**kwargs)


@dataclass
class Plan:
    """Which op runs on which stage, every rank's program, and what it is predicted to cost.

    The parts are typed and nothing derivable is stored twice: the microbatch count and
    the ranks are the schedule's, ``fx_stage_of`` (every traced call node's stage, which
    the runtime splits the program with) follows from the graph and the partition.
    With ``data_parallel`` > 1 the pipeline is replicated; ``placement`` says how the
    D x P ranks are laid out ("cluster": each pipeline on consecutive ranks, inside a node
    where it fits; "spread": each stage's replicas on consecutive ranks) and ``dp_link`` is
    the link its gradient all-reduces are priced on. ``sharding_weighed``: when the planner chose the
    sharding (``sharding="auto"``), each mode's verdict (chosen, slower, does not fit, not weighed).
    ``tensor_parallel`` (T): each stage's modules split over T ranks (runtime/tensor_parallel.py), the
    world D x P x T; recorded as asked, the prices are still those of T = 1. ``sequence_parallel``: between
    the split modules the ops run on each tp rank's chunk of the sequence (partitioner/tp_graph.py), as the
    runtime runs the plan.
    """

    model: ModelInfo
    graph: OpGraph
    partition: Partition
    schedule: Schedule
    simulated: SimResult
    smp_version: str = field(default_factory=package_version)
    schema: int = PLAN_SCHEMA_VERSION
    placement: str = "cluster"
    dp_link: Link | None = None  # what a stage's replicas all-reduce its gradients over (data_parallel > 1)
    sharding_weighed: dict[str, str] = field(default_factory=dict)
    tensor_parallel: int = 1  # ranks each stage's modules are split over (T); the world is D x P x T
    sequence_parallel: bool = False  # the rowwise outputs reduce-scattered on the sequence (T > 1 only)

    # ---------------------------------------------------------------- views

    @property
    def microbatches(self) -> int:
        return self.schedule.num_microbatches

    @property
    def pipeline_ranks(self) -> int:
        """Ranks of one pipeline (P)."""
        return self.schedule.num_ranks

    @property
    def data_parallel(self) -> int:
        """Replicas of the pipeline (D), each on its own P ranks with its share of the global batch."""
        return self.schedule.data_parallel

    @property
    def sharding(self) -> str:
        """How a stage's replicas hold its parameters, gradients and optimizer state (:mod:`partitioner.sharding`)."""
        return self.schedule.sharding

    @property
    def num_ranks(self) -> int:
        """Every rank the plan runs on: D x P."""
        return self.pipeline_ranks * self.data_parallel

    @property
    def num_stages(self) -> int:
        return self.partition.num_stages

    @property
    def schedule_name(self) -> str:
        return self.schedule.name

    @property
    def active_microbatches(self) -> int | None:
        """The cap on microbatches a stage holds in flight (None: the schedule's own warm-up)."""
        return self.schedule.meta.get("active_microbatches")

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.pipeline_ranks

    @property
    def step_time(self) -> float:
        return self.simulated.step_time

    @property
    def bubble(self) -> float:
        return self.simulated.bubble_fraction

    @property
    def single_device_time(self) -> float:
        """One device running the whole model on the step's whole batch (every replica's every
        microbatch), no communication: what ``speedup`` compares the D x P ranks with."""
        devices = self.partition.cluster.get("devices")
        speed = max(d["speed"] for d in devices) if devices else 1.0
        # a graph priced for T tp ranks records each op's unsplit time (partitioner/tensor_parallel.py)
        fwd, bwd = ("tp_whole_fwd", "tp_whole_bwd") if self.tensor_parallel > 1 else ("fwd", "bwd")
        work = sum(node.get(fwd, node["fwd"]) + (node.get(bwd, node["bwd"]) if self.partition.training else 0.0)
                   for node in (self.graph[v] for v in self.graph.nx))
        return self.data_parallel * self.microbatches * work / speed

    @property
    def speedup(self) -> float:
        return self.single_device_time / self.step_time if self.step_time > 0 else math.inf

    @property
    def timing_spread(self) -> float | None:
        """How steady the measured profile was: the relative spread of its sweeps' totals, as profiling
        recorded it in the graph's meta (None: analytic timing, or a graph profiled before smp recorded it)."""
        return self.graph.meta.get("timing_spread")

    @property
    def timing_warning(self) -> str | None:
        """A warning to show with the plan when its profile's timings were unstable (None: they were steady)."""
        return unstable_timing_warning(self.timing_spread)

    @property
    def stage_memory(self) -> list[float]:
        """Each stage's predicted peak bytes: its state, what it keeps per microbatch times its microbatches
        in flight, and what its recomputation re-creates (``StageStats.memory``)."""
        return [s.memory for s in self.partition.stages]

    @property
    def recompute(self) -> list[str]:
        """Each stage's activation recomputation, "none", "selective", "full" or "offload" (what the runtime executes)."""
        return self.partition.recompute

    @property
    def rank_memory(self) -> list[float]:
        """Each rank's predicted peak bytes: its stages' state plus the larger of the simulated peak of their
        activations, with what sharding holds whole while they compute (``StageStats.working``), and the
        optimizer step's workspace (the step comes after the last backward).

        With several stages per rank (interleaved) the activations peak together only as
        the schedule's order makes them, which the simulator follows; the stages' own
        peaks summed (``stage_memory``) are an upper bound.
        """
        per_rank = self.simulated.peak_activation_bytes_per_rank
        out = []
        for r in range(self.pipeline_ranks):
            stages = [self.partition.stages[s] for s in self.schedule.stages_of(r)]
            acts = per_rank[r] if per_rank is not None else sum(s.activation_peak for s in stages)
            computing = sum(s.working for s in stages) + acts
            out.append(sum(s.state for s in stages) + max(computing, sum(s.workspace for s in stages)))
        return out

    @cached_property
    def fx_to_op(self) -> dict[str, str]:
        """Each traced fx node's OpGraph node (several fx nodes per op after coarsening)."""
        return {fx_name: str(node) for node in self.graph.nx for fx_name in self.graph[node]["fx_nodes"]}

    @cached_property
    def fx_stage_of(self) -> dict[str, int]:
        """Each traced fx node's stage."""
        stage_of = self.partition.stage_of
        return {fx_name: int(stage_of[op]) for fx_name, op in self.fx_to_op.items()}

    def timeline(self) -> Timeline | None:
        return self.simulated.timeline

    def stage_ranks(self) -> list[int]:
        return list(self.schedule.stage_to_rank)

    # ---------------------------------------------------------------- consistency

    def check(self) -> None:
        """Raise PlanError when the parts disagree (a hand-edited or damaged plan file)."""
        part, sched = self.partition, self.schedule
        where = "the plan is inconsistent"
        if isinstance(self.tensor_parallel, bool) or not isinstance(self.tensor_parallel, int) \
                or self.tensor_parallel < 1:
            raise PlanError(f"{where}: tensor_parallel is {self.tensor_parallel!r}, not a whole number >= 1; "
                            "re-create it with `smp plan`")
        if not isinstance(self.sequence_parallel, bool) or (self.sequence_parallel and self.tensor_parallel == 1):
            raise PlanError(f"{where}: sequence_parallel is {self.sequence_parallel!r} at tensor_parallel="
                            f"{self.tensor_parallel} (True or False, and False without tensor parallelism); "
                            "re-create it with `smp plan`")
        priced = (self.graph.meta.get("tensor_parallel", 1), bool(self.graph.meta.get("sequence_parallel", False)))
        if priced != (self.tensor_parallel, self.sequence_parallel):
            raise PlanError(f"{where}: it runs tensor_parallel={self.tensor_parallel}, sequence_parallel="
                            f"{self.sequence_parallel} on a graph priced for tensor_parallel={priced[0]}, "
                            f"sequence_parallel={priced[1]}; re-create it with `smp plan`")
        nodes = {str(n) for n in self.graph.nx}
        assigned = set(part.stage_of)
        if nodes != assigned:
            extra, missing = sorted(assigned - nodes), sorted(nodes - assigned)
            raise PlanError(f"{where}: its partition does not cover the op graph (ops without a stage: "
                            f"{missing[:3]}, unknown ops: {extra[:3]}); re-create it with `smp plan`")
        bad = [(st.index, st.recompute) for st in part.stages if st.recompute not in CHOICES]
        if bad:
            raise PlanError(f"{where}: stage {bad[0][0]} has recompute {bad[0][1]!r}; each stage takes one of "
                            f"{', '.join(CHOICES)}; re-create it with `smp plan`")
        if sched.num_stages != part.num_stages:
            raise PlanError(f"{where}: the schedule has {sched.num_stages} stages, the partition "
                            f"{part.num_stages}; re-create it with `smp plan`")
        try:
            derived = evaluate(self.graph, part.stage_of, stages=part.num_stages)
        except InvalidAssignmentError as err:
            raise PlanError(f"{where}: its stage assignment is not a pipeline ({err}); re-create it with "
                            "`smp plan`") from None
        self._check_derived(derived)
        expected = stage_graph_from_transfers(part.num_stages, part.transfers)
        if {e.key for e in expected.edges} != {e.key for e in sched.graph.edges}:
            raise PlanError(f"{where}: the schedule's cut tensors are not the partition's; re-create it with "
                            "`smp plan`")
        try:
            validate(sched)
        except ScheduleError as err:
            raise PlanError(f"{where}: its schedule does not run ({err}); re-create it with `smp plan`") from None

    def _check_derived(self, derived: Partition) -> None:
        """Raise PlanError when the stored stage table or cut tensors are not what ``stage_of`` makes.

        They are computed from ``stage_of`` when planning, so a ``stage_of`` edited alone
        (still a pipeline) would show a stale table and fail at the first step.
        """
        part = self.partition
        fix = ("the stage table, cut tensors, schedule and simulated times are computed from stage_of, so it "
               "cannot be edited alone: re-create the plan with `smp plan`")
        in_table = {str(v): st.index for st in part.stages for v in st.ops}
        assigned = {str(v): st for v, st in part.stage_of.items()}
        moved = sorted(v for v, st in assigned.items() if in_table.get(v) != st)
        if moved:
            op = moved[0]
            raise PlanError(
                f"the plan is inconsistent: its stage_of puts op {op!r} on stage {assigned[op]}, its stage "
                f"table on stage {in_table.get(op)} ({len(moved)} op(s) differ; was the file edited by hand?); {fix}")
        cut = {(t.src_stage, t.dst_stage, str(t.node)) for t in part.transfers}
        made_cut = {(t.src_stage, t.dst_stage, str(t.node)) for t in derived.transfers}
        if cut != made_cut:
            src, dst, node = sorted(cut ^ made_cut)[0]
            said = "lists" if (src, dst, node) in cut else "lacks"
            raise PlanError(
                f"the plan is inconsistent: its cut tensors are not what its stage_of makes (it {said} {node!r} "
                f"from stage {src} to stage {dst}; was the file edited by hand?); {fix}")

    # ---------------------------------------------------------------- re-timing

    def resimulate(self, *, schedule: str | None = None, microbatches: int | None = None,
                   cluster: Cluster | None = None, recompute: str | Sequence[str] | None = None,
                   active_microbatches: int | None | str = "same") -> Plan:
        """The same stage assignment under another schedule, microbatch count, cluster, recomputation
        (one choice for every stage, or one per stage) or cap on microbatches in flight
        (``active_microbatches``: "same" keeps the plan's where the schedule takes one, None drops it).

        Per-microbatch costs scale with the microbatch size: going from m to m'
        microbatches of one batch multiplies op times and activation bytes by m / m'.
        """
        kind = ScheduleKind.parse(schedule) if schedule else ScheduleKind.parse(self.schedule_name)
        m = self.microbatches if microbatches is None else whole(microbatches, "microbatches")
        batch = self.model.batch_size
        if isinstance(batch, int) and batch % m:
            raise PlanError(f"the batch of {batch} does not split into {m} microbatches; use a count that divides "
                            f"{batch}, or re-plan with another batch size")
        if kind.interleaved != ScheduleKind.parse(self.schedule_name).interleaved:
            raise PlanError(
                "interleaving changes the number of stages per rank, so the assignment must be solved again: "
                f"run `smp plan` with --schedule {kind.value}")
        if cluster is not None and self.tensor_parallel > 1:
            raise PlanError(f"this plan splits its stages over {self.tensor_parallel} tensor-parallel ranks, whose "
                            "collectives are priced on its own cluster's links: plan again for the other cluster "
                            f"(smp.plan(..., tensor_parallel={self.tensor_parallel}, cluster=...)); its schedule, "
                            "microbatches and recomputation can still be changed here")
        cap = active_microbatches
        if cap == "same":
            cap = self.active_microbatches if kind in CAPPABLE else None
        check_active_microbatches(kind, cap)  # type: ignore[arg-type]
        graph = self.graph if m == self.microbatches else self.graph.scaled(self.microbatches / m)
        ranks = self.pipeline_ranks
        dp_link = self.dp_link
        if cluster is not None:  # the pipeline's devices and the replicas' link on the new cluster, same layout
            pipeline, dp_link = replica_layout(cluster.for_stages(self.num_ranks), ranks, self.data_parallel,
                                               self.placement)
            assert pipeline is not None
            stage_cluster = pipeline.interleaved(ranks, self.virtual_stages)
        else:
            stage_cluster = Cluster.from_dict(self.partition.cluster)
        old = self.partition
        part = evaluate(graph, old.stage_of, old.settings(ranks), cluster=stage_cluster, microbatches=m,
                        schedule=kind.value, recompute=old.recompute if recompute is None else recompute,
                        active_microbatches=cap)
        # What the original solve proved carries over only to the same cluster and, under a
        # memory limit, the same schedule (another schedule's memory may allow better plans).
        # Op costs scale by s = m / m' but link latency does not, so a stage's time s*C + T is
        # at least min(s, 1) times its old C + T: the old bound, times min(s, 1), still holds.
        same_problem = cluster is None and (old.memory_limit is None or (
            kind.value == self.schedule_name and cap == self.active_microbatches)) and \
            list(part.recompute) == list(old.recompute)
        scale = graph.total_fwd / max(self.graph.total_fwd, 1e-30)
        part.with_report(lower_bound=old.lower_bound * min(scale, 1.0) if same_problem else None,
                         optimal=same_problem and m == self.microbatches and old.optimal and part.memory_ok,
                         method=old.method, solve_seconds=old.solve_seconds,
                         notes=[f"re-timed from {self.schedule_name}, m={self.microbatches}"
                                + (", on another cluster" if cluster is not None else "")])
        sched = schedule_for(kind, part, m, ranks, self.data_parallel, sharding=self.sharding)
        return replace(self, graph=graph, partition=part, schedule=sched, dp_link=dp_link, sharding_weighed={},
                       simulated=simulate_partition(sched, part, dp_link, graph))

    # ---------------------------------------------------------------- (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "smp.Plan",
            "schema": PLAN_SCHEMA_VERSION,
            "smp_version": self.smp_version,
            "model": self.model.to_dict(),
            "summary": {  # for people reading the file; derived, ignored when loading
                "schedule": self.schedule_name,
                "microbatches": self.microbatches,
                "num_ranks": self.num_ranks,
                "pipeline_ranks": self.pipeline_ranks,
                "data_parallel": self.data_parallel,
                "num_stages": self.num_stages,
                "step_time": self.step_time,
                "bubble_fraction": self.bubble,
                "bottleneck": self.partition.bottleneck,
                "lower_bound": self.partition.lower_bound,
                "gap": self.partition.gap,
                "optimal": self.partition.optimal,
                "speedup": self.speedup,
                "recompute": self.recompute,
                "active_microbatches": self.active_microbatches,
                "sharding": self.sharding,
                "tensor_parallel": self.tensor_parallel,
                "sequence_parallel": self.sequence_parallel,
            },
            "partition": self.partition.to_dict(),
            "schedule": self.schedule.to_dict(),
            "replicas": {"placement": self.placement,
                         "link": self.dp_link.to_dict() if self.dp_link is not None else None,
                         "sharding_weighed": dict(self.sharding_weighed),
                         "tensor_parallel": self.tensor_parallel, "sequence_parallel": self.sequence_parallel},
            "simulated": self.simulated.to_dict(),
            "graph": self.graph.to_dict(),
        }

    def save(self, path: str | Path) -> Path:
        """Write the plan as indented JSON (human-diffable); returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1, default=_json_default) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """A plan from its JSON form (this schema or the previous one); the parts are checked to agree."""
        if not isinstance(data, Mapping) or data.get("kind") != "smp.Plan":
            raise PlanError("not an smp plan: the JSON has no \"kind\": \"smp.Plan\" (make one with `smp plan`)")
        schema = data.get("schema", 0)
        if not isinstance(schema, int) or schema > PLAN_SCHEMA_VERSION:
            raise PlanError(f"this plan uses schema {schema}, written by smp {data.get('smp_version', '?')}; this "
                            f"smp ({package_version()}) reads schema {PLAN_SCHEMA_VERSION} and older: upgrade smp, "
                            "or re-plan with this version")
        try:
            plan = cls(
                model=ModelInfo.from_dict(data["model"]),
                graph=OpGraph.from_dict(data["graph"]),
                partition=Partition.from_dict(data["partition"]),
                schedule=Schedule.from_dict(data["schedule"]),
                simulated=SimResult.from_dict(data["simulated"]),
                smp_version=str(data.get("smp_version", "?")),
                schema=schema,
                placement=str(data.get("replicas", {}).get("placement", "cluster")),
                dp_link=Link.from_dict(data["replicas"]["link"]) if data.get("replicas", {}).get("link") else None,
                sharding_weighed={str(k): str(v) for k, v in
                                  (data.get("replicas", {}).get("sharding_weighed") or {}).items()},
                tensor_parallel=data.get("replicas", {}).get("tensor_parallel", 1),  # older files: none; check() refuses 2.5
                sequence_parallel=data.get("replicas", {}).get("sequence_parallel", False),
            )
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            missing = f"missing field {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
            raise PlanError(f"the plan file is damaged ({missing}); re-create it with `smp plan`") from None
        plan.check()
        return plan

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by ``save``; a damaged, inconsistent or newer-schema file gets a clear error."""
        path = Path(path)
        if not path.exists():
            raise PlanError(f"no plan file at {path}; make one with `smp plan MODEL --stages N -o {path}`")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise PlanError(f"{path} is not a valid plan file (bad JSON: {err}); re-create it with `smp plan`") from None
        return cls.from_dict(data)

    # ---------------------------------------------------------------- people

    def stage_rows(self) -> list[dict[str, Any]]:
        """One dict per stage with the figures people look at first."""
        part = self.partition
        rows = []
        for s, split in zip(part.stages, self.memory_split()):
            rows.append({
                "stage": s.index,
                "rank": self.schedule.stage_to_rank[s.index],
                "modules": s.modules,
                # the graph's output node is no op: the stages' counts add up to len(self.graph), the headline's
                "ops": sum(1 for v in s.ops if self.graph[v]["op"] != OUTPUT_OP),
                "params": s.params,
                "activations": s.activations,
                "workspace": s.workspace,
                "fwd": s.fwd,
                "bwd": s.bwd,
                "comm_in": s.comm_in_time,
                "comm_out": s.comm_out_time,
                "comm_in_bytes": s.comm_in_bytes,
                "comm_out_bytes": s.comm_out_bytes,
                "time": s.time,
                "recompute": s.recompute,
                "recompute_time": s.recompute_time,
                "memory": s.memory,
                "memory_limit": s.memory_limit,
                "share": s.time / part.bottleneck if part.bottleneck > 0 else 0.0,
                "memory_split": split,
            })
        return rows

    def memory_split(self) -> list[dict[str, float]]:
        """Each stage's rank at its peak, by what it holds (bytes): ``parameters`` (its shard, and the gathered
        copy), ``gradients`` (their shard, and the whole ones before the reduce-scatter, or plain data
        parallelism's buckets), ``optimizer`` state, ``activations`` (in flight and recomputed), ``other``
        (buffers, the optimizer step's workspace where it is the peak; less a tied weight held once). The memory the sharding mode holds, :func:`partitioner.sharding.state_bytes`.
        """
        part = self.partition
        held = state_bytes(self.sharding, self.data_parallel, part.workspace_factor, stages_per_rank=self.virtual_stages)
        out = []
        for s in part.stages:
            p = float(s.params)
            if part.training:
                split = {"parameters": p * (held.parameters + held.gathered),
                         "gradients": p * (held.gradients + held.unsharded_gradients + held.buckets),
                         "optimizer": p * held.optimizer}
            else:
                split = {"parameters": p, "gradients": 0.0, "optimizer": 0.0}
            split["activations"] = float(s.activation_peak)
            split["other"] = max(0.0, float(s.memory) - sum(split.values()))
            out.append(split)
        return out

    def summary(self) -> str:
        """The per-stage table and the headline figures, as plain text."""
        lines = [
            f"{self.model.name}: {len(self.graph)} ops into {self.num_stages} stages on "
            f"{self.num_ranks} ranks, {self.schedule_name}, {self.microbatches} microbatches",
            f"{'stage':>5} {'rank':>4} {'modules':<22} {'ops':>5} {'params':>10} {'act/mb':>10} {'fwd ms':>8} "
            f"{'bwd ms':>8} {'recompute':>9} {'comm ms':>8} {'memory':>10} {'limit':>10} {'share':>6}",
        ]
        for r in self.stage_rows():
            lines.append(
                f"{r['stage']:>5} {r['rank']:>4} {r['modules'][:22]:<22} {r['ops']:>5} {format_bytes(r['params']):>10} "
                f"{format_bytes(r['activations']):>10} {r['fwd'] * 1e3:>8.3f} {r['bwd'] * 1e3:>8.3f} "
                f"{r['recompute']:>9} {(r['comm_in'] + r['comm_out']) * 1e3:>8.3f} {format_bytes(r['memory']):>10} "
                f"{format_bytes(r['memory_limit']):>10} {r['share']:>6.0%}")
        part = self.partition
        lines.append(
            f"predicted step {self.step_time * 1e3:.3f} ms, bubble {self.bubble:.1%}, speed-up {self.speedup:.2f}x "
            f"over one device; bottleneck {part.bottleneck * 1e3:.3f} ms, lower bound "
            f"{part.lower_bound * 1e3:.3f} ms, gap {part.gap:.2%}, "
            f"{'proven optimal' if part.optimal else 'not proven optimal'} ({part.method}, {part.solve_seconds:.2f} s)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Plan({self.model.name}, {self.num_stages} stages, {self.schedule_name}, "
                f"m={self.microbatches}, step={self.step_time * 1e3:.3f} ms)")


# ------------------------------------------------------------------ shared with the compiler


def replica_layout(cluster: Cluster | None, stages: int, replicas: int,
                   placement: str) -> tuple[Cluster | None, Link | None]:
    """(the devices of one pipeline as a cluster, the slowest link a stage's replicas all-reduce over)."""
    if cluster is None:
        return None, None
    if placement == "cluster":
        pipeline = list(range(stages))
        groups = [[d * stages + s for d in range(replicas)] for s in range(stages)]
    else:
        pipeline = [s * replicas for s in range(stages)]
        groups = [[s * replicas + d for d in range(replicas)] for s in range(stages)]
    links = [cluster.link(g[0], g[-1]) for g in groups if len(g) > 1]
    dp_link = min(links, key=lambda lk: (lk.bandwidth, -lk.latency)) if links else None
    return cluster.subset(pipeline), dp_link


def schedule_for(kind: ScheduleKind | str, part: Partition, microbatches: int, ranks: int,
                 data_parallel: int = 1, check: bool = True, sharding: str = "none") -> Schedule:
    """The per-rank programs of ``kind`` over the partition's cut tensors (for ``data_parallel`` replicas),
    under the cap on microbatches in flight the partition's memory was counted for (``check``: validated),
    the replicas holding each stage's state under ``sharding``."""
    graph = stage_graph_from_transfers(part.num_stages, part.transfers)
    return make_schedule(kind, graph, microbatches, num_ranks=ranks, data_parallel=data_parallel, sharding=sharding,
                         active_microbatches=part.active_microbatches, check=check)


def simulate_partition(schedule: Schedule, part: Partition, dp_link: Link | None = None,
                       graph: OpGraph | None = None) -> SimResult:
    """The schedule timed with the partition's stage and transfer costs, and each stage's gradient
    all-reduce (its held parameters' bytes, a ring over its replicas on ``dp_link``), whose last
    bucket (:mod:`partitioner.buckets`, filled in backward order: the ops' parameters from
    ``graph``, else one bucket's worth) is what remains after an overlapped backward. Sharded,
    each stage's parameter all-gather and gradient reduce-scatter instead (rings of its
    parameters' bytes on ``dp_link``, each (D - 1) / D of them per rank)."""
    costs = stage_costs_from(part.stages, part.transfers, act_bytes=[s.activations for s in part.stages])
    if schedule.data_parallel > 1:
        link = dp_link or Link()
        n = schedule.data_parallel
        if schedule.sharding == "none":
            costs.allreduce = [link.allreduce_seconds(s.params, n) for s in part.stages]
            costs.allreduce_tail = [link.allreduce_seconds(_last_bucket(s, graph), n) for s in part.stages]
        else:
            costs.allgather = [link.allgather_seconds(s.params, n) for s in part.stages]
            costs.reduce_scatter = [link.reduce_scatter_seconds(s.params, n) for s in part.stages]
    return simulate(schedule, costs)


def _last_bucket(stage: Any, graph: OpGraph | None) -> float:
    """Bytes of the last gradient bucket of a stage: its first ops' parameters, the last made final."""
    if graph is None:
        return min(float(stage.params), BUCKET_BYTES)
    sizes = [float(graph[v].get("params", 0)) for v in reversed(stage.ops)]
    sizes = [x for x in sizes if x > 0]
    if not sizes:
        return 0.0
    return sum(sizes[i] for i in gradient_buckets(sizes)[-1])


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)
