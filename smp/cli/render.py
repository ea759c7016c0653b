"""What the ``smp`` CLI shows: the per-stage table, the report dict behind ``--json``, warnings, pictures.

Kept apart from the command modules so that they stay about options and flow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table

from smp.cli.errors import CLIUsageError
from smp.cli.output import rich_console, spec_name
from smp.plan import Plan
from smp.units import format_bytes, format_count, format_time

__all__ = [
    "REPORT_SCHEMA", "report", "stage_table", "comm_legend", "headline", "cut_tensors", "warnings_for", "render_stage_graph",
    "candidate_table", "plan_header", "print_plan", "write_timeline",
    "IMBALANCE_SHARE", "MEMORY_WARN_FRACTION", "GAP_WARN", "NO_GAIN_SPEEDUP", "COMM_HEAVY_SHARE",
]

#: Version of the JSON that ``smp plan/inspect/simulate --json`` print (see docs/cli.md).
REPORT_SCHEMA = 1
#: A stage whose time is below this share of the bottleneck is reported as under-loaded.
IMBALANCE_SHARE = 0.70
#: Memory above this fraction of the limit is reported as close to the limit.
MEMORY_WARN_FRACTION = 0.90
#: A gap to the lower bound above this, not proven optimal, is reported.
GAP_WARN = 0.05
#: A plan less than this many times faster than one device is reported: splitting does not pay.
NO_GAIN_SPEEDUP = 1.10
#: Communication above this share of the bottleneck stage's time makes it the first thing to fix.
COMM_HEAVY_SHARE = 0.25


# ------------------------------------------------------------------ data


def cut_tensors(plan: Plan) -> list[dict[str, Any]]:
    """One entry per tensor that crosses stages: producer op, its stage, the consuming stages, bytes.

    ``bytes`` is one microbatch's tensor; it crosses once per consuming stage (forward),
    and its gradient crosses back when training.
    """
    by_node: dict[str, dict[str, Any]] = {}
    for t in plan.partition.transfers:
        entry = by_node.get(t.node)
        if entry is None:
            data = plan.graph[t.node] if t.node in plan.graph else {}
            entry = by_node[t.node] = {
                "producer": t.node,
                "op": data.get("op", ""),
                "module": data.get("module", ""),
                "src_stage": int(t.src_stage),
                "dst_stages": [],
                "bytes": float(t.bytes),
                "seconds": [],
            }
        entry["dst_stages"].append(int(t.dst_stage))
        entry["seconds"].append(float(t.seconds))
    out = []
    for entry in by_node.values():
        order = sorted(range(len(entry["dst_stages"])), key=lambda i: entry["dst_stages"][i])
        entry["dst_stages"] = [entry["dst_stages"][i] for i in order]
        entry["seconds"] = [entry["seconds"][i] for i in order]
        out.append(entry)
    out.sort(key=lambda e: (e["src_stage"], plan.graph[e["producer"]]["index"] if e["producer"] in plan.graph else 0))
    return out


def warnings_for(plan: Plan) -> list[dict[str, Any]]:
    """Things worth a second look: splitting that does not pay, under-loaded stages, memory near or over the
    limit, a large unproven gap."""
    part = plan.partition
    out: list[dict[str, Any]] = []
    no_gain = _no_gain(plan)
    if no_gain is not None:
        out.append({"kind": "no_gain", "stage": None, "message": no_gain})
    if plan.timing_warning is not None:
        out.append({"kind": "unstable_timing", "stage": None, "message": plan.timing_warning})
    rows = plan.stage_rows()
    for row in rows:
        if part.bottleneck > 0 and row["share"] < IMBALANCE_SHARE and no_gain is None:
            out.append({"kind": "imbalance", "stage": row["stage"],
                        "message": f"stage {row['stage']} is busy {row['share']:.0%} of the bottleneck stage's time "
                                   f"(below {IMBALANCE_SHARE:.0%}): the pipeline is unbalanced; "
                                   + _imbalance_advice(rows[part.bottleneck_stage])})
        limit = row["memory_limit"]
        if limit is not None and not math.isinf(limit) and limit > 0:
            frac = row["memory"] / limit
            if frac > 1 + 1e-12:
                out.append({"kind": "memory", "stage": row["stage"],
                            "message": f"stage {row['stage']} needs {format_bytes(row['memory'])}, over its "
                                       f"{format_bytes(limit)} limit ({frac:.0%})"})
            elif frac > MEMORY_WARN_FRACTION:
                out.append({"kind": "memory", "stage": row["stage"],
                            "message": f"stage {row['stage']} uses {frac:.0%} of its {format_bytes(limit)} memory "
                                       f"limit (above {MEMORY_WARN_FRACTION:.0%}): little headroom for allocator "
                                       "fragmentation and workspace"})
    if not part.optimal and part.gap > GAP_WARN and not (part.bottleneck_plan or {}).get("optimal"):
        out.append({"kind": "gap", "stage": None,
                    "message": f"the plan is {part.gap:.1%} above the lower bound and not proven optimal: "
                               "give the solver more time (--time-limit) or try --method cpsat"})
    return out


def _link_latency(plan: Plan) -> float | None:
    """The lowest latency of the cluster's links between stages, or None when the links are free."""
    links = [lk for lk in plan.partition.cluster.get("links") or []
             if lk.get("bandwidth") is not None or (lk.get("latency") or 0) > 0]  # bandwidth None: infinite
    return min((float(lk.get("latency") or 0.0) for lk in links), default=None)


