"""``smp plan``, ``inspect``, ``simulate`` and ``compare``: make a plan, explain it, re-time it, weigh the methods."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from partitioner.errors import OptionError
from smp.cli.errors import CLIUsageError
from smp.cli.files import is_graph_file, load_graph, load_plan
from smp.cli.options import (DEVICE_CHOICES, METHOD_CHOICES, RECOMPUTE_CHOICES, SCHEDULE_CHOICES, SHARDING_CHOICES,
                             ClusterOpt, DeviceOpt, DtypeOpt, JsonOpt, MemoryOpt, MetaOpt, MethodOpt, MicrobatchesOpt, RepeatsOpt,
                             ScheduleOpt, SeqOpt, StagesOpt, StepBatchOpt, TimeLimitOpt, TimelineOpt, TimingOpt,
                             check_cluster, choice, flag_name, microbatches_for, plan_args, positive, timing_for)
from smp.cli.output import print_json, progress_bar, rich_console, spinner
from smp.cli.render import (candidate_table, plan_header, print_plan, render_stage_graph, report,
                            write_timeline)
from smp.cli.root import app, command
from smp.plan import PlanRequest, default_microbatches
from smp.units import format_time

__all__ = ["plan_cmd", "inspect_cmd", "simulate_cmd", "compare_cmd"]


def _request(model: str, *, cluster: str | None, timing: str | None, device: str | None, meta: bool,
             dtype: str | None, repeats: int, batch_size: int | None, seq_len: int | None,
             **fields: Any) -> PlanRequest:
    """The flags as the one planning request, which checks their values (its errors name the flags): the profiling
    ones resolved for a model spec, refused for a graph."""
    check_cluster(cluster)
    if is_graph_file(model):
        ignored = [n for n, v in (("--batch-size", batch_size), ("--seq-len", seq_len), ("--timing", timing),
                                  ("--device", device), ("--dtype", dtype)) if v is not None] + (
            ["--meta"] if meta else [])
        if ignored:
            raise CLIUsageError(f"{', '.join(ignored)} cannot apply to an op graph that is already profiled "
                                f"({model}); re-profile with `smp profile` to change them")
        profiling: dict[str, Any] = {}
    else:
        timing_, profile_name = timing_for(timing, meta, cluster)
        profiling = dict(timing=timing_, device=choice(device, DEVICE_CHOICES, "--device"),
                         device_profile=profile_name, dtype=dtype, name=model)
    try:
        return PlanRequest.build(cluster=cluster, repeats=repeats, **profiling, **fields)
    except OptionError as err:
        raise CLIUsageError(err.spelled(flag_name)) from None


def _make_plan(model: str, request: PlanRequest, *, batch_size: int | None, seq_len: int | None, meta: bool,
               show_progress: bool):
    """A Plan from a model spec (trace + profile + solve) or from an op graph JSON (solve only)."""
    import smp
    from smp.models import build_step
    from smp.plan import plan_from_graph

    if is_graph_file(model):
        with spinner(f"solving ({request.method})…", show_progress):
            return plan_from_graph(load_graph(model), request)
    bundle = build_step(model, microbatches=request.microbatches, batch_size=batch_size, seq_len=seq_len, meta=meta)
    with progress_bar("profiling", show_progress) as cb:
        def progress(done: int, total: int) -> None:
            if cb is not None:
                cb(done, total)

        # The solve runs after the last op is profiled; the bar then stays at 100% until it returns.
        return smp.plan(bundle.model, bundle.example_args, bundle.example_kwargs, request, progress=progress)


def _search_plans(model: str, request: PlanRequest, *, batch_size: int | None, seq_len: int | None, meta: bool,
                  show_progress: bool):
    """``--devices N`` (replicas x stages x microbatches), ``--microbatches auto``, ``--schedule auto``.

    With --devices the spec's sample batch (or --batch-size) is one device's share and the
    global batch defaults to N of them; without it the pipeline's step batch is split, as
    for one plan. Returns (the search, a note on the batch)."""
    from partitioner.microbatch import batch_size as batch_of
    from smp.models import build_step
    from smp.plan import plan_shapes

    if is_graph_file(model):
        raise CLIUsageError("--devices, --microbatches auto and --schedule auto trace the model to record it in the "
                            f"plans they weigh, so they need a model spec, not the op graph {model}")
    devices, stages, fixed = request.devices, request.stages, request.microbatches
    if devices is None:
        assert stages is not None
        built_for = fixed if isinstance(fixed, int) else default_microbatches(stages, None)
        bundle = build_step(model, microbatches=built_for if batch_size is None else 1,
                            batch_size=batch_size, seq_len=seq_len, meta=meta)
        batch = batch_of(bundle.example_args, bundle.example_kwargs)
        note = None if batch_size is not None or isinstance(fixed, int) else (
            f"--microbatches auto: the batch is {batch} "
            f"({f'2 x {stages} stages' if built_for == 2 * stages else built_for} x the spec's sample batch; set it "
            "with --batch-size)")
    else:
        bundle = build_step(model, microbatches=1, batch_size=batch_size, seq_len=seq_len, meta=meta)
        sample = batch_of(bundle.example_args, bundle.example_kwargs)
        batch = request.global_batch or devices * sample
        note = (f"--devices {devices}: a global batch of {batch}"
                + ("" if request.global_batch else f" ({devices} devices x the sample batch of {sample}; set it "
                                                   "with --global-batch)"))
    with progress_bar("weighing shapes", show_progress, unit="shapes") as cb:
        search = plan_shapes(bundle.model, bundle.example_args, bundle.example_kwargs,
                             request.with_(global_batch=batch), shape_progress=cb)
    if search.skipped:
        note = "; ".join([*([note] if note else []), *(f"tensor_parallel={t} not weighed: {why}"
                                                        for t, why in search.skipped.items())])
    return search, note


def _tensor_parallel(value: str | None, devices: int | None) -> int | str:
    """--tensor-parallel: a degree, or auto (a --devices search weighs T; its default there)."""
    if value is None:
        return "auto" if devices is not None else 1
    if value.strip().lower() == "auto":
        if devices is None:
            raise CLIUsageError("--tensor-parallel auto weighs T in a --devices search: pass --devices N, or a degree")
        return "auto"
    return _count(value, "--tensor-parallel")


def _count(value: str, option: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise CLIUsageError(f"bad value {value!r} for {option}: give a whole number or auto") from None


@app.command("plan", epilog="Example: smp plan gpt:layers=8,d_model=256 --stages 4 --microbatches 8 "
                             "--schedule 1f1b -o plan.json; smp plan gpt-1b --meta --devices 16 --cluster h100-sxm")
@command
def plan_cmd(
    model: Annotated[str, typer.Argument(metavar="MODEL|GRAPH.json",
                                         help="zoo spec, path/to/file.py:factory, or an op graph from `smp profile`")],
    stages: Annotated[Optional[int], typer.Option("--stages", "-p", help="pipeline ranks (devices) \\[with "
                                                  "--devices: searched among the divisors of N]")] = None,
    devices: Annotated[Optional[int], typer.Option(
        "--devices", "-n", help="weigh every replicas x stages x tp x microbatches shape on N devices of --cluster and "
                                "keep the fastest")] = None,
    global_batch: Annotated[Optional[int], typer.Option(
        "--global-batch", help="with --devices: samples per step over all replicas \\[default: N x the sample "
                               "batch]")] = None,
    microbatches: Annotated[Optional[str], typer.Option(
        "--microbatches", "-m", help="microbatches per step, or auto: try the divisors of the batch from stages "
                                     "up and keep the fastest simulated step that fits memory \\[default: 2 x stages "
                                     "(1 on one stage); with --batch-size, the largest divisor of the batch not above "
                                     "that]")] = None,
    schedule: Annotated[str, typer.Option(
        "--schedule", "-s", help="gpipe | 1f1b | interleaved | zb-h1 | auto (try each, keep the fastest that "
                                 "fits)")] = "1f1b",
    recompute: Annotated[str, typer.Option(
        "--recompute", help="activation recomputation per stage: auto (chosen with the partition, only where the "
                            "memory limit needs it) | none | selective | full | offload (stashed activations copied to host memory and "
                            "back; docs/memory.md)")] = "auto",
    active_microbatches: Annotated[Optional[int], typer.Option(
        "--active-microbatches", help="most microbatches a stage holds in flight (gpipe, 1f1b; SMP v1's name): "
                                      "less activation memory, a longer bubble \\[default: the schedule's own]")] = None,
    sharding: Annotated[str, typer.Option(
        "--sharding", help="how a stage's data-parallel replicas hold its state: auto (the fastest mode that fits, "
                           "per plan) | none (whole, all-reduce) | shard_grad_op (gradients and optimizer state "
                           "sharded) | full_shard (parameters too)")] = "auto",
    cluster: ClusterOpt = None,
    memory_limit: MemoryOpt = None,
    method: MethodOpt = "auto",
    time_limit: TimeLimitOpt = None,
    batch_size: StepBatchOpt = None,
    seq_len: SeqOpt = None,
    timing: TimingOpt = None,
    device: DeviceOpt = None,
    meta: MetaOpt = False,
    dtype: DtypeOpt = None,
    repeats: RepeatsOpt = 3,
    virtual_stages: Annotated[int, typer.Option("--virtual-stages", help="stages per rank for interleaved")] = 2,
    tensor_parallel: Annotated[Optional[str], typer.Option(
        "--tensor-parallel", help="split each stage's modules over T ranks by the model's tp plan (world D x P x "
                                  "T), priced per tp rank (docs/cost-model.md#tensor-parallelism); auto: weigh T in "
                                  "1, 2, 4, 8 within a node \\[default: auto with --devices, else 1]")] = None,
    sequence_parallel: Annotated[Optional[bool], typer.Option(
        "--sequence-parallel/--no-sequence-parallel",
        help="with --tensor-parallel: run the ops between the split modules (norms, residual adds) on each tp rank's "
             "chunk of the sequence, the rowwise all-reduces becoming reduce-scatters and all-gathers "
             "(docs/runtime.md#sequence-parallelism) \\[default: where the model allows it]")] = None,
    objective: Annotated[str, typer.Option(
        "--objective", help="step_time (the fastest simulated step among the bottleneck-optimal plan and the "
                            "peer baselines, refined) or bottleneck (the plan minimising the slowest stage, "
                            "with a proven bound)")] = "step_time",
    top: Annotated[int, typer.Option("--top", help="with a search: show the K fastest candidates (0: every one; "
                                                    "--json always lists every one)", min=0)] = 12,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="save the plan JSON here")] = None,
    timeline: TimelineOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Partition a model into pipeline stages: per-stage table, predicted step time, bubble, lower bound, gap.

    With --devices N, weigh every replicas x stages x tensor-parallel x microbatches shape on N devices and show the
    candidates.
    """
    objective = choice(objective.replace("-", "_"), ("bottleneck", "step_time"), "--objective")
    recompute = choice(recompute, RECOMPUTE_CHOICES, "--recompute")
    sharding = choice(sharding, SHARDING_CHOICES, "--sharding")
    auto_m = microbatches is not None and microbatches.strip().lower() == "auto"
    auto_s = schedule.strip().lower() == "auto"
    count = None if auto_m or microbatches is None else _count(microbatches, "--microbatches")
    if devices is None and stages is None:
        raise CLIUsageError("pass --stages P (pipeline ranks), or --devices N to weigh replicas x stages x "
                            "microbatches on N devices")
    search = None
    searching = auto_m or auto_s or devices is not None
    if searching:
        _, _, _, meth, limit = plan_args(stages or 1, None, None, "1f1b", method, memory_limit)
        if devices is None and count is not None:
            count = microbatches_for(stages or 1, count, batch_size)[0]
        note = None
        sched: Any = "auto" if auto_s else choice(schedule, SCHEDULE_CHOICES, "--schedule")
        m: Any = "auto" if auto_m and devices is None else count
    else:
        assert stages is not None
        m, note, sched, meth, limit = plan_args(stages, count, batch_size, schedule, method, memory_limit)
    request = _request(model, cluster=cluster, timing=timing, device=device, meta=meta, dtype=dtype, repeats=repeats,
                       batch_size=batch_size, seq_len=seq_len, stages=stages, devices=devices,
                       global_batch=global_batch, microbatches=m, schedule=sched, memory_limit=limit, method=meth,
                       time_limit=time_limit, virtual_stages=virtual_stages, objective=objective,
                       recompute=recompute, active_microbatches=active_microbatches, sharding=sharding,
                       tensor_parallel=_tensor_parallel(tensor_parallel, devices),
                       sequence_parallel="auto" if sequence_parallel is None else sequence_parallel)
    if searching:
        search, note = _search_plans(model, request, batch_size=batch_size, seq_len=seq_len, meta=meta,
                                     show_progress=not json_out)
        p = search.best
    else:
        p = _make_plan(model, request, batch_size=batch_size, seq_len=seq_len, meta=meta, show_progress=not json_out)
    files: dict[str, str | None] = {"plan": None, "timeline": None}
    if output is not None:
        files["plan"] = str(p.save(output))
    if timeline is not None:
        files["timeline"] = write_timeline(p, timeline)
    if json_out:
        extra = {"search": search.to_dict(), "candidates": [c.to_dict() for c in search.candidates]} \
            if search is not None else None
        print_json(report(p, plan_file=output, files=files, extra=extra))
        return
    if search is not None:
        con = rich_console()
        shown = search.candidates[:top] if top else search.candidates
        con.print(candidate_table(shown, shapes=devices is not None, title=(
            f"candidates weighed ({len(search.candidates)}, best first: the fastest simulated step that fits "
            "memory" + (f"; the {len(shown)} fastest shown" if len(shown) < len(search.candidates) else "") + ")")))
        more = len(search.candidates) - len(shown)
        if more:
            con.print(f"... and {more} more (--top 0 shows every one, --json lists them)")
        if search.lower_bound < float("inf"):
            con.print(f"no plan of these shapes steps in under {format_time(search.lower_bound)}, whatever its cut "
                      f"(the busiest rank's share of the compute); the chosen step is within {search.gap:.1%} of it")
        con.print()
    print_plan(p, files=files, note=note)


