"""``smp train``: launch the pipeline runtime through torchrun on this machine with synthetic data.

The parent process checks the request (model spec, saved plan vs model), then runs
``python -m torch.distributed.run --standalone --nproc_per_node P -m smp.cli.train_worker``.
Every worker builds the same model (same seed), wraps it with ``smp.partition`` and
trains on the spec's synthetic batch; the rank that sees the loss prints one JSON line
per step (``{"event": "step", ...}``) which the parent prints as it arrives (with a progress
bar on a terminal) and, at the end, the measured vs predicted step time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from smp.cli.errors import CLIUsageError
from smp.cli.files import load_plan
from smp.cli.options import (DEVICE_CHOICES, JsonOpt, MicrobatchesOpt, ModelArg, ScheduleOpt, SeqOpt, StagesOpt,
                             StepBatchOpt, choice, plan_args, positive)
from smp.cli.output import rich_console
from smp.cli.root import STATE, app, command
from smp.cli.train_worker import EVENT_PREFIX

__all__ = ["train_cmd", "run_train", "check_plan_matches"]


@app.command("train", epilog="Example: smp train gpt:layers=4 --stages 2 --microbatches 4 --steps 20")
@command
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
    if plan_file is not None and microbatches is None:  # the step the plan was made for
        microbatches = load_plan(plan_file).microbatches
    positive(stages, "--stages")  # no planning request checks it here first
    m, note, sched, _, _ = plan_args(stages, microbatches, batch_size, schedule, "auto", None)
    positive(steps, "--steps")
    device = choice(device, DEVICE_CHOICES, "--device")
    code = run_train(model, stages=stages, microbatches=m, schedule=sched, steps=steps, batch_size=batch_size,
                     seq_len=seq_len, lr=lr, plan_file=plan_file, device=device, timeout=timeout,
                     json_out=json_out, console=rich_console(), err_console=rich_console(stderr=True), note=note,
                     debug=STATE["debug"])
    if code:
        raise typer.Exit(code)



def check_plan_matches(plan_file: Path, spec: str, *, batch_size: int | None, seq_len: int | None,
                       microbatches: int):
    """Load ``plan_file`` and refuse it when it was made for another model (fingerprints differ)."""
    from partitioner.program import fingerprint
    from partitioner.trace import trace
    from smp.models import build_step
    from smp.plan import Plan, PlanError

    plan = Plan.load(plan_file)
    bundle = build_step(spec, microbatches=microbatches, batch_size=batch_size, seq_len=seq_len)
    gm = trace(bundle.model, bundle.example_args, bundle.example_kwargs)
    fp = fingerprint(gm, bundle.model)
    want = plan.model.fingerprint
    if want != fp:
        raise PlanError(f"{plan_file} was made for another model ({plan.model.name}, fingerprint {want}); "
                        f"{spec} has fingerprint {fp}: plan this model with `smp plan {spec} --stages "
                        f"{plan.num_ranks} -o PLAN.json` or pass the model the plan was made for")
    return plan


def run_train(spec: str, *, stages: int, microbatches: int, schedule: str, steps: int, batch_size: int | None,
              seq_len: int | None, lr: float, plan_file: Path | None, device: str | None, timeout: float,
              json_out: bool, console: Any, err_console: Any, note: str | None = None, debug: bool = False) -> int:
    """Check, launch, follow and summarise a training run; returns the exit code.

    A failed run raises TrainError with the failing rank's own message; with ``debug`` the
    workers' whole stderr (their tracebacks, torchrun's report) is copied to ours first.
    """
    device = _check_job(spec, stages=stages, microbatches=microbatches, batch_size=batch_size, seq_len=seq_len,
                        plan_file=plan_file, device=device)
    job = {"spec": spec, "stages": stages, "microbatches": microbatches, "schedule": schedule, "steps": steps,
           "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "device": device, "timeout": timeout,
           "plan": str(plan_file) if plan_file is not None else None}
    if not json_out:
        if note:
            err_console.print(f"[dim]{note}[/]")
        err_console.print(f"[dim]launching: torchrun --standalone --nproc_per_node={stages} -m smp.cli.train_worker "
                          f"({device}, {'NCCL' if device == 'cuda' else 'gloo'})[/]")
    run = _follow(job, timeout=timeout, console=console, err_console=err_console, show=not json_out)
    if run.code != 0 or not run.summary:
        if debug:
            sys.stderr.write("".join(run.err_lines))
        raise TrainError(_failure(run.code, run.errors, _killed_ranks(run.err_lines)))
    if json_out:
        sys.stdout.write(json.dumps({"kind": "smp.train", "schema": 1, "job": job, "steps": run.steps,
                                     "summary": run.summary}, indent=2) + "\n")
        return 0
    _print_run(run, console)
    return 0


def _check_job(spec: str, *, stages: int, microbatches: int, batch_size: int | None, seq_len: int | None,
               plan_file: Path | None, device: str | None) -> str:
    """Refuse a bad spec, a plan for another model or shape, or GPUs that are not there, before any process starts;
    returns the device the ranks run on."""
    import torch

    from smp.models import build

    build(spec, meta=True, seq_len=seq_len)
    if plan_file is not None:
        plan = check_plan_matches(plan_file, spec, batch_size=batch_size, seq_len=seq_len, microbatches=microbatches)
        if plan.num_ranks != stages:
            raise CLIUsageError(f"{plan_file} is a plan for {plan.num_ranks} ranks, but --stages is {stages}")
        if plan.microbatches != microbatches:
            raise CLIUsageError(f"{plan_file} is a plan for {plan.microbatches} microbatches, but --microbatches is "
                                f"{microbatches}: drop --microbatches, or re-plan with it")
    if device is None:
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= stages else "cpu"
    if device == "cuda" and torch.cuda.device_count() < stages:
        raise CLIUsageError(f"--device cuda needs {stages} GPUs, this machine has {torch.cuda.device_count()}")
    return device


@dataclass
class _Run:
    """What torchrun's ranks reported: exit code, step events, the summary, errors, and their stderr."""

    code: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    err_lines: list[str] = field(default_factory=list)