def _imbalance_advice(bottleneck: dict[str, Any]) -> str:
    """What would even an unbalanced pipeline out, judged by where the bottleneck stage spends its time."""
    comm = bottleneck["comm_in"] + bottleneck["comm_out"]
    if bottleneck["time"] > 0 and comm / bottleneck["time"] > COMM_HEAVY_SHARE:
        return (f"communication is {comm / bottleneck['time']:.0%} of the bottleneck stage's time, so fewer stages "
                "or a faster link would help more than a finer graph")
    return "more ops or a finer graph would even it out"


def _no_gain(plan: Plan) -> str | None:
    """Why splitting into these stages does not pay (speed-up below NO_GAIN_SPEEDUP), and what to do; else None."""
    # the replicas' share is not in question here: the pipeline's own speed-up is the replicas' total over D
    pipeline_speedup = plan.speedup / plan.data_parallel
    if plan.pipeline_ranks < 2 or pipeline_speedup >= NO_GAIN_SPEEDUP:
        return None
    part = plan.partition
    head = (f"splitting into {plan.num_stages} stages does not pay ({pipeline_speedup:.2f}x the speed of one "
            "device)")
    if all(row["share"] >= IMBALANCE_SHARE for row in plan.stage_rows()):
        return (f"{head}, with the stages balanced but the pipeline idle {plan.bubble:.0%} of the step "
                f"({plan.microbatches} microbatches): use more microbatches, or fewer stages")
    latency = _link_latency(plan)
    if latency is not None and part.optimal:  # proven: no split of these costs does better
        each_way = " each way (the activation forward, its gradient back)" if part.training else ""
        return (f"{head}: communication dominates: a tensor sent between stages costs at least "
                f"{format_time(latency)} of link latency{each_way}, more than moving ops off the busiest stage "
                "saves; use fewer stages, or a faster link")
    if not part.optimal:
        return (f"{head}, and the plan is not proven optimal: solve with --method auto (or a longer --time-limit) "
                "before concluding that fewer stages would do")
    op, seconds = max(((n, d["fwd"] + (d["bwd"] if part.training else 0.0)) for n, d in plan.graph.nx.nodes(data=True)),
                      key=lambda item: item[1])
    return (f"{head}: op {op} alone takes {format_time(seconds)} per microbatch and no split can run faster "
            "than its stage; use fewer stages")


