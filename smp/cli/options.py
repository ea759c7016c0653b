"""The options the commands share: choices, annotated types, and the checks that make bad values usage errors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from partitioner.checks import whole
from partitioner.recompute import MODES as RECOMPUTE_MODES
from partitioner.request import default_microbatches
from partitioner.sharding import SHARDING_MODES
from smp.cli.errors import CLIUsageError

__all__ = [
    "SCHEDULE_CHOICES", "METHOD_CHOICES", "RECOMPUTE_CHOICES", "SHARDING_CHOICES", "TIMING_CHOICES", "DEVICE_CHOICES",
    "ModelArg", "StagesOpt", "MicrobatchesOpt", "ScheduleOpt", "ClusterOpt", "MemoryOpt", "MethodOpt", "TimeLimitOpt",
    "StepBatchOpt", "SeqOpt", "DeviceOpt", "TimingOpt", "MetaOpt", "DtypeOpt", "RepeatsOpt", "JsonOpt", "TimelineOpt",
    "choice", "positive", "flag_name", "timing_for", "check_cluster", "microbatches_for", "plan_args",
]


SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved", "zb-h1")  # ScheduleKind's values (the CLI starts without torch)
METHOD_CHOICES = ("auto", "dp", "cpsat", "uniform", "params", "blocks")
RECOMPUTE_CHOICES = RECOMPUTE_MODES
SHARDING_CHOICES = ("auto", *SHARDING_MODES)
TIMING_CHOICES = ("measured", "analytic")
DEVICE_CHOICES = ("cpu", "cuda")


ModelArg = Annotated[str, typer.Argument(
    metavar="MODEL", help="zoo spec (gpt:layers=8, gpt-1b, resnet:depth=18) or path/to/file.py:factory; "
                          "`smp models` lists the zoo")]
StagesOpt = Annotated[int, typer.Option("--stages", "-p", help="pipeline ranks (devices)")]
MicrobatchesOpt = Annotated[Optional[int], typer.Option(
    "--microbatches", "-m", help="microbatches per step \\[default: 2 x stages (1 on one stage); with "
                                 "--batch-size, the largest divisor of the batch not above that]")]
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
    "--dtype", help="analytic timing: price a run in this precision: fp32, or bf16/fp16 mixed precision "
    "(the ops walked under torch.autocast: its activations, cut tensors and op times)")]
RepeatsOpt = Annotated[int, typer.Option("--repeats", help="measured timing: timed runs per op (median)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print machine-readable JSON on stdout, nothing else")]
TimelineOpt = Annotated[Optional[Path], typer.Option(
    "--timeline", help="write the schedule timeline picture (.png or .svg)")]


def choice(value: str | None, choices: tuple[str, ...], option: str) -> str | None:
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


def _size(value: str | None, option: str) -> int | None:
    from smp.units import parse_size

    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as err:
        raise CLIUsageError(f"{option}: {err}") from None


def positive(value: int | None, option: str) -> None:
    """Refuse a count below 1 as bad usage: the planning options' rule (:func:`partitioner.checks.whole`), for the
    flags no planning request checks first (a request's own are named as flags by :func:`flag_name`)."""
    whole(value, option, optional=True, error=CLIUsageError)


def flag_name(option: str) -> str:
    """The flag of a planning request's field (``time_limit`` -> ``--time-limit``)."""
    return "--" + option.replace("_", "-")


def timing_for(timing: str | None, meta: bool, cluster: str | None) -> tuple[str, str | None]:
    """(timing, device profile used to price analytic timing)."""
    timing = choice(timing, TIMING_CHOICES, "--timing")
    timing = timing or ("analytic" if meta else "measured")
    profile_name = (cluster or ("h100-sxm" if meta else "cpu")) if timing == "analytic" else None
    return timing, profile_name


def check_cluster(cluster: str | None) -> None:
    if cluster is None:
        return
    from partitioner.devices import load_profile
    from partitioner.errors import ProfileError

    try:
        load_profile(cluster)
    except ProfileError as err:
        raise CLIUsageError(str(err)) from None


def microbatches_for(stages: int, microbatches: int | None, batch_size: int | None) -> tuple[int, str | None]:
    """The microbatch count, and a note for the output when it was chosen for the user.

    The planning request's one rule (:func:`partitioner.request.default_microbatches`): without
    --batch-size a microbatch is the spec's sample batch and any count works (2 x stages);
    with --batch-size B the count must divide B: the largest divisor of B not above 2 x stages.
    One stage: 1.
    """
    positive(batch_size, "--batch-size")
    positive(microbatches, "--microbatches")  # before it divides the batch
    if microbatches is not None:
        if batch_size is not None and batch_size % microbatches:
            raise CLIUsageError(f"--batch-size {batch_size} does not split into --microbatches {microbatches}: "
                                f"use a batch that is a multiple of {microbatches}, or a count that divides "
                                f"{batch_size}")
        return microbatches, None
    m = default_microbatches(stages, batch_size)
    if batch_size is None or stages <= 1:
        return m, None
    return m, (f"--microbatches defaults to {m}: the largest divisor of the batch ({batch_size}) "
               f"not above 2 x {stages} stages")


def plan_args(stages: int, microbatches: int | None, batch_size: int | None, schedule: str, method: str,
              memory_limit: str | None) -> tuple[int, str | None, str, str, int | None]:
    """(microbatches, a note on how they were chosen, schedule, method, memory limit) from the options; their
    bounds are the planning request's to check (smp/cli/plan.py names its errors as flags)."""
    m, note = microbatches_for(stages, microbatches, batch_size)
    return (m, note, choice(schedule, SCHEDULE_CHOICES, "--schedule"), choice(method, METHOD_CHOICES, "--method"),
            _size(memory_limit, "--memory-limit"))