def _follow(job: dict[str, Any], *, timeout: float, console: Any, err_console: Any, show: bool) -> _Run:
    """Run torchrun with the job and follow its event lines until it ends: each step's line printed as it arrives
    (a progress bar too on a terminal), the ranks stopped on Ctrl-C or after ``timeout`` seconds."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    stages = job["stages"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={stages}",
           "-m", "smp.cli.train_worker", json.dumps(job)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // stages)))
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=os.getcwd())
    run = _Run(code=-1)

    def pump_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            run.err_lines.append(line)

    reader = threading.Thread(target=pump_stderr, daemon=True)
    reader.start()
    timed_out = threading.Event()

    def stop_for_timeout() -> None:  # a stuck run prints nothing: a timer, not the line loop, must stop it
        timed_out.set()
        _stop_ranks(proc)

    watchdog = threading.Timer(timeout, stop_for_timeout)
    watchdog.daemon = True
    watchdog.start()
    bar_shown = show and err_console.is_terminal
    # On one terminal the step lines go above the bar (through its console); else to stdout as they come.
    lines_to = err_console if bar_shown and console.is_terminal else console
    try:
        with Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=err_console, transient=True,
                      disable=not bar_shown) as bar:
            task = bar.add_task("train", total=job["steps"], info="")
            assert proc.stdout is not None
            for line in proc.stdout:
                if not line.startswith(EVENT_PREFIX):
                    continue
                event = json.loads(line[len(EVENT_PREFIX):])
                if event.get("event") == "error":
                    run.errors.append(event)
                elif event.get("event") == "step":
                    run.steps.append(event)
                    bar.update(task, completed=event["step"],
                               info=f"loss {event['loss']:.4f} · {event['samples_per_s']:.1f} samples/s")
                    if show:
                        lines_to.print(_step_line(event))
                elif event.get("event") == "summary":
                    run.summary = event
            run.code = proc.wait()
    except BaseException:  # Ctrl-C, a closed stdout: no rank outlives the command
        _stop_ranks(proc)
        raise
    finally:
        watchdog.cancel()
    reader.join(timeout=5)
    if timed_out.is_set():
        raise TimeoutError_(f"the training run passed --timeout {timeout:g} s and was stopped")
    return run


def _stop_ranks(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop torchrun and its ranks: SIGTERM (torchrun passes it on to the ranks), SIGKILL after ``grace`` seconds."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if threading.current_thread() is threading.main_thread() \
        else None  # a second Ctrl-C must not cut the clean-up short (and print a traceback)
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _step_line(event: dict[str, Any]) -> str:
    from smp.units import format_time

    return (f"step {event['step']:>4}  loss {event['loss']:.4f}  {format_time(event['seconds'])}  "
            f"{event['samples_per_s']:.1f} samples/s")


def _print_run(run: _Run, console: Any) -> None:
    from smp.units import format_time

    measured = run.summary.get("measured_step_time")
    predicted = run.summary.get("predicted_step_time")
    line = f"measured step time {format_time(measured)} (median after the first step)"
    if predicted:
        line += f"; predicted {format_time(predicted)} ({measured / predicted:.2f}x the prediction)"
    console.print(line)


_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def _killed_ranks(err_lines: list[str]) -> list[tuple[int, int]]:
    """(rank, signal) for each rank that torchrun's failure report says a signal ended (its exitcode -signal)."""
    found = {int(rank): -int(code) for rank, code in _FAILURE.findall("".join(err_lines)) if int(code) < 0}
    # SIGTERM last: it is what torchrun sends the ranks left once one has died
    return sorted(found.items(), key=lambda item: (item[1] == 15, item[0]))