def report(plan: Plan, *, plan_file: str | Path | None = None, files: dict[str, str | None] | None = None,
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The machine-readable view of a plan (the ``--json`` output of plan, inspect and simulate).

    Times are seconds, sizes bytes; ``memory_limit`` is null when unlimited.
    """
    part = plan.partition
    stages = []
    for r in plan.stage_rows():
        stages.append({
            "stage": r["stage"], "rank": r["rank"], "modules": r["modules"], "ops": r["ops"],
            "params_bytes": _num(r["params"]), "activation_bytes": _num(r["activations"]),
            "fwd_s": _num(r["fwd"]), "bwd_s": _num(r["bwd"]),
            "comm_in_s": _num(r["comm_in"]), "comm_out_s": _num(r["comm_out"]),
            "comm_in_bytes": _num(r["comm_in_bytes"]), "comm_out_bytes": _num(r["comm_out_bytes"]),
            "time_s": _num(r["time"]), "recompute": r["recompute"], "recompute_s": _num(r["recompute_time"]),
            "memory_bytes": _num(r["memory"]),
            "memory_split_bytes": {k: _num(v) for k, v in r["memory_split"].items()},
            "memory_limit_bytes": _num(r["memory_limit"]), "share": _num(r["share"]),
        })
    out: dict[str, Any] = {
        "kind": "smp.report",
        "schema": REPORT_SCHEMA,
        "plan_file": str(plan_file) if plan_file is not None else None,
        "model": {k: getattr(plan.model, k) for k in ("name", "fingerprint", "num_params", "param_bytes", "batch_size",
                                                  "timing", "profiled_on")},
        "ops": len(plan.graph),
        "schedule": plan.schedule_name,
        "microbatches": plan.microbatches,
        "num_ranks": plan.num_ranks,
        "num_stages": plan.num_stages,
        "data_parallel": plan.data_parallel,
        "sharding": plan.sharding,
        "sharding_weighed": dict(plan.sharding_weighed),
        "cluster": part.cluster.get("name"),
        "memory_limit_bytes": _num(part.memory_limit),
        "recompute_mode": part.recompute_mode,
        "recompute": plan.recompute,
        "stages": stages,
        "step_time_s": _num(plan.step_time),
        "bubble_fraction": _num(plan.bubble),
        "single_device_time_s": _num(plan.single_device_time),
        "speedup": _num(plan.speedup),
        "bottleneck_s": _num(part.bottleneck),
        "bottleneck_stage": part.bottleneck_stage,
        "lower_bound_s": _num(part.lower_bound),
        "gap": _num(part.gap),
        "optimal": bool(part.optimal),
        "objective": part.objective,
        "bound_on": part.bound_on,
        "bound_by": part.bound_by,
        "bottleneck_plan": part.bottleneck_plan,
        "method": part.method,
        "solve_seconds": _num(part.solve_seconds),
        "cut_tensors": cut_tensors(plan),
        "warnings": warnings_for(plan),
        "notes": list(part.notes),
    }
    if files:
        out["files"] = {k: v for k, v in files.items() if v is not None}
    if extra:
        out.update(extra)
    return out


def _num(x: Any) -> Any:
    """JSON-safe number: None for None/inf/nan, plain int/float otherwise."""
    if x is None:
        return None
    x = float(x)
    if math.isinf(x) or math.isnan(x):
        return None
    return int(x) if x.is_integer() and abs(x) < 2**53 and not isinstance(x, bool) else x


# ------------------------------------------------------------------ rich tables


def stage_table(plan: Plan, *, title: str | None = None) -> Table:
    """The per-stage table: modules, ops, parameter and activation bytes, times, comm, memory vs limit, share."""
    part = plan.partition
    t = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
              padding=(0, 1), collapse_padding=True)
    num = {"justify": "right", "no_wrap": True}
    for name, kw in (("stage", num), ("rank", num),
                     ("modules", {"no_wrap": True, "overflow": "ellipsis", "max_width": 40}),
                     ("ops", num), ("params", num), ("act/mb", num), ("fwd", num), ("bwd", num), ("recompute", num),
                     ("comm in", num), ("comm out", num), ("memory / limit", num), ("share", num)):
        t.add_column(name, **kw)
    for r in plan.stage_rows():
        limit = r["memory_limit"]
        if limit is None or math.isinf(limit):
            mem = _b(r["memory"])
        else:
            mem = f"{_b(r['memory'])} / {_b(limit)} {r['memory'] / limit:.0%}"
        mark = " ◀" if r["stage"] == part.bottleneck_stage else ""
        t.add_row(str(r["stage"]), str(r["rank"]), r["modules"] or "-", str(r["ops"]),
                  _b(r["params"]), _b(r["activations"]),
                  format_time(r["fwd"]), format_time(r["bwd"]), _recompute(r["recompute"], r["recompute_time"]),
                  _comm(r["comm_in"], r["comm_in_bytes"]), _comm(r["comm_out"], r["comm_out_bytes"]),
                  mem, f"{r['share']:.0%}{mark}")
    return t


def _recompute(choice: str, seconds: float) -> str:
    """A stage's recomputation for the table: "-" when none, else the choice and the forward it runs again."""
    return "-" if choice == "none" else f"{choice} +{format_time(seconds)}"


def candidate_table(candidates: Sequence[Any], *, shapes: bool = False, title: str | None = None) -> Table:
    """The candidates a search weighed (:class:`partitioner.shapes.Candidate`), best first; with ``shapes``
    the replicas x stages, tensor-parallel and placement columns too."""
    t = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, show_edge=False,
              pad_edge=False)
    num = {"justify": "right", "no_wrap": True}
    cols: list[tuple[str, dict[str, Any]]] = [("replicas x stages", num), ("tp", num), ("placement", {}),
                                              ("sharding", {"overflow": "fold", "max_width": 36})] if shapes else []
    cols += [("microbatches", num), ("schedule", {}), ("step time", num), ("samples/s", num), ("bubble", num),
             ("peak memory", num), ("fits", {}), ("proven", {}), ("recompute", {"overflow": "fold"}),
             ("why not", {"overflow": "fold", "max_width": 40})]
    for name, kw in cols:
        t.add_column(name, **kw)
    for c in candidates:
        p = c.plan
        peak = _b(c.memory) if c.memory is not None else "-"
        if p is None and c.memory is not None:
            peak = f"needs {peak}"
        rec = ", ".join(f"{n} {x}" for x, n in runs_of(c.recompute)) if c.recompute else "-"
        why = "" if p is not None else (c.reason if len(c.reason) <= 120 else c.reason[:117] + "...")
        row = [f"{c.shape.data_parallel} x {c.shape.stages}", str(c.shape.tensor_parallel),
               p.placement if p is not None and
               c.shape.data_parallel > 1 and c.shape.stages > 1 else "-", _sharding(p)] if shapes else []
        row += [str(c.shape.microbatches), c.shape.schedule, format_time(c.step_time) if p is not None else "-",
                f"{c.samples_per_second:,.1f}" if p is not None else "-",
                f"{p.bubble:.1%}" if p is not None else "-", peak,
                "yes" if c.fits else "-" if c.pruned else "no",  # pruned: not known, only not faster
                "yes" if c.proven else "", rec, escape(why)]
        t.add_row(*row)
    return t


