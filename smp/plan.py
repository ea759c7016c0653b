"""The Plan: smp's compiled artifact (partition, schedule, simulated figures), and smp.plan() that makes one."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner.cluster import Cluster, Device, Link
from partitioner.cost import Partition, evaluate, format_bytes
from partitioner.graph import OpGraph
from partitioner.microbatch import batch_size, split_microbatches
from partitioner.profile import profile
from partitioner.schedule import Schedule, make_schedule, stage_graph_from_transfers
from partitioner.simulate import SimResult, simulate, stage_costs_from
from partitioner.solve import solve
from partitioner.timeline import Timeline
from partitioner.trace import fingerprint, trace

__all__ = ["Plan", "PlanError", "plan", "plan_from_graph", "canonical_schedule", "PLAN_SCHEMA_VERSION", "SCHEDULE_NAMES"]

PLAN_SCHEMA_VERSION = 1

#: What users may type -> the schedule generator's name.
SCHEDULE_NAMES: dict[str, str] = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved": "interleaved_1f1b",
    "interleaved_1f1b": "interleaved_1f1b",
    "interleaved-1f1b": "interleaved_1f1b",
    "zb-h1": "zb_h1",
    "zb_h1": "zb_h1",
    "zbh1": "zb_h1",
}


class PlanError(ValueError):
    """A plan cannot be made, read or used as asked; the message says why and what to do."""


def canonical_schedule(name: str) -> str:
    """The generator name for a user-typed schedule name ('interleaved' -> 'interleaved_1f1b')."""
    key = name.strip().lower()
    if key not in SCHEDULE_NAMES:
        raise PlanError(f"unknown schedule {name!r}; choose gpipe, 1f1b, interleaved or zb-h1")
    return SCHEDULE_NAMES[key]


def _version() -> str:
    from smp import __version__
    return __version__


@dataclass
class Plan:
    """Which op runs on which stage, the per-rank program, and what it is predicted to cost.

    ``fx_stage_of`` maps every call node of the traced program to its stage: the runtime
    splits the program with it. ``model["fingerprint"]`` identifies the traced model, so
    a plan is never run on another model by mistake.
    """

    model: dict[str, Any]
    graph: OpGraph
    partition: Partition
    schedule: Schedule
    microbatches: int
    num_ranks: int
    fx_stage_of: dict[str, int]
    simulated: dict[str, Any]
    smp_version: str = field(default_factory=_version)
    schema: int = PLAN_SCHEMA_VERSION

    # ---------------------------------------------------------------- views

    @property
    def num_stages(self) -> int:
        return self.partition.num_stages

    @property
    def schedule_name(self) -> str:
        return self.schedule.name

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.num_ranks

    @property
    def step_time(self) -> float:
        return float(self.simulated["step_time"])

    @property
    def bubble(self) -> float:
        return float(self.simulated["bubble_fraction"])

    @property
    def single_device_time(self) -> float:
        """One device running the whole model on every microbatch, no communication."""
        speed = max(d["speed"] for d in self.partition.cluster["devices"]) if self.partition.cluster.get(
            "devices") else 1.0
        work = self.graph.total_fwd + (self.graph.total_bwd if self.partition.training else 0.0)
        return self.microbatches * work / speed

    @property
    def speedup(self) -> float:
        return self.single_device_time / self.step_time if self.step_time > 0 else math.inf

    def timeline(self) -> Timeline | None:
        data = self.simulated.get("timeline")
        return Timeline.from_dict(data) if data else None

    def stage_ranks(self) -> list[int]:
        return list(self.schedule.stage_to_rank)

    # ---------------------------------------------------------------- re-timing

    def resimulate(self, *, schedule: str | None = None, microbatches: int | None = None,
                   cluster: Cluster | None = None) -> Plan:
        """The same stage assignment under another schedule, microbatch count or cluster.

        Per-microbatch costs scale with the microbatch size: going from m to m'
        microbatches of one batch multiplies op times and activation bytes by m / m'.
        """
        name = canonical_schedule(schedule) if schedule else self.schedule_name
        m = self.microbatches if microbatches is None else int(microbatches)
        if m < 1:
            raise PlanError(f"microbatches must be >= 1, got {m}")
        batch = self.model.get("batch_size")
        if isinstance(batch, int) and batch % m:
            raise PlanError(f"the batch of {batch} does not split into {m} microbatches; use a count that divides "
                            f"{batch}, or re-plan with another batch size")
        if (name == "interleaved_1f1b") != (self.schedule_name == "interleaved_1f1b"):
            raise PlanError(
                "interleaving changes the number of stages per rank, so the assignment must be solved again: "
                f"run `smp plan` with --schedule {schedule}")
        graph = self.graph if m == self.microbatches else _scale_graph(self.graph, self.microbatches / m)
        ranks = self.num_ranks
        stage_cluster = (_virtual_cluster(_resolve_cluster(cluster, ranks), ranks, self.virtual_stages)
                         if cluster is not None else Cluster.from_dict(self.partition.cluster))
        part = evaluate(graph, self.partition.stage_of, cluster=stage_cluster,
                        microbatches=m, schedule=_memory_schedule(name), training=self.partition.training,
                        memory_limit=self.partition.memory_limit, state_factor=self.partition.state_factor)
        # What the original solve proved carries over only to the same cluster and, under a
        # memory limit, the same schedule (another schedule's memory may allow better plans).
        # Op costs scale by s = m / m' but link latency does not, so a stage's time s*C + T is
        # at least min(s, 1) times its old C + T: the old bound, times min(s, 1), still holds.
        same_problem = cluster is None and (self.partition.memory_limit is None or name == self.schedule_name)
        scale = graph.total_fwd / max(self.graph.total_fwd, 1e-30)
        part.with_report(lower_bound=self.partition.lower_bound * min(scale, 1.0) if same_problem else None,
                         optimal=same_problem and m == self.microbatches and self.partition.optimal and part.memory_ok,
                         method=self.partition.method, solve_seconds=self.partition.solve_seconds,
                         notes=[f"re-timed from {self.schedule_name}, m={self.microbatches}"
                                + (", on another cluster" if cluster is not None else "")])
        sched = _make_schedule(name, part, m, ranks)
        sim = simulate(sched, stage_costs_from(part.stages, part.transfers,
                                               act_bytes=[s.activations for s in part.stages]))
        return replace(self, graph=graph, partition=part, schedule=sched, microbatches=m, simulated=sim.to_dict())

    # ---------------------------------------------------------------- (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "smp.Plan",
            "schema": self.schema,
            "smp_version": self.smp_version,
            "model": self.model,
            "schedule_name": self.schedule_name,
            "microbatches": self.microbatches,
            "num_ranks": self.num_ranks,
            "num_stages": self.num_stages,
            "summary": {
                "step_time": self.step_time,
                "bubble_fraction": self.bubble,
                "bottleneck": self.partition.bottleneck,
                "lower_bound": self.partition.lower_bound,
                "gap": self.partition.gap,
                "optimal": self.partition.optimal,
                "speedup": self.speedup,
            },
            "partition": self.partition.to_dict(),
            "fx_stage_of": self.fx_stage_of,
            "schedule": self.schedule.to_dict(),
            "simulated": self.simulated,
            "graph": self.graph.to_dict(),
        }

    def save(self, path: str | Path) -> Path:
        """Write the plan as indented JSON (human-diffable); returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1, default=_json_default) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        if not isinstance(data, Mapping) or data.get("kind") != "smp.Plan":
            raise PlanError("not an smp plan: the JSON has no \"kind\": \"smp.Plan\" (make one with `smp plan`)")
        schema = data.get("schema", 0)
        if not isinstance(schema, int) or schema > PLAN_SCHEMA_VERSION:
            raise PlanError(f"this plan uses schema {schema}, written by smp {data.get('smp_version', '?')}; this "
                            f"smp ({_version()}) reads schema {PLAN_SCHEMA_VERSION} and older: upgrade smp, or "
                            "re-plan with this version")
        try:
            return cls(
                model=dict(data["model"]),
                graph=OpGraph.from_dict(data["graph"]),
                partition=Partition.from_dict(data["partition"]),
                schedule=Schedule.from_dict(data["schedule"]),
                microbatches=int(data["microbatches"]),
                num_ranks=int(data["num_ranks"]),
                fx_stage_of={str(k): int(v) for k, v in data["fx_stage_of"].items()},
                simulated=dict(data["simulated"]),
                smp_version=str(data.get("smp_version", "?")),
                schema=schema,
            )
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            missing = f"missing field {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
            raise PlanError(f"the plan file is damaged ({missing}); re-create it with `smp plan`") from None

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by ``save``; a damaged or newer-schema file gets a clear error."""
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
        for s in part.stages:
            rows.append({
                "stage": s.index,
                "rank": self.schedule.stage_to_rank[s.index],
                "modules": s.modules,
                "ops": len(s.ops),
                "params": s.params,
                "activations": s.activations,
                "fwd": s.fwd,
                "bwd": s.bwd,
                "comm_in": s.comm_in_time,
                "comm_out": s.comm_out_time,
                "comm_in_bytes": s.comm_in_bytes,
                "comm_out_bytes": s.comm_out_bytes,
                "time": s.time,
                "memory": s.memory,
                "memory_limit": s.memory_limit,
                "share": s.time / part.bottleneck if part.bottleneck > 0 else 0.0,
            })
        return rows

    def summary(self) -> str:
        """The per-stage table and the headline figures, as plain text."""
        lines = [
            f"{self.model.get('name', 'model')}: {len(self.graph)} ops into {self.num_stages} stages on "
            f"{self.num_ranks} ranks, {self.schedule_name}, {self.microbatches} microbatches",
            f"{'stage':>5} {'rank':>4} {'modules':<22} {'ops':>5} {'params':>10} {'act/mb':>10} {'fwd ms':>8} "
            f"{'bwd ms':>8} {'comm ms':>8} {'memory':>10} {'limit':>10} {'share':>6}",
        ]
        for r in self.stage_rows():
            lines.append(
                f"{r['stage']:>5} {r['rank']:>4} {r['modules'][:22]:<22} {r['ops']:>5} {format_bytes(r['params']):>10} "
                f"{format_bytes(r['activations']):>10} {r['fwd'] * 1e3:>8.3f} {r['bwd'] * 1e3:>8.3f} "
                f"{(r['comm_in'] + r['comm_out']) * 1e3:>8.3f} {format_bytes(r['memory']):>10} "
                f"{format_bytes(r['memory_limit']):>10} {r['share']:>6.0%}")
        part = self.partition
        lines.append(
            f"predicted step {self.step_time * 1e3:.3f} ms, bubble {self.bubble:.1%}, speed-up {self.speedup:.2f}x "
            f"over one device; bottleneck {part.bottleneck * 1e3:.3f} ms, lower bound "
            f"{part.lower_bound * 1e3:.3f} ms, gap {part.gap:.2%}, "
            f"{'proven optimal' if part.optimal else 'not proven optimal'} ({part.method}, {part.solve_seconds:.2f} s)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Plan({self.model.get('name', 'model')}, {self.num_stages} stages, {self.schedule_name}, "
                f"m={self.microbatches}, step={self.step_time * 1e3:.3f} ms)")


# ------------------------------------------------------------------ making plans


def plan(
    model: nn.Module,
    example_args: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    stages: int,
    microbatches: int = 1,
    schedule: str = "1f1b",
    cluster: Cluster | str | Path | None = None,
    memory_limit: float | None = None,
    method: str = "auto",
    time_limit: float | None = None,
    timing: str | None = None,
    device: str | torch.device | None = None,
    device_profile: str | Path | None = None,
    dtype: str | None = None,
    virtual_stages: int = 2,
    colocate_tied: bool = False,
    frontend: str = "auto",
    leaf_modules: Iterable[type | str] = (),
    repeats: int = 5,
    graph: OpGraph | None = None,
    name: str | None = None,
    objective: str = "bottleneck",
    progress: Callable[[int, int], None] | None = None,
) -> Plan:
    """Trace, profile, solve, schedule and simulate: the whole compiler in one call.

    ``stages`` is the number of pipeline ranks; ``schedule`` is gpipe, 1f1b, interleaved
    (``virtual_stages`` stages per rank) or zb-h1. The sample batch is the whole batch a
    training step sees: ops are profiled on one microbatch of it. ``timing`` defaults to
    measured, or analytic on ``device_profile`` for a model on the meta device.
    ``graph`` skips profiling (a graph from ``smp profile``). ``objective="step_time"``
    refines the solver's answer by simulated step time (see partitioner/refine.py).
    """
    if stages < 1:
        raise PlanError(f"stages must be >= 1, got {stages}")
    canonical_schedule(schedule)  # a typo should fail before minutes of profiling
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    kwargs = dict(example_kwargs or {})
    base_cluster = _resolve_cluster(cluster, stages)

    # One trace, on one microbatch: what the runtime traces too (an export trace is specialised
    # to the shapes it saw), so the fingerprint is the one every rank will compute.
    micro_args, micro_kwargs = split_microbatches(args, kwargs, microbatches)[0]
    gm = trace(model, micro_args, micro_kwargs, frontend=frontend, leaf_modules=leaf_modules)
    if graph is None:
        on_meta = any(p.is_meta for p in model.parameters())
        timing = timing or ("analytic" if on_meta or device_profile else "measured")
        graph = profile(model, micro_args, micro_kwargs, timing=timing, device=device, repeats=repeats,
                        device_profile=device_profile, dtype=dtype, training=model.training,
                        graph_module=gm, progress=progress)
    info = gm.meta["smp_trace"]
    model_info = {
        "name": name or type(model).__name__,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "fingerprint": fingerprint(gm, model),
        "frontend": info.frontend,
        "leaf_modules": info.leaf_modules,
        "batch_size": batch_size(args, kwargs),
        "inputs": graph.meta.get("inputs"),
        "num_params": sum(p.numel() for p in model.parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "training": model.training,
        "timing": graph.meta.get("timing"),
        "profiled_on": graph.meta.get("device"),
    }
    return plan_from_graph(graph, stages=stages, microbatches=microbatches, schedule=schedule, cluster=base_cluster,
                           memory_limit=memory_limit, method=method, time_limit=time_limit,
                           virtual_stages=virtual_stages, colocate_tied=colocate_tied, training=model.training,
                           model_info=model_info, objective=objective)


def plan_from_graph(
    graph: OpGraph,
    *,
    stages: int,
    microbatches: int = 1,
    schedule: str = "1f1b",
    cluster: Cluster | str | Path | None = None,
    memory_limit: float | None = None,
    method: str = "auto",
    time_limit: float | None = None,
    virtual_stages: int = 2,
    colocate_tied: bool = False,
    training: bool | None = None,
    model_info: Mapping[str, Any] | None = None,
    name: str | None = None,
    objective: str = "bottleneck",
) -> Plan:
    """Solve, schedule and simulate an already-profiled graph (e.g. ``smp profile -o graph.json``).

    The graph's costs are per microbatch. Without ``model_info`` the plan's model section
    comes from ``graph.meta`` (its ``fingerprint`` is ``"unknown"`` when the graph has none).
    """
    if stages < 1:
        raise PlanError(f"stages must be >= 1, got {stages}")
    sched_name = canonical_schedule(schedule)
    v = virtual_stages if sched_name == "interleaved_1f1b" else 1
    if v < 1:
        raise PlanError("virtual_stages must be >= 1")
    num_stages = stages * v
    if training is None:
        training = bool(graph.meta.get("training", True))
    base_cluster = _resolve_cluster(cluster, stages)
    if len(graph) < num_stages:
        raise PlanError(f"the model has {len(graph)} ops, fewer than the {num_stages} stages asked for; "
                        "use fewer stages (or fewer virtual stages)")
    stage_cluster = _virtual_cluster(base_cluster, stages, v) if base_cluster is not None else None
    limit = memory_limit / v if (memory_limit is not None and v > 1) else memory_limit
    colocate = _tied_groups(graph) if colocate_tied else ()
    part = solve(graph, num_stages, cluster=stage_cluster, microbatches=microbatches,
                 schedule=_memory_schedule(sched_name), training=training, memory_limit=limit,
                 colocate=colocate, method=method, time_limit=time_limit, objective=objective, ranks=stages)
    sched = _make_schedule(sched_name, part, microbatches, stages)
    sim = simulate(sched, stage_costs_from(part.stages, part.transfers,
                                           act_bytes=[s.activations for s in part.stages]))
    fx_stage_of = {fx_name: part.stage_of[node] for node in graph.nx for fx_name in graph[node]["fx_nodes"]}
    if model_info is None:
        meta = graph.meta
        model_info = {
            "name": name or meta.get("name") or meta.get("model") or "model",
            "class": meta.get("class"),
            "fingerprint": meta.get("fingerprint") or "unknown",
            "frontend": meta.get("frontend"),
            "leaf_modules": meta.get("leaf_modules", []),
            # The graph is costed per microbatch: a step's batch is that times the microbatches.
            "batch_size": meta["batch_size"] * microbatches if isinstance(meta.get("batch_size"), int) else None,
            "inputs": meta.get("inputs"),
            "num_params": meta.get("num_params"),
            "param_bytes": meta.get("param_bytes", graph.total_params),
            "training": training,
            "timing": meta.get("timing"),
            "profiled_on": meta.get("device"),
        }
    return Plan(model=dict(model_info), graph=graph, partition=part, schedule=sched, microbatches=microbatches,
                num_ranks=stages, fx_stage_of=fx_stage_of, simulated=sim.to_dict())


def _make_schedule(name: str, part: Partition, microbatches: int, ranks: int) -> Schedule:
    graph = stage_graph_from_transfers(part.num_stages, part.transfers)
    if name == "interleaved_1f1b":
        return make_schedule(name, graph, microbatches, num_ranks=ranks)
    return make_schedule(name, graph, microbatches)


def _memory_schedule(name: str) -> str:
    return {"interleaved_1f1b": "interleaved", "zb_h1": "zb-h1"}.get(name, name)


def _resolve_cluster(cluster: Cluster | str | Path | None, devices: int) -> Cluster | None:
    if cluster is None or isinstance(cluster, Cluster):
        if isinstance(cluster, Cluster) and len(cluster.devices) < devices:
            raise PlanError(f"the cluster has {len(cluster.devices)} devices, fewer than the {devices} stages")
        return cluster
    return Cluster.load(cluster, devices=devices)


def _virtual_cluster(cluster: Cluster, ranks: int, v: int) -> Cluster:
    """Stage s of an interleaved pipeline runs on device s mod ranks; its links follow."""
    if v == 1:
        return cluster
    devices = tuple(cluster.devices[s % ranks] for s in range(ranks * v))
    wrap = min(cluster.links, key=lambda lk: (lk.bandwidth, -lk.latency)) if cluster.links else Link("local", math.inf, 0.0)
    links = tuple(cluster.links[s % ranks] if (s % ranks) < ranks - 1 else wrap for s in range(ranks * v - 1))
    return Cluster(devices, links, f"{cluster.name} x{v} virtual")


def _tied_groups(graph: OpGraph) -> list[list[str]]:
    """Ops that read the same parameter (under any of its names), as colocation groups."""
    owner: dict[str, str] = {}  # name a parameter was first counted under -> the op that counted it
    for node in graph.nx:
        shared = set(graph[node]["shared_params"])
        for name in graph[node]["param_names"]:
            if name not in shared:
                owner.setdefault(name, node)
    readers: dict[str, list[str]] = {}
    for node in graph.nx:
        for first_name in graph[node]["shared_from"]:
            if first_name in owner:
                group = readers.setdefault(first_name, [owner[first_name]])
                if node not in group:
                    group.append(node)
    return [group for group in readers.values() if len(group) > 1]


def _scale_graph(graph: OpGraph, factor: float) -> OpGraph:
    data = graph.to_dict()
    for node in data["nodes"]:
        for key in ("fwd", "bwd", "bwd_w"):
            if key in node:
                node[key] *= factor
        for key in ("out_bytes", "flops"):
            if key in node:
                node[key] = int(round(node[key] * factor))
    return OpGraph.from_dict(data)


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)