def _signal_name(number: int) -> str:
    import signal

    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def _failure(code: int, errors: list[dict[str, Any]], killed: list[tuple[int, int]]) -> str:
    """One line on why a run failed: a rank a signal ended (the others' errors follow from it), else the first
    rank whose own code raised (else the first to report an error), in its own words, else a rank torchrun
    stopped."""
    if killed and (killed[0][1] != 15 or not errors):  # torchrun's SIGTERM to the rest follows a rank's own error
        rank, number = killed[0]
        others = sorted(({r for r, _ in killed} | {e["rank"] for e in errors}) - {rank})
        also = f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too)" if others else ""
        hint = ("; the kernel's out-of-memory killer does this when memory runs out: a smaller --batch-size or more "
                "--stages needs less per rank" if number == 9 else "")
        return f"rank {rank} was killed by {_signal_name(number)}{also}{hint}"
    if code < 0:
        return f"torchrun was killed by {_signal_name(-code)} before any rank could report why"
    if not errors:
        return (f"the training run failed (torchrun exit code {code}) before any rank could report why; "
                "rerun with `smp --debug train ...` to see the ranks' output")
    # an error in the user's code explains the rest: the other ranks fail together, naming it (runtime/faults.py)
    first = next((e for e in errors if e.get("user_error")), errors[0])
    others = sorted({e["rank"] for e in errors} - {first["rank"]})
    also = f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too)" if others else ""
    if first.get("user_error"):
        return f"rank {first['rank']}: {first['message']}{also}"
    return (f"rank {first['rank']}: internal error ({first['message']}){also}; this is a bug in smp: rerun with "
            "`smp --debug train ...` and report the traceback")


class TrainError(ValueError):
    """A training run that failed: the failing rank's own message (a user-facing error: exit 1, one line)."""


class TimeoutError_(ValueError):
    """A run that passed --timeout (a user-facing error: exit 1 with one line)."""