def _sharding(plan: Plan | None) -> str:
    """A candidate's sharding mode, and in short why not the others the planner weighed."""
    if plan is None:
        return "-"
    others = [f"{mode} {_short(verdict)}" for mode, verdict in plan.sharding_weighed.items() if mode != plan.sharding]
    return plan.sharding + (escape(f" [{', '.join(others)}]") if others else "")


def _short(verdict: str) -> str:
    """A sharding verdict in a word or two: "no fit", "1.04x", "pruned", "not weighed"."""
    if verdict.startswith("fits, step "):
        return verdict.split()[2]
    word = {"does": "no fit", "pruned:": "pruned", "not": "not weighed"}.get(verdict.split()[0])
    return word or (verdict if len(verdict) <= 40 else verdict[:37] + "...")


def runs_of(choices: Sequence[str]) -> list[tuple[str, int]]:
    """(choice, count) for each run of equal choices: ["full", "full", "none"] -> [("full", 2), ("none", 1)]."""
    out: list[tuple[str, int]] = []
    for c in choices:
        if out and out[-1][0] == c:
            out[-1] = (c, out[-1][1] + 1)
        else:
            out.append((c, 1))
    return out


def comm_legend(plan: Plan) -> str | None:
    """What the stage table's comm columns count, when it differs from the cut-tensor list (training)."""
    if not (plan.partition.training and plan.partition.transfers):
        return None
    return ("comm in/out: cut-tensor bytes per microbatch, and their link time both ways (activation forward, "
            "gradient back)")


