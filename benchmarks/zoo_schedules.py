"""Every schedule on real plans of the zoo GPT (4 and 8 stages), and where the step-time objective pays.

    .venv/bin/python benchmarks/zoo_schedules.py [--model gpt:size=base] [--profile h100-sxm]

Models are built on the meta device and priced analytically (bf16) on a device profile, so
the figures are those of the profiled GPU cluster and are the same on any machine.
Prints the markdown tables of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import smp
from smp.models import build

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1"]


def textbook_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """(p-1)/(m+p-1); /v-ish for interleaved; a third of 1F1B's bubble time for ZB-H1 (F = B = W)."""
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def schedule_table(spec: str, profile: str, microbatches: int) -> None:
    print(f"model `{spec}` on the meta device, analytic bf16 timing on `{profile}`, {microbatches} microbatches\n")
    print("| p | schedule | stages | step ms | (m+p−1)·bottleneck ms | bubble | textbook bubble | "
          "peak activations GiB (worst rank) | plan s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    bundle = build(spec, meta=True, batch_size=microbatches * build(spec, meta=True).example_args[0].shape[0])
    for p in (4, 8):
        for schedule in SCHEDULES:
            start = time.perf_counter()
            plan = smp.plan(bundle.model, bundle.example_args, bundle.example_kwargs, stages=p,
                            microbatches=microbatches, schedule=schedule, cluster=profile, device_profile=profile,
                            dtype="bf16", time_limit=10, name=spec)
            seconds = time.perf_counter() - start
            v = plan.virtual_stages
            textbook_step = (microbatches + p - 1) * plan.partition.bottleneck
            peak = max(plan.simulated.get("peak_activation_bytes_per_rank") or [0.0]) / 2**30
            print(f"| {p} | {schedule} | {plan.num_stages} | {plan.step_time * 1e3:.1f} | {textbook_step * 1e3:.1f} | "
                  f"{plan.bubble:.3f} | {textbook_bubble(schedule, p, microbatches, v):.3f} | {peak:.2f} | "
                  f"{seconds:.1f} |", flush=True)


def objective_table(profile: str, microbatches: int) -> None:
    print(f"\nbottleneck objective vs step-time objective (refined by simulation), `{profile}` links, "
          f"{microbatches} microbatches\n")
    print("| model | p | schedule | step ms (bottleneck) | step ms (step_time) | gain | "
          "bottleneck ms (bottleneck) | bottleneck ms (step_time) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for spec in ("gpt:size=base", "t5:size=small", "unet:size=small"):
        base = build(spec, meta=True)
        bundle = build(spec, meta=True, batch_size=microbatches * base.example_args[0].shape[0])
        for p in (4, 8):
            for schedule in ("1f1b", "zb-h1"):
                plans = [smp.plan(bundle.model, bundle.example_args, bundle.example_kwargs, stages=p,
                                  microbatches=microbatches, schedule=schedule, cluster=profile,
                                  device_profile=profile, dtype="bf16", time_limit=10, objective=objective)
                         for objective in ("bottleneck", "step_time")]
                a, b = plans
                print(f"| `{spec}` | {p} | {schedule} | {a.step_time * 1e3:.2f} | {b.step_time * 1e3:.2f} | "
                      f"{1 - b.step_time / a.step_time:.1%} | {a.partition.bottleneck * 1e3:.2f} | "
                      f"{b.partition.bottleneck * 1e3:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt:size=base")
    parser.add_argument("--profile", default="h100-sxm")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--objective-profile", default="h100-pcie")
    opts = parser.parse_args()
    schedule_table(opts.model, opts.profile, opts.microbatches)
    objective_table(opts.objective_profile, opts.microbatches)


if __name__ == "__main__":
    main()