@app.command("inspect", epilog="Example: smp inspect plan.json --timeline timeline.png --graph stages.svg")
@command
def inspect_cmd(
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN.json", help="a plan saved by `smp plan -o`")],
    timeline: TimelineOpt = None,
    graph: Annotated[Optional[Path], typer.Option(
        "--graph", help="write a picture of the stage graph (.svg or .png): stages as boxes, cut tensors as "
                        "arrows")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Explain a saved plan: the stage table, cut tensors, warnings, the timeline and stage-graph pictures."""
    p = load_plan(plan_file)
    files: dict[str, str | None] = {"timeline": None, "graph": None}
    if timeline is not None:
        files["timeline"] = write_timeline(p, timeline)
    if graph is not None:
        if graph.suffix.lower() not in (".svg", ".png", ".pdf"):
            raise CLIUsageError(f"--graph writes .svg, .png or .pdf, not {graph.name!r}")
        files["graph"] = str(render_stage_graph(p, graph))
    if json_out:
        print_json(report(p, plan_file=plan_file, files=files))
        return
    con = rich_console()
    con.print(f"plan {plan_file} (smp {p.smp_version}, schema {p.schema}; model fingerprint "
              f"{p.model.fingerprint})")
    print_plan(p, cuts=True, files=files)


@app.command("simulate", epilog="Example: smp simulate plan.json --schedule gpipe --microbatches 16 "
                                 "--timeline gpipe.png")
@command
def simulate_cmd(
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN.json", help="a plan saved by `smp plan -o`")],
    schedule: Annotated[Optional[str], typer.Option(
        "--schedule", "-s", help="gpipe | 1f1b | zb-h1 (interleaved needs a re-plan) \\[default: the plan's]")] = None,
    microbatches: Annotated[Optional[int], typer.Option(
        "--microbatches", "-m", help="split the same batch into this many microbatches \\[default: the plan's]")] = None,
    active_microbatches: Annotated[Optional[int], typer.Option(
        "--active-microbatches", help="most microbatches a stage holds in flight (gpipe, 1f1b) \\[default: the "
                                      "plan's, where the schedule takes one]")] = None,
    timeline: TimelineOpt = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="save the re-timed plan here")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Re-time a plan's stage assignment under another schedule or microbatch count (no re-solve)."""
    from smp.units import format_time

    positive(microbatches, "--microbatches")
    positive(active_microbatches, "--active-microbatches")
    sched = choice(schedule, SCHEDULE_CHOICES, "--schedule")
    before = load_plan(plan_file)
    after = before.resimulate(schedule=sched, microbatches=microbatches,
                              active_microbatches="same" if active_microbatches is None else active_microbatches)
    files: dict[str, str | None] = {"plan": None, "timeline": None}
    if output is not None:
        files["plan"] = str(after.save(output))
    if timeline is not None:
        files["timeline"] = write_timeline(after, timeline)
    change = {
        "before": {"schedule": before.schedule_name, "microbatches": before.microbatches,
                   "step_time_s": before.step_time, "bubble_fraction": before.bubble},
        "after": {"schedule": after.schedule_name, "microbatches": after.microbatches,
                  "step_time_s": after.step_time, "bubble_fraction": after.bubble},
        "step_time_ratio": after.step_time / before.step_time if before.step_time > 0 else None,
    }
    if json_out:
        print_json(report(after, plan_file=plan_file, files=files, extra={"change": change}))
        return
    con = rich_console()
    ratio = change["step_time_ratio"]
    con.print(f"re-timed {plan_file}: {before.schedule_name}, {before.microbatches} microbatches → "
              f"{after.schedule_name}, {after.microbatches} microbatches: step {format_time(before.step_time)} → "
              f"{format_time(after.step_time)}" + (f" ({ratio:.2f}x)" if ratio else "") +
              f", bubble {before.bubble:.1%} → {after.bubble:.1%}")
    print_plan(after, files=files, solved=before)


@app.command("compare", epilog="Example: smp compare gpt:layers=8 --stages 4 --microbatches 8")
@command
def compare_cmd(
    model: Annotated[str, typer.Argument(metavar="MODEL|GRAPH.json",
                                         help="zoo spec, path/to/file.py:factory, or an op graph from `smp profile`")],
    stages: StagesOpt,
    microbatches: MicrobatchesOpt = None,
    schedule: ScheduleOpt = "1f1b",
    cluster: ClusterOpt = None,
    memory_limit: MemoryOpt = None,
    time_limit: TimeLimitOpt = None,
    methods: Annotated[str, typer.Option("--methods", help="comma-separated methods to compare")] =
    ",".join(METHOD_CHOICES),
    batch_size: StepBatchOpt = None,
    seq_len: SeqOpt = None,
    timing: TimingOpt = None,
    device: DeviceOpt = None,
    meta: MetaOpt = False,
    dtype: DtypeOpt = None,
    repeats: RepeatsOpt = 3,
    json_out: JsonOpt = False,
) -> None:
    """Every partitioning method side by side on one profile: bottleneck, step time, memory, solve time."""
    m, note, sched, _, limit = plan_args(stages, microbatches, batch_size, schedule, "auto", memory_limit)
    wanted = [x.strip().lower() for x in methods.split(",") if x.strip()]
    for w in wanted:
        choice(w, METHOD_CHOICES, "--methods")
    if not wanted:
        raise CLIUsageError("--methods names no method")
    # Profile once (the uniform baseline solves instantly and never fails), then solve on the same graph.
    request = _request(model, cluster=cluster, timing=timing, device=device, meta=meta, dtype=dtype, repeats=repeats,
                       batch_size=batch_size, seq_len=seq_len, stages=stages, microbatches=m, schedule=sched,
                       memory_limit=limit, time_limit=time_limit)
    base = _make_plan(model, request.with_(method="uniform", objective="bottleneck"), batch_size=batch_size,
                      seq_len=seq_len, meta=meta, show_progress=not json_out)
    rows = _compare_rows(base, wanted, request, show_progress=not json_out)
    ok = [r for r in rows if r.get("error") is None and r["fits_memory"]]
    best = min((r["step_time_s"] for r in ok), default=None)
    for r in rows:
        r["ratio_to_best"] = (r["step_time_s"] / best) if (best and r.get("error") is None) else None
    if json_out:
        print_json({"kind": "smp.compare", "schema": 1, "model": model, "stages": stages, "microbatches": m,
                    "schedule": sched, "ops": len(base.graph), "best_step_time_s": best, "methods": rows})
        return
    _print_compare(base, rows, note)


def _compare_rows(base, wanted: list[str], request: PlanRequest, *, show_progress: bool) -> list[dict[str, Any]]:
    """One row per method, solved on ``base``'s graph: the baselines as they cut, auto for the step time."""
    from partitioner.errors import PlanningError
    from smp.plan import plan_from_graph

    rows: list[dict[str, Any]] = []
    for meth in wanted:
        row: dict[str, Any] = {"method": meth}
        try:
            with spinner(f"solving with {meth}…", show_progress):
                p = base if meth == "uniform" else plan_from_graph(
                    base.graph, request.with_(method=meth, objective="step_time" if meth == "auto" else "bottleneck"),
                    model_info=base.model)
        except PlanningError as err:
            row.update({"error": " ".join(str(err).split())})
            rows.append(row)
            continue
        part = p.partition
        row.update({
            "solver": part.method, "bottleneck_s": part.bottleneck, "step_time_s": p.step_time,
            "bubble_fraction": p.bubble, "memory_peak_bytes": max(s.memory for s in part.stages),
            "fits_memory": part.memory_ok, "solve_seconds": part.solve_seconds, "optimal": bool(part.optimal),
            "lower_bound_s": part.lower_bound, "cut_tensors": len({t.node for t in part.transfers}),
            "error": None,
        })
        rows.append(row)
    return rows


def _print_compare(base, rows: list[dict[str, Any]], note: str | None) -> None:
    from rich import box
    from rich.table import Table

    from smp.units import format_bytes, format_time

    con = rich_console()
    con.print(plan_header(base))
    if note:
        con.print(note)
    t = Table(header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, kw in (("method", {}), ("bottleneck", {"justify": "right"}), ("step time", {"justify": "right"}),
                    ("bubble", {"justify": "right"}), ("memory peak", {"justify": "right"}),
                    ("cut tensors", {"justify": "right"}), ("solve time", {"justify": "right"}),
                    ("bottleneck optimal", {}), ("vs best", {"justify": "right"})):
        t.add_column(col, **kw)
    for r in rows:
        if r.get("error"):
            t.add_row(r["method"], "-", "-", "-", "-", "-", "-", "-", "infeasible")
            continue
        mem = format_bytes(r["memory_peak_bytes"]) + ("" if r["fits_memory"] else " (over)")
        solver = r["solver"].split("/", 1)[-1]
        t.add_row(r["method"] + (f" ({solver})" if r["method"] == "auto" else ""),
                  format_time(r["bottleneck_s"]), format_time(r["step_time_s"]), f"{r['bubble_fraction']:.1%}", mem,
                  str(r["cut_tensors"]), format_time(r["solve_seconds"]), "yes" if r["optimal"] else "no",
                  f"{r['ratio_to_best']:.2f}x" if r["ratio_to_best"] else "-")
    con.print(t)
    lb = max((r["lower_bound_s"] for r in rows if r.get("error") is None), default=0.0)
    con.print(f"lower bound on the bottleneck: {format_time(lb)}; 'vs best' is predicted step time over the best "
              "plan that fits memory; auto picks by step time, the others are each method's own cut")
    for r in rows:
        if r.get("error"):
            con.print(f"  ! {r['method']}: {r['error']}")
