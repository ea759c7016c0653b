"""Two replicas of a two-rank pipeline (4 gloo ranks): the gradient all-reduce overlapped with the backward
against the all-reduce after it, measured side by side and predicted by the simulator.

Run:  .venv/bin/python benchmarks/data_parallel.py [--write docs/benchmarks.md]

For each schedule, both variants run the same plan (model, split, microbatches, "cluster"
placement) and differ only in when each stage's gradient buckets leave. Overlapped (smp's
default): each bucket as soon as the stage's final backward has made it final, and the
stage's all-reduce right after that backward. After: every all-reduce at the end of the
rank's program, once the backward is done (DeepSpeed's ReduceGrads after the schedule; a
data-parallel wrapper around a whole pipeline step). Under interleaved 1F1B a rank also
reduces its later chunk while computing its earlier one's backward. All variants alternate
in blocks of steps inside one launch, so the machine's noise falls on all. The simulator
prices them on the gloo link measured at the start of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))  # tests/_launch.py: the N-rank launcher, not shipped with the packages

from benchmarks._markdown import write_section  # noqa: E402

#: Weights large against the compute (34 M parameters, 16 samples per replica): the all-reduce matters, and
#: each stage has several 25 MiB buckets (one 16 MiB weight each), so most of its all-reduce can overlap.
SPEC = "mlp:layers=8,d_in=2048,hidden=2048,d_out=2048,batch=32"
STAGES, REPLICAS, MICROBATCHES = 2, 2, 4
SCHEDULES = ("1f1b", "interleaved")
BLOCK = 4  # steps of one variant in a row
SECTION = "## Data parallel x pipeline: the gradient all-reduce overlapped with the backward or after it"


def worker(rank: int, world: int, *, plans: dict[str, dict], steps: int, warmup: int, out: str) -> None:
    import torch.distributed as dist

    import smp
    from smp.models import build
    from smp.partition import partition

    torch.set_num_threads(1)
    b = build(SPEC, seed=0)
    pipes = {name: partition(build(SPEC, seed=0).model, plan=smp.Plan.from_dict(p), loss_fn=b.loss_fn, timeout=120)
             for name, p in plans.items()}
    opts = {name: torch.optim.SGD(pipe.parameters(), lr=1e-4) for name, pipe in pipes.items()}
    some = next(iter(pipes.values()))
    share = b.example_args[0].shape[0] // some.dp_size  # each replica trains on its shard of the global batch
    lo = some.dp_rank * share
    x, y = b.example_args[0][lo:lo + share], b.target[lo:lo + share]

    def step(name: str) -> None:
        pipes[name].step(x, target=y)
        opts[name].step()
        pipes[name].zero_grad()

    for _ in range(warmup):
        for name in pipes:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in pipes}
    while min(len(v) for v in times.values()) < steps:
        for name in pipes:
            for j in range(BLOCK + 1):  # the first step of a block warms the caches up
                dist.barrier()
                t0 = time.perf_counter()
                step(name)
                dist.barrier()
                if j:
                    times[name].append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/data_parallel.py", description=__doc__)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--img", default=str(ROOT / "docs/img/data-parallel-timeline.png"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/data_parallel.json"))
    ap.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    a = ap.parse_args(argv)

    import smp
    from partitioner import Cluster
    from partitioner.plan import simulate_partition
    from partitioner.schedule import with_allreduce
    from partitioner.timeline import render_timeline
    from _launch import launch
    from smp.calibrate import measure_link
    from smp.models import build

    torch.set_num_threads(1)  # profile as the ranks run: one thread each
    b = build(SPEC, seed=0)
    share = b.example_args[0][: b.example_args[0].shape[0] // REPLICAS]
    link = measure_link(quick=False, backend="gloo")
    gloo = Cluster.uniform(STAGES * REPLICAS, bandwidth=link["bandwidth"], latency=link["latency"],
                           name="local gloo (measured)")
    plans = {}
    for kind in SCHEDULES:
        early = smp.plan(b.model, (share,), stages=STAGES, microbatches=MICROBATCHES, schedule=kind,
                         timing="measured", repeats=5, cluster=gloo, data_parallel=REPLICAS, placement="cluster")
        late = with_allreduce(early.schedule, REPLICAS, overlap=False)
        plans[f"{kind}, overlapped"] = early
        plans[f"{kind}, after the backward"] = dataclasses.replace(
            early, schedule=late, simulated=simulate_partition(late, early.partition, early.dp_link, early.graph))
    raw = Path(a.json).with_suffix(".raw.json")
    raw.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = launch(f"{Path(__file__).resolve()}:worker", STAGES * REPLICAS,
                     {"plans": {k: p.to_dict() for k, p in plans.items()}, "steps": a.steps, "warmup": a.warmup,
                      "out": str(raw)}, timeout=1200, threads=1)
    for r in results:
        if r.returncode != 0:
            raise SystemExit(f"rank {r.rank} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    times = json.loads(raw.read_text())
    raw.unlink()
    med = {k: statistics.median(v) for k, v in times.items()}
    tls = []
    for name, p in plans.items():
        tl = p.timeline()
        tl.label = "predicted, " + name.replace(", ", ", all-reduce ")
        tls.append(tl)
    render_timeline(tls, a.img, title=f"{SPEC}: {REPLICAS} replicas x {STAGES} ranks, {MICROBATCHES} "
                                      "microbatches (predicted; AR = gradient all-reduce)")
    grad_bytes = [s.params for s in plans[f"{SCHEDULES[0]}, overlapped"].partition.stages]
    summary: dict[str, Any] = {
        "model": SPEC, "replicas": REPLICAS, "stages": STAGES, "microbatches": MICROBATCHES, "steps": a.steps,
        "gloo_link": {"latency_s": link["latency"], "bandwidth_Bps": link["bandwidth"]},
        "stage_gradient_bytes": grad_bytes,
        "measured_median_s": med, "predicted_s": {k: p.step_time for k, p in plans.items()},
        "measured_after_over_overlapped": {k: med[f"{k}, after the backward"] / med[f"{k}, overlapped"]
                                           for k in SCHEDULES},
        "predicted_after_over_overlapped": {k: plans[f"{k}, after the backward"].step_time
                                            / plans[f"{k}, overlapped"].step_time for k in SCHEDULES},
        "seconds": time.perf_counter() - started,
    }
    Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")
    lines = [
        "`.venv/bin/python benchmarks/data_parallel.py --write docs/benchmarks.md` (written by the script; raw "
        "results in `benchmarks/results/data_parallel.json`).",
        __doc__.split(chr(10), 2)[2].strip(),
        "",
        f"`{SPEC}`, {REPLICAS} replicas x {STAGES} stages on 4 gloo ranks (1 thread each, this 2-core machine), "
        f"{MICROBATCHES} microbatches per replica, the global batch split between the replicas; gloo link "
        f"measured at {link['latency'] * 1e6:.0f} us latency, {link['bandwidth'] / 1e9:.2f} GB/s; gradients per "
        f"stage {', '.join(f'{g / 2**20:.1f} MiB' for g in grad_bytes)}. Median of {a.steps} steps each, "
        f"alternating in blocks of {BLOCK}.",
        "",
        "| schedule, all-reduce | measured median step | predicted step | measured / predicted |",
        "|---|---|---|---|",
    ]
    for name, p in plans.items():
        lines.append(f"| {name} | {med[name] * 1e3:.1f} ms | {p.step_time * 1e3:.1f} ms | "
                     f"{med[name] / p.step_time:.2f} |")
    lines += [""] + [
        f"{k}: after the backward / overlapped, measured **{summary['measured_after_over_overlapped'][k]:.3f}**, "
        f"predicted **{summary['predicted_after_over_overlapped'][k]:.3f}**." for k in SCHEDULES] + [
        "",
        "Four ranks (and gloo's transport threads, which run the overlapped all-reduces) share this machine's two "
        "cores, and the profile is of one process alone: the measured/predicted ratios describe this machine more "
        "than the model; compare the variants of one schedule, run side by side. Timelines (predicted): "
        f"![data parallel timeline]({Path(a.img).relative_to(ROOT / 'docs') if Path(a.img).is_relative_to(ROOT / 'docs') else a.img})",
    ]
    text = "\n".join(lines)
    print(text)
    if a.write is not None:
        write_section(a.write, SECTION, text)
        print(f"wrote {a.write}")


if __name__ == "__main__":
    main()
