"""The ``smp`` command line: see what the compiler decides, and why, without writing Python.

Commands: models, profile, plan, inspect, simulate, compare, calibrate, train
(docs/cli.md has each one with real output). Output for people goes to stdout through
rich; progress bars and errors go to stderr; ``--json`` prints one JSON document on
stdout and nothing else. User errors print one ``error: ...`` line and exit 1 (2 for
bad usage: unknown model, bad option value); ``smp --debug CMD`` shows the traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from smp._cli_errors import CLIUsageError, exit_code as _exit_code, user_error as _user_error
from rich.console import Console

__all__ = ["app", "main", "CLIUsageError"]

SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved", "zb-h1")  # ScheduleKind's values (the CLI starts without torch)
METHOD_CHOICES = ("auto", "dp", "cpsat", "uniform", "params", "blocks")
RECOMPUTE_CHOICES = ("auto", "none", "selective", "full")
TIMING_CHOICES = ("measured", "analytic")
DEVICE_CHOICES = ("cpu", "cuda")

app = typer.Typer(
    name="smp",
    help="smp: an automatic model-partitioning compiler for PyTorch pipeline parallelism.\n\n"
         "Profile a model, plan its pipeline stages, inspect and re-time plans, compare solvers, "
         "measure this machine, and train with the runtime.",
    epilog="Example: smp plan gpt:layers=8,d_model=256 --stages 4 --microbatches 8 -o plan.json",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_STATE: dict[str, Any] = {"debug": False}


# ------------------------------------------------------------------ consoles and errors


class _Console(Console):
    """A rich console that ends quietly with exit code 0 when its reader goes away (``smp ... | head -1``)."""

    def on_broken_pipe(self) -> None:  # rich's own exits with 1
        self.quiet = True
        _silence_stdout()
        raise SystemExit(0)


def _console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    width = None if tty else int(os.environ.get("COLUMNS", "160"))
    return _Console(file=stream, width=width, highlight=False, soft_wrap=False)


def _echo_err(message: str) -> None:
    typer.echo(message, err=True)


def _command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a command body; turn user errors into one ``error:`` line on stderr and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except BrokenPipeError:  # `smp ... | head -1`: the reader has all it wanted
            _silence_stdout()
            raise typer.Exit(0) from None
        except KeyboardInterrupt:
            if _STATE["debug"]:
                raise
            _echo_err("error: interrupted")
            raise typer.Exit(130) from None
        except Exception as err:  # noqa: BLE001 - the CLI's last line of defence
            import click

            if isinstance(err, click.ClickException) or _STATE["debug"]:
                raise
            message = _user_error(err)
            if message is None:
                _echo_err(f"error: internal error ({type(err).__name__}: {err}); this is a bug in smp: "
                          "rerun with `smp --debug ...` and report the traceback")
                raise typer.Exit(1) from None
            _echo_err(f"error: {' '.join(message.split())}")
            raise typer.Exit(_exit_code(err)) from None

    return wrapper


def _silence_stdout() -> None:
    """Point stdout at /dev/null after its reader went away, so that the flush at exit cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (a test runner's capture): nothing to flush
        pass


def _choice(value: str | None, choices: tuple[str, ...], option: str) -> str | None:
    if value is None:
        return None
    if option == "--schedule":  # every spelling ScheduleKind takes
        from partitioner.ir import ScheduleKind

        try:
            return ScheduleKind.parse(value).value
        except ValueError:
            raise CLIUsageError(f"bad value {value!r} for {option}: choose one of {', '.join(choices)}") from None
    low = value.strip().lower()
    if low not in choices:
        raise CLIUsageError(f"bad value {value!r} for {option}: choose one of {', '.join(choices)}")
    return low


def _count(value: str, option: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise CLIUsageError(f"bad value {value!r} for {option}: give a whole number or auto") from None


def _size(value: str | None, option: str) -> int | None:
    from smp.units import parse_size

    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as err:
        raise CLIUsageError(f"{option}: {err}") from None


def _positive(value: int | float | None, option: str, minimum: float = 1) -> None:
    if value is not None and value < minimum:
        raise CLIUsageError(f"{option} must be at least {minimum:g}, got {value:g}")


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return str(value)


@contextmanager
def _progress(label: str, enabled: bool, unit: str = "ops") -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr; yields the ``progress(done, total)`` callback (None when disabled)."""
    con = _console(stderr=True)
    if not enabled or not con.is_terminal:  # no bar in logs and pipes: it would only leave blank lines
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn(unit), TimeElapsedColumn(), console=con, transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@contextmanager
def _status(message: str, enabled: bool) -> Iterator[None]:
    """A spinner on stderr for steps without a progress count (the solver)."""
    con = _console(stderr=True)
    if not enabled or not con.is_terminal:
        yield
        return
    with con.status(message):
        yield


# ------------------------------------------------------------------ shared option types

ModelArg = Annotated[str, typer.Argument(
    metavar="MODEL", help="zoo spec (gpt:layers=8, gpt-1b, resnet:depth=18) or path/to/file.py:factory; "
                          "`smp models` lists the zoo")]
StagesOpt = Annotated[int, typer.Option("--stages", "-p", help="pipeline ranks (devices)")]
MicrobatchesOpt = Annotated[Optional[int], typer.Option(
    "--microbatches", "-m", help="microbatches per step \\[default: 2 x stages; with --batch-size, the largest "
                                 "divisor of the batch not above that]")]
ScheduleOpt = Annotated[str, typer.Option("--schedule", "-s", help="gpipe | 1f1b | interleaved | zb-h1")]
ClusterOpt = Annotated[Optional[str], typer.Option(
    "--cluster", "-c", help="device profile: a built-in name (cpu, h100-sxm, a100-sxm, h100-pcie) or a path "
                            "to a profile JSON (from `smp calibrate`); gives link speeds and device memory")]
MemoryOpt = Annotated[Optional[str], typer.Option(
    "--memory-limit", help="per-device memory, e.g. 40GiB, 80GB, 512MiB \\[default: the cluster's device memory, "
                           "or none]")]
MethodOpt = Annotated[str, typer.Option("--method", help="auto | dp | cpsat | uniform | params | blocks")]
TimeLimitOpt = Annotated[Optional[float], typer.Option(
    "--time-limit", help="the search budget in deterministic seconds (CP-SAT's measure of work: the same plan "
                         "on any machine); cpsat spends it on CP-SAT, auto at most twice it on its CP-SAT "
                         "searches (docs/optimizer.md) \\[default: 4]")]
StepBatchOpt = Annotated[Optional[int], typer.Option(
    "--batch-size", "-b", help="the whole batch of one step, split into the microbatches (a file model's sample "
                               "rows are repeated or cut to it) \\[default: microbatches x the spec's sample batch]")]
SeqOpt = Annotated[Optional[int], typer.Option("--seq-len", help="sequence length (sequence models)")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu | cuda: where measured timing runs")]
TimingOpt = Annotated[Optional[str], typer.Option(
    "--timing", help="measured (run every op here) | analytic (FLOPs and bytes priced on the --cluster "
                     "profile's device; with --meta: run one op at a time on --device, only its weights "
                     "materialized) \\[default: measured; analytic with --meta]")]
MetaOpt = Annotated[bool, typer.Option(
    "--meta", help="build the model on the meta device (no memory, no weights) and time it analytically "
                   "(or --timing measured: one op at a time): plans 1B-parameter presets in seconds")]
DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", help="analytic timing: price ops as if run in this dtype (fp32, bf16, fp16)")]
RepeatsOpt = Annotated[int, typer.Option("--repeats", help="measured timing: timed runs per op (median)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print machine-readable JSON on stdout, nothing else")]
TimelineOpt = Annotated[Optional[Path], typer.Option(
    "--timeline", help="write the schedule timeline picture (.png or .svg)")]


def _print_version(value: bool) -> None:
    if value:
        from smp import __version__

        typer.echo(f"smp {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="show the full traceback on errors")] = False,
    version: Annotated[bool, typer.Option("--version", help="print the version and exit", is_eager=True,
                                          callback=_print_version)] = False,
) -> None:
    _STATE["debug"] = debug


# ------------------------------------------------------------------ building and profiling models


def _is_graph_file(model: str) -> bool:
    return model.endswith(".json")


def _load_graph(path: str):
    from partitioner.graph import OpGraph

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no op graph file at {p}; write one with `smp profile MODEL -o {p}`")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{p} is not a valid op graph file (bad JSON: {err}); re-create it with "
                         "`smp profile MODEL -o graph.json`") from None
    if isinstance(data, dict) and data.get("kind") == "smp.Plan":
        raise CLIUsageError(f"{p} is a plan, not an op graph: use `smp inspect {p}` or `smp simulate {p}`")
    try:
        return OpGraph.from_dict(data)
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{p} is a damaged op graph file ({type(err).__name__}: {err}); re-create it with "
                         "`smp profile`") from None


def _timing_for(timing: str | None, meta: bool, cluster: str | None) -> tuple[str, str | None]:
    """(timing, device profile used to price analytic timing)."""
    timing = _choice(timing, TIMING_CHOICES, "--timing")
    timing = timing or ("analytic" if meta else "measured")
    profile_name = (cluster or ("h100-sxm" if meta else "cpu")) if timing == "analytic" else None
    return timing, profile_name


def _check_cluster(cluster: str | None) -> None:
    if cluster is None:
        return
    from partitioner.devices import load_profile
    from partitioner.errors import ProfileError

    try:
        load_profile(cluster)
    except ProfileError as err:
        raise CLIUsageError(str(err)) from None


def _spec_name(spec: str) -> str:
    return spec if len(spec) <= 48 else spec[:47] + "…"


# ------------------------------------------------------------------ models


@app.command("models", epilog="Example: smp models --json")
@_command
def models_cmd(json_out: JsonOpt = False) -> None:
    """The built-in model zoo: every model, its presets with parameter counts and sizes, and its options."""
    from smp.models import list_models, preset_table
    from smp.units import format_bytes, format_count

    infos = list_models()
    rows = preset_table()
    if json_out:
        _print_json({
            "kind": "smp.models",
            "models": [{
                "name": i.name, "description": i.description, "aliases": list(i.aliases),
                "options": [{"name": o.name, "default": o.default, "type": o.type.__name__, "help": o.help}
                            for o in i.options],
                "presets": [{"preset": r["preset"], "params": r["params"], "bytes": r["bytes"], "config": r["config"]}
                            for r in rows if r["model"] == i.name],
            } for i in infos],
        })
        return
    from rich import box
    from rich.table import Table

    con = _console()
    t = Table(title="smp model zoo (spec: NAME[:option=value,...], NAME-PRESET, or path/to/file.py:factory)",
              title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, kw in (("model", {}), ("preset", {}), ("params", {"justify": "right"}),
                    ("fp32 size", {"justify": "right"}), ("config", {"overflow": "fold"})):
        t.add_column(col, **kw)
    last = None
    for r in rows:
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items())  # type: ignore[union-attr]
        t.add_row(r["model"] if r["model"] != last else "", str(r["preset"]),
                  f"{int(r['params']):,} ({format_count(int(r['params']))})",  # type: ignore[call-overload]
                  format_bytes(int(r["bytes"])), cfg)  # type: ignore[call-overload]
        last = r["model"]
    con.print(t)
    con.print()
    d = Table(header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    d.add_column("model")
    d.add_column("what it is", overflow="fold", max_width=70)
    d.add_column("options (defaults)", overflow="fold", max_width=60)
    for i in infos:
        opts = ", ".join(f"{o.name}={o.default}" for o in i.options if o.name != "size")
        d.add_row(i.name, i.description, opts)
    con.print(d)
    missing = sorted({i.name for i in infos} - {r["model"] for r in rows})
    if missing:
        con.print(f"(no presets shown for {', '.join(missing)}: they need the `transformers` package)")


# ------------------------------------------------------------------ profile


@app.command("profile", epilog="Example: smp profile gpt:layers=4 --batch-size 4 -o graph.json")
@_command
def profile_cmd(
    model: ModelArg,
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", "-b", help="batch profiled (one microbatch; a file model's sample rows are repeated or cut "
                                   "to it) \\[default: the spec's sample batch]")] = None,
    seq_len: SeqOpt = None,
    device: DeviceOpt = None,
    timing: TimingOpt = None,
    cluster: Annotated[Optional[str], typer.Option(
        "--cluster", "-c", help="device profile that analytic timing prices ops on (built-in name or path)")] = None,
    meta: MetaOpt = False,
    dtype: DtypeOpt = None,
    repeats: RepeatsOpt = 3,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="write the op graph JSON here")] = None,
    top: Annotated[int, typer.Option("--top", help="how many of the heaviest ops to list")] = 10,
    json_out: JsonOpt = False,
) -> None:
    """Trace and profile a model op by op: op count, totals, the heaviest ops; -o writes the op graph."""
    _positive(batch_size, "--batch-size")
    _positive(repeats, "--repeats")
    device = _choice(device, DEVICE_CHOICES, "--device")
    _check_cluster(cluster)
    timing_, profile_name = _timing_for(timing, meta, cluster)
    from partitioner.profile import profile
    from partitioner.program import fingerprint
    from partitioner.trace import trace
    from smp.models import build

    bundle = build(model, batch_size=batch_size, seq_len=seq_len, meta=meta)
    t0 = time.perf_counter()
    gm = trace(bundle.model, bundle.example_args, bundle.example_kwargs)
    with _progress("profiling", not json_out) as cb:
        graph = profile(bundle.model, bundle.example_args, bundle.example_kwargs, timing=timing_, device=device,
                        repeats=repeats, device_profile=profile_name, dtype=dtype, training=bundle.model.training,
                        graph_module=gm if device in (None, "cpu") else None, progress=cb)
    seconds = time.perf_counter() - t0
    from partitioner.microbatch import batch_size as batch_of

    graph.meta.update({
        "name": model, "class": f"{type(bundle.model).__module__}.{type(bundle.model).__qualname__}",
        "fingerprint": fingerprint(gm, bundle.model), "num_params": bundle.num_params(),
        "param_bytes": bundle.param_bytes(),
        "batch_size": batch_of(bundle.example_args, bundle.example_kwargs),
    })
    if output is not None:
        graph.to_json(output)
    if json_out:
        _print_json(_profile_json(graph, model, top, output, seconds))
        return
    _print_profile(graph, model, top, output, seconds)


def _heavy_rows(graph, top: int) -> list[dict[str, Any]]:
    return [{"name": n, "op": d["op"], "module": d["module"], "fwd_s": d["fwd"], "bwd_s": d["bwd"],
             "out_bytes": d["out_bytes"], "params_bytes": d["params"], "flops": d["flops"]}
            for n, d in graph.heaviest(top, key="fwd")]


def _profile_json(graph, spec: str, top: int, output: Path | None, seconds: float) -> dict[str, Any]:
    m = graph.meta
    return {
        "kind": "smp.profile_summary", "schema": 1, "model": spec, "graph_file": str(output) if output else None,
        "ops": len(graph), "edges": graph.nx.number_of_edges(),
        "timing": m.get("timing"), "device": m.get("device"), "device_profile": m.get("device_profile"),
        "batch_size": m.get("batch_size"), "fingerprint": m.get("fingerprint"),
        "num_params": m.get("num_params"),
        "totals": {"fwd_s": graph.total_fwd, "bwd_s": graph.total_bwd, "params_bytes": graph.total_params,
                   "buffers_bytes": graph.total_buffers, "activation_bytes": graph.total_out_bytes,
                   "flops": graph.total_flops},
        "heaviest": _heavy_rows(graph, top),
        "seconds": seconds,
    }


def _print_profile(graph, spec: str, top: int, output: Path | None, seconds: float) -> None:
    from rich import box
    from rich.table import Table

    from smp.units import format_bytes, format_count, format_time

    m = graph.meta
    con = _console()
    how = m.get("timing")
    if how == "analytic":
        how += f" on the {m.get('device_profile')} profile" + (f" ({m['dtype']})" if m.get("dtype") else "")
    else:
        how += f" on {m.get('device')}, median of {m.get('repeats')}"
    con.print(f"[bold]{_spec_name(spec)}[/]: {len(graph)} ops, {graph.nx.number_of_edges()} edges, "
              f"{format_count(m.get('num_params') or 0)} parameters; batch {m.get('batch_size')}; timing {how}; "
              f"profiled in {format_time(seconds)}")
    con.print(f"totals per batch: forward {format_time(graph.total_fwd)}, backward {format_time(graph.total_bwd)}, "
              f"parameters {format_bytes(graph.total_params)}, activations {format_bytes(graph.total_out_bytes)}, "
              f"{graph.total_flops / 1e9:.3g} GFLOP forward")
    t = Table(title=f"the {min(top, len(graph))} heaviest ops (forward time)", title_justify="left",
              header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, kw in (("op", {}), ("kind", {}), ("module", {"overflow": "fold", "max_width": 32}),
                    ("fwd", {"justify": "right"}), ("bwd", {"justify": "right"}), ("output", {"justify": "right"}),
                    ("params", {"justify": "right"}), ("GFLOP", {"justify": "right"}), ("share", {"justify": "right"})):
        t.add_column(col, **kw)
    total = graph.total_fwd or 1.0
    for r in _heavy_rows(graph, top):
        t.add_row(r["name"], r["op"], r["module"] or "-", format_time(r["fwd_s"]), format_time(r["bwd_s"]),
                  format_bytes(r["out_bytes"]), format_bytes(r["params_bytes"]) if r["params_bytes"] else "-",
                  f"{r['flops'] / 1e9:.3g}", f"{r['fwd_s'] / total:.1%}")
    con.print(t)
    if output is not None:
        con.print(f"wrote the op graph to {output} (plan it with `smp plan {output} --stages N`)")


# ------------------------------------------------------------------ plan


def _make_plan(model: str, *, stages: int, microbatches: int, schedule: str, cluster: str | None,
               memory_limit: int | None, method: str, time_limit: float | None, batch_size: int | None,
               seq_len: int | None, timing: str | None, device: str | None, meta: bool, dtype: str | None,
               repeats: int, virtual_stages: int, show_progress: bool, objective: str = "step_time",
               recompute: str = "auto", active_microbatches: int | None = None):
    """A Plan from a model spec (trace + profile + solve) or from an op graph JSON (solve only)."""
    import smp
    from smp.models import build_step
    from smp.plan import plan_from_graph

    _check_cluster(cluster)
    if _is_graph_file(model):
        ignored = [n for n, v in (("--batch-size", batch_size), ("--seq-len", seq_len), ("--timing", timing),
                                  ("--device", device), ("--dtype", dtype)) if v is not None] + (
            ["--meta"] if meta else [])
        if ignored:
            raise CLIUsageError(f"{', '.join(ignored)} cannot apply to an op graph that is already profiled "
                                f"({model}); re-profile with `smp profile` to change them")
        graph = _load_graph(model)
        with _status(f"solving ({method})…", show_progress):
            return plan_from_graph(graph, stages=stages, microbatches=microbatches, schedule=schedule,
                                   cluster=cluster, memory_limit=memory_limit, method=method,
                                   time_limit=time_limit, virtual_stages=virtual_stages, objective=objective,
                                   recompute=recompute, active_microbatches=active_microbatches)
    device = _choice(device, DEVICE_CHOICES, "--device")
    timing_, profile_name = _timing_for(timing, meta, cluster)
    bundle = build_step(model, microbatches=microbatches, batch_size=batch_size, seq_len=seq_len, meta=meta)
    with _progress("profiling", show_progress) as cb:
        def progress(done: int, total: int) -> None:
            if cb is not None:
                cb(done, total)

        # The solve runs after the last op is profiled; the bar then stays at 100% until it returns.
        return smp.plan(bundle.model, bundle.example_args, bundle.example_kwargs, stages=stages,
                        microbatches=microbatches, schedule=schedule, cluster=cluster, memory_limit=memory_limit,
                        method=method, time_limit=time_limit, timing=timing_, device=device,
                        device_profile=profile_name, dtype=dtype, virtual_stages=virtual_stages,
                        repeats=repeats, name=model, objective=objective, progress=progress, recompute=recompute,
                        active_microbatches=active_microbatches)


def _search_plans(model: str, *, devices: int | None, stages: int | None, microbatches: int | None,
                  schedule: str | None, batch_size: int | None, global_batch: int | None, cluster: str | None,
                  memory_limit: int | None, method: str, time_limit: float | None, seq_len: int | None,
                  timing: str | None, device: str | None, meta: bool, dtype: str | None, repeats: int,
                  virtual_stages: int, show_progress: bool, objective: str, recompute: str):
    """``--devices N`` (replicas x stages x microbatches), ``--microbatches auto``, ``--schedule auto``.

    With --devices the spec's sample batch (or --batch-size) is one device's share and the
    global batch defaults to N of them; without it the pipeline's step batch is split, as
    for one plan. Returns (the search, a note on the batch)."""
    from partitioner.microbatch import batch_size as batch_of
    from smp.models import build_step
    from smp.plan import plan_shapes

    if _is_graph_file(model):
        raise CLIUsageError("--devices, --microbatches auto and --schedule auto trace the model to record it in the "
                            f"plans they weigh, so they need a model spec, not the op graph {model}")
    _check_cluster(cluster)
    device = _choice(device, DEVICE_CHOICES, "--device")
    timing_, profile_name = _timing_for(timing, meta, cluster)
    if devices is None:
        assert stages is not None
        bundle = build_step(model, microbatches=(microbatches or 2 * stages) if batch_size is None else 1,
                            batch_size=batch_size, seq_len=seq_len, meta=meta)
        batch = batch_of(bundle.example_args, bundle.example_kwargs)
        note = None if batch_size is not None or microbatches is not None else (
            f"--microbatches auto: the batch is {batch} (2 x {stages} stages x the spec's sample batch; set it with "
            "--batch-size)")
    else:
        bundle = build_step(model, microbatches=1, batch_size=batch_size, seq_len=seq_len, meta=meta)
        sample = batch_of(bundle.example_args, bundle.example_kwargs)
        batch = global_batch or devices * sample
        note = (f"--devices {devices}: a global batch of {batch}"
                + ("" if global_batch else f" ({devices} devices x the sample batch of {sample}; set it with "
                                           "--global-batch)"))
    with _progress("weighing shapes", show_progress, unit="shapes") as cb:
        search = plan_shapes(
            bundle.model, bundle.example_args, bundle.example_kwargs, devices=devices or stages,
            global_batch=batch, stages=stages, microbatches=microbatches, schedule=schedule or "auto",
            cluster=cluster, memory_limit=memory_limit, method=method, time_limit=time_limit, timing=timing_,
            device=device, device_profile=profile_name, dtype=dtype, virtual_stages=virtual_stages,
            repeats=repeats, name=model, objective=objective, recompute=recompute, shape_progress=cb)
    return search, note


def _microbatches(stages: int, microbatches: int | None, batch_size: int | None) -> tuple[int, str | None]:
    """The microbatch count, and a note for the output when it was chosen for the user.

    Without --batch-size a microbatch is the spec's sample batch and any count works: 2 x
    stages. With --batch-size B the count must divide B: the largest divisor of B not above
    2 x stages.
    """
    _positive(batch_size, "--batch-size")
    if microbatches is not None:
        if batch_size is not None and batch_size % microbatches:
            raise CLIUsageError(f"--batch-size {batch_size} does not split into --microbatches {microbatches}: "
                                f"use a batch that is a multiple of {microbatches}, or a count that divides "
                                f"{batch_size}")
        return microbatches, None
    if batch_size is None:
        return 2 * stages, None
    m = max(d for d in range(1, min(batch_size, 2 * stages) + 1) if batch_size % d == 0)
    return m, (f"--microbatches defaults to {m}: the largest divisor of the batch ({batch_size}) "
               f"not above 2 x {stages} stages")


def _plan_args(stages: int, microbatches: int | None, batch_size: int | None, schedule: str, method: str,
               memory_limit: str | None, time_limit: float | None,
               repeats: int) -> tuple[int, str | None, str, str, int | None]:
    """(microbatches, a note on how they were chosen, schedule, method, memory limit) from the options."""
    _positive(stages, "--stages")
    _positive(microbatches, "--microbatches")
    _positive(repeats, "--repeats")
    if time_limit is not None and time_limit <= 0:
        raise CLIUsageError(f"--time-limit must be more than 0 seconds, got {time_limit:g}")
    m, note = _microbatches(stages, microbatches, batch_size)
    return (m, note, _choice(schedule, SCHEDULE_CHOICES, "--schedule"), _choice(method, METHOD_CHOICES, "--method"),
            _size(memory_limit, "--memory-limit"))


def _header(plan) -> str:
    from smp.units import format_bytes, format_count

    m = plan.model
    part = plan.partition
    how = m.timing or "?"
    if how == "analytic":
        how += f" on {plan.graph.meta.get('device_profile')}"
    elif m.profiled_on:
        how += f" on {m.profiled_on}"
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
             f"({plan.placement})")
    cap = f" (at most {plan.active_microbatches} in flight)" if plan.active_microbatches is not None else ""
    return (f"[bold]{_spec_name(m.name)}[/]: {len(plan.graph)} ops{params} → {plan.num_stages} "
            f"{where} · {plan.schedule_name}{cap} · {mb}{' per replica' if plan.data_parallel > 1 else ''}\n"
            f"timing {how} · cluster {cl} · memory limit {format_bytes(limit)}")


def _print_plan(plan, *, cuts: bool = False, files: dict[str, str | None] | None = None, title: str | None = None,
                solved=None, note: str | None = None) -> None:
    from smp._cli_render import comm_legend, cut_table, headline, stage_table, warnings_for

    con = _console()
    con.print(_header(plan))
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


def _write_timeline(plan, path: Path, title: str | None = None) -> str:
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


@app.command("plan", epilog="Example: smp plan gpt:layers=8,d_model=256 --stages 4 --microbatches 8 "
                             "--schedule 1f1b -o plan.json; smp plan gpt-1b --meta --devices 16 --cluster h100-sxm")
@_command
def plan_cmd(
    model: Annotated[str, typer.Argument(metavar="MODEL|GRAPH.json",
                                         help="zoo spec, path/to/file.py:factory, or an op graph from `smp profile`")],
    stages: Annotated[Optional[int], typer.Option("--stages", "-p", help="pipeline ranks (devices) \\[with "
                                                  "--devices: searched among the divisors of N]")] = None,
    devices: Annotated[Optional[int], typer.Option(
        "--devices", "-n", help="weigh every replicas x stages x microbatches shape on N devices of --cluster and "
                                "keep the fastest")] = None,
    global_batch: Annotated[Optional[int], typer.Option(
        "--global-batch", help="with --devices: samples per step over all replicas \\[default: N x the sample "
                               "batch]")] = None,
    microbatches: Annotated[Optional[str], typer.Option(
        "--microbatches", "-m", help="microbatches per step, or auto: try the divisors of the batch from stages "
                                     "up and keep the fastest simulated step that fits memory \\[default: 2 x stages; with "
                                     "--batch-size, the largest divisor of the batch not above that]")] = None,
    schedule: Annotated[str, typer.Option(
        "--schedule", "-s", help="gpipe | 1f1b | interleaved | zb-h1 | auto (try each, keep the fastest that "
                                 "fits)")] = "1f1b",
    recompute: Annotated[str, typer.Option(
        "--recompute", help="activation recomputation per stage: auto (chosen with the partition, only where the "
                            "memory limit needs it) | none | selective | full")] = "auto",
    active_microbatches: Annotated[Optional[int], typer.Option(
        "--active-microbatches", help="most microbatches a stage holds in flight (gpipe, 1f1b; SMP v1's name): "
                                      "less activation memory, a longer bubble \\[default: the schedule's own]")] = None,
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
    objective: Annotated[str, typer.Option(
        "--objective", help="step_time (the fastest simulated step among the bottleneck-optimal plan and the "
                            "peer baselines, refined) or bottleneck (the plan minimising the slowest stage, "
                            "with a proven bound)")] = "step_time",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="save the plan JSON here")] = None,
    timeline: TimelineOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Partition a model into pipeline stages: per-stage table, predicted step time, bubble, lower bound, gap.

    With --devices N, weigh every replicas x stages x microbatches shape on N devices and show the candidates.
    """
    objective = _choice(objective.replace("-", "_"), ("bottleneck", "step_time"), "--objective")
    recompute = _choice(recompute, RECOMPUTE_CHOICES, "--recompute")
    auto_m = microbatches is not None and microbatches.strip().lower() == "auto"
    auto_s = schedule.strip().lower() == "auto"
    count = None if auto_m or microbatches is None else _count(microbatches, "--microbatches")
    _positive(virtual_stages, "--virtual-stages")
    _positive(devices, "--devices")
    _positive(global_batch, "--global-batch")
    _positive(active_microbatches, "--active-microbatches")
    if devices is None and stages is None:
        raise CLIUsageError("pass --stages P (pipeline ranks), or --devices N to weigh replicas x stages x "
                            "microbatches on N devices")
    if global_batch is not None and devices is None:
        raise CLIUsageError("--global-batch goes with --devices; for one pipeline the step batch is --batch-size")
    search = None
    if (auto_m or auto_s or devices is not None) and active_microbatches is not None:
        raise CLIUsageError("--active-microbatches fixes one schedule's warm-up, and --devices / auto weigh schedules "
                            "and microbatch counts as they are: drop one")
    if auto_m or auto_s or devices is not None:
        _, _, _, meth, limit = _plan_args(stages or 1, None, None, "1f1b", method, memory_limit, time_limit, repeats)
        if devices is None and count is not None:
            count = _microbatches(stages or 1, count, batch_size)[0]
        search, note = _search_plans(
            model, devices=devices, stages=stages, microbatches=count,
            schedule=None if auto_s else _choice(schedule, SCHEDULE_CHOICES, "--schedule"), batch_size=batch_size,
            global_batch=global_batch, cluster=cluster, memory_limit=limit, method=meth, time_limit=time_limit,
            seq_len=seq_len, timing=timing, device=device, meta=meta, dtype=dtype, repeats=repeats,
            virtual_stages=virtual_stages, show_progress=not json_out, objective=objective, recompute=recompute)
        p = search.best
    else:
        assert stages is not None
        m, note, sched, meth, limit = _plan_args(stages, count, batch_size, schedule, method, memory_limit,
                                                 time_limit, repeats)
        p = _make_plan(model, stages=stages, microbatches=m, schedule=sched, cluster=cluster, memory_limit=limit,
                       method=meth, time_limit=time_limit, batch_size=batch_size, seq_len=seq_len, timing=timing,
                       device=device, meta=meta, dtype=dtype, repeats=repeats, virtual_stages=virtual_stages,
                       show_progress=not json_out, objective=objective, recompute=recompute,
                       active_microbatches=active_microbatches)
    files: dict[str, str | None] = {"plan": None, "timeline": None}
    if output is not None:
        files["plan"] = str(p.save(output))
    if timeline is not None:
        files["timeline"] = _write_timeline(p, timeline)
    if json_out:
        from smp._cli_render import report

        extra = {"search": search.to_dict(), "candidates": [c.to_dict() for c in search.candidates]} \
            if search is not None else None
        _print_json(report(p, plan_file=output, files=files, extra=extra))
        return
    if search is not None:
        from smp._cli_render import candidate_table

        con = _console()
        con.print(candidate_table(search.candidates, shapes=devices is not None, title=(
            f"candidates weighed ({len(search.candidates)}, best first: the fastest simulated step that fits "
            "memory)")))
        con.print()
    _print_plan(p, files=files, note=note)


# ------------------------------------------------------------------ inspect


def _load_plan(path: Path):
    from smp.plan import Plan, PlanError

    if path.is_dir():
        raise PlanError(f"{path} is a directory, not a plan file")
    return Plan.load(path)


@app.command("inspect", epilog="Example: smp inspect plan.json --timeline timeline.png --graph stages.svg")
@_command
def inspect_cmd(
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN.json", help="a plan saved by `smp plan -o`")],
    timeline: TimelineOpt = None,
    graph: Annotated[Optional[Path], typer.Option(
        "--graph", help="write a picture of the stage graph (.svg or .png): stages as boxes, cut tensors as "
                        "arrows")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Explain a saved plan: the stage table, cut tensors, warnings, the timeline and stage-graph pictures."""
    from smp._cli_render import render_stage_graph, report

    p = _load_plan(plan_file)
    files: dict[str, str | None] = {"timeline": None, "graph": None}
    if timeline is not None:
        files["timeline"] = _write_timeline(p, timeline)
    if graph is not None:
        if graph.suffix.lower() not in (".svg", ".png", ".pdf"):
            raise CLIUsageError(f"--graph writes .svg, .png or .pdf, not {graph.name!r}")
        files["graph"] = str(render_stage_graph(p, graph))
    if json_out:
        _print_json(report(p, plan_file=plan_file, files=files))
        return
    con = _console()
    con.print(f"plan {plan_file} (smp {p.smp_version}, schema {p.schema}; model fingerprint "
              f"{p.model.fingerprint})")
    _print_plan(p, cuts=True, files=files)


# ------------------------------------------------------------------ simulate


@app.command("simulate", epilog="Example: smp simulate plan.json --schedule gpipe --microbatches 16 "
                                 "--timeline gpipe.png")
@_command
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

    _positive(microbatches, "--microbatches")
    _positive(active_microbatches, "--active-microbatches")
    sched = _choice(schedule, SCHEDULE_CHOICES, "--schedule")
    before = _load_plan(plan_file)
    after = before.resimulate(schedule=sched, microbatches=microbatches,
                              active_microbatches="same" if active_microbatches is None else active_microbatches)
    files: dict[str, str | None] = {"plan": None, "timeline": None}
    if output is not None:
        files["plan"] = str(after.save(output))
    if timeline is not None:
        files["timeline"] = _write_timeline(after, timeline)
    change = {
        "before": {"schedule": before.schedule_name, "microbatches": before.microbatches,
                   "step_time_s": before.step_time, "bubble_fraction": before.bubble},
        "after": {"schedule": after.schedule_name, "microbatches": after.microbatches,
                  "step_time_s": after.step_time, "bubble_fraction": after.bubble},
        "step_time_ratio": after.step_time / before.step_time if before.step_time > 0 else None,
    }
    if json_out:
        from smp._cli_render import report

        _print_json(report(after, plan_file=plan_file, files=files, extra={"change": change}))
        return
    con = _console()
    ratio = change["step_time_ratio"]
    con.print(f"re-timed {plan_file}: {before.schedule_name}, {before.microbatches} microbatches → "
              f"{after.schedule_name}, {after.microbatches} microbatches: step {format_time(before.step_time)} → "
              f"{format_time(after.step_time)}" + (f" ({ratio:.2f}x)" if ratio else "") +
              f", bubble {before.bubble:.1%} → {after.bubble:.1%}")
    _print_plan(after, files=files, solved=before)


# ------------------------------------------------------------------ compare


@app.command("compare", epilog="Example: smp compare gpt:layers=8 --stages 4 --microbatches 8")
@_command
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
    m, note, sched, _, limit = _plan_args(stages, microbatches, batch_size, schedule, "auto", memory_limit,
                                          time_limit, repeats)
    wanted = [x.strip().lower() for x in methods.split(",") if x.strip()]
    for w in wanted:
        _choice(w, METHOD_CHOICES, "--methods")
    if not wanted:
        raise CLIUsageError("--methods names no method")
    # Profile once (the uniform baseline solves instantly and never fails), then solve on the same graph.
    base = _make_plan(model, stages=stages, microbatches=m, schedule=sched, cluster=cluster, memory_limit=limit,
                      method="uniform", time_limit=time_limit, batch_size=batch_size, seq_len=seq_len,
                      timing=timing, device=device, meta=meta, dtype=dtype, repeats=repeats, virtual_stages=2,
                      show_progress=not json_out, objective="bottleneck")
    rows = _compare_rows(base, wanted, stages=stages, microbatches=m, schedule=sched, cluster=cluster,
                         memory_limit=limit, time_limit=time_limit, show_progress=not json_out)
    ok = [r for r in rows if r.get("error") is None and r["fits_memory"]]
    best = min((r["step_time_s"] for r in ok), default=None)
    for r in rows:
        r["ratio_to_best"] = (r["step_time_s"] / best) if (best and r.get("error") is None) else None
    if json_out:
        _print_json({"kind": "smp.compare", "schema": 1, "model": model, "stages": stages, "microbatches": m,
                     "schedule": sched, "ops": len(base.graph), "best_step_time_s": best, "methods": rows})
        return
    _print_compare(base, rows, note)


def _compare_rows(base, wanted: list[str], *, stages: int, microbatches: int, schedule: str, cluster: str | None,
                  memory_limit: int | None, time_limit: float | None, show_progress: bool) -> list[dict[str, Any]]:
    """One row per method, solved on ``base``'s graph: the baselines as they cut, auto for the step time."""
    from partitioner.errors import PlanningError
    from smp.plan import plan_from_graph

    rows: list[dict[str, Any]] = []
    for meth in wanted:
        row: dict[str, Any] = {"method": meth}
        try:
            with _status(f"solving with {meth}…", show_progress):
                p = base if meth == "uniform" else plan_from_graph(
                    base.graph, stages=stages, microbatches=microbatches, schedule=schedule, cluster=cluster,
                    memory_limit=memory_limit, method=meth, time_limit=time_limit, model_info=base.model,
                    objective="step_time" if meth == "auto" else "bottleneck")
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

    con = _console()
    con.print(_header(base))
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


# ------------------------------------------------------------------ calibrate


@app.command("calibrate", epilog="Example: smp calibrate -o profiles/my-laptop.json")
@_command
def calibrate_cmd(
    output: Annotated[Path, typer.Option("--output", "-o", help="where to write the profile JSON")],
    name: Annotated[Optional[str], typer.Option("--name", help="profile name \\[default: the file's stem]")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="small sizes and few repeats (a few seconds; rougher)")] =
    False,
    device: Annotated[Optional[str], typer.Option(
        "--device", help="cpu | cuda \\[default: cuda when a GPU is present]")] = None,
    no_link: Annotated[bool, typer.Option("--no-link", help="skip the two-process link measurement")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Measure this machine (matmul FLOP/s per dtype, memory bandwidth, gloo/NCCL point-to-point) as a profile."""
    from smp.calibrate import calibrate
    from smp.units import format_bytes, format_rate, format_time

    device = _choice(device, DEVICE_CHOICES, "--device")
    con = _console(stderr=True)
    log = (lambda msg: None) if json_out else (lambda msg: con.print(f"[dim]{msg}[/]"))
    prof = calibrate(name=name or output.stem, quick=quick, device=device, link=not no_link, log=log)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(prof, indent=1) + "\n")
    if json_out:
        _print_json(prof)
        return
    out = _console()
    dev = prof["device"]
    out.print(f"[bold]{prof['name']}[/]: {dev['name']} ({dev['type']})")
    for dt, flops in dev["peak_flops"].items():
        out.print(f"  matmul {dt:<5} {format_rate(flops, 'FLOP')}")
    out.print(f"  memory bandwidth {format_rate(dev['memory_bandwidth'])} (copy), memory {format_bytes(dev['memory_bytes'])}")
    intra = prof["links"]["intra_node"]
    if intra.get("bandwidth"):
        out.print(f"  link ({intra['name']}): {format_rate(intra['bandwidth'])}, latency {format_time(intra['latency'])}")
    out.print(f"wrote {output}; use it with `--cluster {output}`")


# ------------------------------------------------------------------ train


@app.command("train", epilog="Example: smp train gpt:layers=4 --stages 2 --microbatches 4 --steps 20")
@_command
def train_cmd(
    model: ModelArg,
    stages: StagesOpt,
    microbatches: MicrobatchesOpt = None,
    schedule: ScheduleOpt = "1f1b",
    steps: Annotated[int, typer.Option("--steps", help="training steps")] = 10,
    batch_size: StepBatchOpt = None,
    seq_len: SeqOpt = None,
    lr: Annotated[float, typer.Option("--lr", help="learning rate (Adam)")] = 1e-3,
    plan_file: Annotated[Optional[Path], typer.Option(
        "--plan", help="use this saved plan instead of planning again (it must be for MODEL)")] = None,
    device: Annotated[Optional[str], typer.Option(
        "--device", help="cpu (gloo) | cuda (NCCL) \\[default: cuda when there are as many GPUs as stages]")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds before a stuck run is stopped")] = 600.0,
    json_out: JsonOpt = False,
) -> None:
    """Train MODEL on synthetic data with the pipeline runtime: torchrun on this machine, one process per stage."""
    from smp._cli_train import run_train

    if plan_file is not None and microbatches is None:  # the step the plan was made for
        microbatches = _load_plan(plan_file).microbatches
    m, note, sched, _, _ = _plan_args(stages, microbatches, batch_size, schedule, "auto", None, None, 1)
    _positive(steps, "--steps")
    device = _choice(device, DEVICE_CHOICES, "--device")
    code = run_train(model, stages=stages, microbatches=m, schedule=sched, steps=steps, batch_size=batch_size,
                     seq_len=seq_len, lr=lr, plan_file=plan_file, device=device, timeout=timeout,
                     json_out=json_out, console=_console(), err_console=_console(stderr=True), note=note,
                     debug=_STATE["debug"])
    if code:
        raise typer.Exit(code)


# ------------------------------------------------------------------ entry point


def main(argv: list[str] | None = None) -> int:
    """The console script ``smp``."""
    try:
        app(args=argv, prog_name="smp", standalone_mode=True)
    except SystemExit as exc:  # click exits through SystemExit in standalone mode
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