def _comm(seconds: float, nbytes: float) -> str:
    if not nbytes:
        return "-"
    return f"{_b(nbytes)} {format_time(seconds)}"


def _b(n: float | None) -> str:
    """Bytes with three significant figures (the table is wide): 913 MiB, 14.4 GiB, 80.0 KiB."""
    text = format_bytes(n)
    num, _, unit = text.partition(" ")
    try:
        value = float(num)
    except ValueError:
        return text
    return text if unit == "B" else f"{value:.3g} {unit}"


def headline(plan: Plan, *, solved: Plan | None = None) -> list[str]:
    """The figures under the table: step time, bubble, speed-up, bottleneck vs lower bound, optimality.

    ``solved``: for a re-timed plan, the plan whose solve produced the assignment.
    """
    part = plan.partition
    src = (solved or plan).partition
    proven = (f"{src.bound_on} proven optimal" if src.optimal
              else f"{src.bound_on} not proven optimal (gap {src.gap:.1%} to the lower bound)")
    chosen = src.bottleneck_plan
    if src.objective == "step_time" and chosen:
        proven += (f"; chosen for the simulated step time (the {chosen['method']} plan: bottleneck "
                   f"{format_time(chosen['bottleneck'])}{', proven optimal' if chosen['optimal'] else ''})")
    if solved is not None:
        proven = f"solved for {solved.schedule_name}, m={solved.microbatches} ({proven} there), re-timed"
    limit = "no memory limit" if part.memory_limit is None and not any(
        s.memory_limit for s in part.stages) else (
        "fits the memory limit" if part.memory_ok else "DOES NOT fit the memory limit")
    recomputing = [s for s in part.stages if s.recompute != "none"]
    recompute = (f"recompute            {part.recompute_mode}: " + (
        ", ".join(f"stage {s.index} {s.recompute} (+{format_time(s.recompute_time)} per microbatch)"
                  for s in recomputing) if recomputing else "none on every stage"))
    lines = [
        f"predicted step time  {format_time(plan.step_time)}  ({plan.schedule_name}, {plan.microbatches} "
        f"microbatches, {plan.num_ranks} ranks)",
        f"bubble               {plan.bubble:.1%}",
        f"speed-up             {plan.speedup:.2f}x over one device ({format_time(plan.single_device_time)} per step, "
        "no communication)",
        f"bottleneck           {format_time(part.bottleneck)} per microbatch (stage {part.bottleneck_stage}); lower bound "
        f"{format_time(part.lower_bound)}, gap {part.gap:.1%}",
        f"solver               {part.method}, {format_time(part.solve_seconds)}: {proven}; {limit}",
        recompute,
    ]
    if plan.data_parallel > 1:
        lines += sharding_lines(plan)
    return lines


def sharding_lines(plan: Plan) -> list[str]:
    """How the replicas hold the state (and why that mode, when the planner chose it), and the fullest rank's
    memory by what it holds."""
    weighed = "; ".join(f"{mode}: {verdict}" for mode, verdict in plan.sharding_weighed.items()
                        if mode != plan.sharding)
    peak = max(range(plan.num_stages), key=lambda s: plan.partition.stages[s].memory)
    split = plan.memory_split()[peak]
    return [f"sharding             {plan.sharding} over {plan.data_parallel} replicas"
            + (f" (chosen; {weighed})" if weighed else ""),
            f"memory per rank      stage {peak}, the fullest: " + ", ".join(
                f"{name} {format_bytes(split[key])}" for key, name in (
                    ("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
                    ("activations", "activations"), ("other", "other")))]


def cut_table(plan: Plan) -> Table:
    t = Table(header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name, kw in (("producer op", {}), ("module", {"overflow": "fold", "max_width": 30}), ("from", {"justify": "right"}),
                     ("to stages", {}), ("bytes/mb", {"justify": "right"}), ("time each way", {"justify": "right"})):
        t.add_column(name, **kw)
    for c in cut_tensors(plan):
        kind = "skip" if any(d > c["src_stage"] + 1 for d in c["dst_stages"]) else ""
        t.add_row(f"{c['producer']} ({c['op']})" if c["op"] else c["producer"], c["module"] or "-",
                  str(c["src_stage"]), ", ".join(map(str, c["dst_stages"])) + (escape(f"  [{kind}]") if kind else ""),
                  format_bytes(c["bytes"]), format_time(max(c["seconds"]) if c["seconds"] else 0.0))
    return t


# ------------------------------------------------------------------ a plan on the console


def plan_header(plan) -> str:
    m = plan.model
    part = plan.partition
    how = m.timing or "?"
    if how == "analytic":
        how += f" on {plan.graph.meta.get('device_profile')}"
    elif m.profiled_on:
        how += f" on {m.profiled_on}"
    if how.startswith("measured") and plan.timing_spread is not None:  # how steady the profile was
        threads = plan.graph.meta.get("threads")
        how += f" ({f'{threads} thread' + ('s' if threads != 1 else '') + ', ' if threads else ''}" \
               f"sweeps spread {plan.timing_spread:.0%})"
    batch = m.batch_size
    mb = (f"batch {batch} in {plan.microbatches} microbatches of {batch // plan.microbatches}" if batch
          else f"{plan.microbatches} microbatches")
    params = f", {format_count(m.num_params)} parameters" if m.num_params else ""
    limit = part.memory_limit if part.memory_limit is not None else next(
        (s.memory_limit for s in part.stages if s.memory_limit), None)
    cl = part.cluster.get("name", "?")
    if str(cl).startswith("ideal-"):
        cl = "none (free links)"
    where = (f"stages on {plan.num_ranks} ranks" if plan.data_parallel == 1 else
             f"stages on {plan.pipeline_ranks} ranks x {plan.data_parallel} replicas = {plan.num_ranks} ranks "
             f"({plan.placement}, sharding {plan.sharding})")
    cap = f" (at most {plan.active_microbatches} in flight)" if plan.active_microbatches is not None else ""
    if plan.tensor_parallel > 1:
        off = plan.graph.meta.get("sequence_parallel_off")
        where += (f", each split over {plan.tensor_parallel} tensor-parallel ranks (sequence parallel "
                  f"{'on' if plan.sequence_parallel else 'off: ' + off if off else 'off'})")
    return (f"[bold]{spec_name(m.name)}[/]: {len(plan.graph)} ops{params} → {plan.num_stages} "
            f"{where} · {plan.schedule_name}{cap} · {mb}{' per replica' if plan.data_parallel > 1 else ''}\n"
            f"timing {how} · cluster {cl} · memory limit {format_bytes(limit)}")


def print_plan(plan, *, cuts: bool = False, files: dict[str, str | None] | None = None, title: str | None = None,
               solved=None, note: str | None = None) -> None:
    con = rich_console()
    con.print(plan_header(plan))
    if note:
        con.print(note)
    con.print(stage_table(plan, title=title))
    legend = comm_legend(plan)
    if legend:
        con.print(legend)
    con.print()
    for line in headline(plan, solved=solved):
        con.print(line)
    if cuts:
        con.print()
        n = len({t.node for t in plan.partition.transfers})
        con.print(f"[bold]cut tensors[/] ({n}; bytes per microbatch, each way; time on the link)")
        if n:
            con.print(cut_table(plan))
    warns = warnings_for(plan)
    con.print()
    if warns:
        con.print(f"[bold]warnings[/] ({len(warns)})")
        for w in warns:
            con.print(f"  ! {w['message']}")
    else:
        con.print("warnings: none (stages within 70% of the bottleneck, memory below 90% of the limit)")
    for what, path in (files or {}).items():
        if path:
            con.print(f"wrote {what}: {path}")


def write_timeline(plan, path: Path, title: str | None = None) -> str:
    from partitioner.timeline import render_timeline

    tl = plan.timeline()
    if tl is None:
        raise CLIUsageError("this plan carries no simulated timeline to draw; re-create it with `smp plan`")
    if path.suffix.lower() not in (".png", ".svg"):
        raise CLIUsageError(f"--timeline writes .png or .svg, not {path.name!r}")
    name = plan.model.name
    render_timeline(tl, path, title=title or f"{name}: {plan.schedule_name}, {plan.num_ranks} ranks, "
                                               f"{plan.microbatches} microbatches (predicted)")
    return str(path)



# ------------------------------------------------------------------ the stage-graph picture


def render_stage_graph(plan: Plan, path: str | Path, *, title: str | None = None) -> Path:
    """Stages as boxes left to right (modules, ops, time), cut tensors as labelled arrows.

    Tensors between neighbouring stages are straight arrows; tensors that skip stages
    are arcs above the boxes. Several tensors between the same two stages are drawn as
    one arrow labelled with their total bytes and count. Writes .svg or .png by suffix.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    path = Path(path)
    if path.suffix.lower() not in (".svg", ".png", ".pdf"):
        raise ValueError(f"the stage graph is written as .svg, .png or .pdf, not {path.name!r}")
    rows = plan.stage_rows()
    S = len(rows)
    pairs: dict[tuple[int, int], list[float]] = {}
    for tr in plan.partition.transfers:
        pairs.setdefault((int(tr.src_stage), int(tr.dst_stage)), []).append(float(tr.bytes))
    box_w, box_h, gap = 2.6, 1.7, 1.5
    step = box_w + gap
    max_span = max((b - a for a, b in pairs), default=1)
    fig_w = max(6.0, S * step * 0.95 + 0.5)
    fig_h = 3.2 + 0.55 * max(0, max_span - 1)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
    bottleneck = plan.partition.bottleneck_stage
    for r in rows:
        x = r["stage"] * step
        color = palette[r["rank"] % len(palette)]
        box = FancyBboxPatch((x, 0), box_w, box_h, boxstyle="round,pad=0.05,rounding_size=0.12",
                             facecolor=color, alpha=0.18, edgecolor=color,
                             linewidth=2.4 if r["stage"] == bottleneck else 1.2)
        ax.add_patch(box)
        modules = r["modules"] or "-"
        if len(modules) > 26:
            modules = modules[:25] + "…"
        label = (f"stage {r['stage']} · rank {r['rank']}\n{modules}\n{r['ops']} ops, {format_bytes(r['params'])}\n"
                 f"F+B {format_time(r['fwd'] + r['bwd'])}" + ("  (bottleneck)" if r["stage"] == bottleneck else ""))
        ax.text(x + box_w / 2, box_h / 2, label, ha="center", va="center", fontsize=8)
    for (a, b), sizes in sorted(pairs.items()):
        total = sum(sizes)
        text = format_bytes(total) + (f" ({len(sizes)} tensors)" if len(sizes) > 1 else "")
        if b == a + 1:
            x0, x1 = a * step + box_w + 0.05, b * step - 0.05
            ax.add_patch(FancyArrowPatch((x0, box_h / 2), (x1, box_h / 2), arrowstyle="-|>", mutation_scale=14,
                                         color="#333333", linewidth=1.2))
            ax.text((x0 + x1) / 2, box_h / 2 + 0.12, text, ha="center", va="bottom", fontsize=7)
        else:
            x0, x1 = a * step + box_w * 0.75, b * step + box_w * 0.25
            height = 0.5 + 0.55 * (b - a - 1)
            ax.add_patch(FancyArrowPatch((x0, box_h + 0.08), (x1, box_h + 0.08), arrowstyle="-|>", mutation_scale=12,
                                         connectionstyle=f"arc3,rad={-min(0.6, 2 * height / max(x1 - x0, 1e-6)):.3f}",
                                         color="#8B1A1A", linewidth=1.1))
            ax.text((x0 + x1) / 2, box_h + 0.1 + height * 0.95, text + " (skip)", ha="center", va="bottom",
                    fontsize=7, color="#8B1A1A")
    ax.set_xlim(-0.4, (S - 1) * step + box_w + 0.4)
    ax.set_ylim(-0.4, box_h + 0.9 + 0.55 * max(0, max_span - 1) + 0.3)
    ax.set_aspect("auto")
    ax.axis("off")
    name = plan.model.name
    ax.set_title(title or f"{name}: {S} stages on {plan.num_ranks} ranks, cut tensors per microbatch", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

