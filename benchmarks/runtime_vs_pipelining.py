"""smp's runtime against torch.distributed.pipelining (same model, split, schedule; 2 gloo ranks), and against its own prediction.

Run:  .venv/bin/python benchmarks/runtime_vs_pipelining.py [--write docs/benchmarks.md]

Writes benchmarks/results/runtime_vs_pipelining.json and docs/img/runtime-timeline.png; ``--write``
replaces its section of a markdown file.
"""

from __future__ import annotations

import argparse
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

SECTION = "## Runtime: smp against torch.distributed.pipelining, and against its own prediction"
SPEC = "mlp:layers=8,d_in=768,hidden=768,d_out=768,batch=128"
MICROBATCHES = 4
BLOCK = 5  # steps of one framework in a row


def _pipelining_stage_modules(model: torch.nn.Module, plan: Any, rank: int) -> torch.nn.Module:
    """The same split as the plan, as plain Sequentials (pipelining needs a chain with one tensor between stages)."""
    body = list(model.body)
    first_on_1 = min(i for i in range(len(body)) if plan.fx_stage_of.get(f"body_{i}", 0) == 1) \
        if any(plan.fx_stage_of.get(f"body_{i}", 0) == 1 for i in range(len(body))) else len(body)
    if rank == 0:
        return torch.nn.Sequential(*body[:first_on_1])
    return torch.nn.Sequential(*body[first_on_1:], model.out)


def worker(rank: int, world: int, *, plan: dict, steps: int, warmup: int, out: str, schedule: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import smp
    from smp.models import build
    from smp.partition import partition

    torch.set_num_threads(1)
    p = smp.Plan.from_dict(plan)
    b = build(SPEC, seed=0)
    pipe = partition(b.model, plan=p, loss_fn=b.loss_fn, timeout=120)
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-4)

    ref = build(SPEC, seed=0)
    sub = _pipelining_stage_modules(ref.model, p, rank)
    stage = PipelineStage(sub, rank, world, torch.device("cpu"))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = cls(stage, MICROBATCHES, loss_fn=ref.loss_fn)
    opt2 = torch.optim.SGD(sub.parameters(), lr=1e-4)
    x, y = b.example_args[0], b.target

    def smp_step() -> None:
        pipe.step(x, target=y)
        opt.step()
        pipe.zero_grad()

    def pp_step() -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt2.step()
        opt2.zero_grad()

    # Side by side, in alternating blocks: alternating every step would make each framework
    # start from caches the other one filled (the two copies of the weights do not fit in
    # L3 together), which is not how either trains. The first step of a block warms up.
    times: dict[str, list[float]] = {"smp": [], "pipelining": []}
    for _ in range(warmup):
        smp_step()
        pp_step()
    while len(times["smp"]) < steps:
        for name, fn in (("smp", smp_step), ("pipelining", pp_step)):
            for j in range(BLOCK + 1):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                if j:
                    times[name].append(time.perf_counter() - t0)
    # one more smp step for the measured timeline, gathered from both ranks
    dist.barrier()
    smp_step()
    tl = pipe.timeline(gather=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "timeline": tl.to_dict()}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/runtime_vs_pipelining.py", description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--img", default=str(ROOT / "docs/img/runtime-timeline.png"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/runtime_vs_pipelining.json"))
    ap.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    a = ap.parse_args(argv)

    import smp
    from partitioner.timeline import Timeline, render_timeline
    from _launch import launch
    from smp.models import build

    from partitioner import Cluster
    from smp.calibrate import measure_link

    torch.set_num_threads(1)  # profile as the ranks run: one thread each
    b = build(SPEC, seed=0)
    # The gloo link between two local processes, measured now: the simulator prices every
    # SEND/RECV of the plan's lists on it (the plan without a cluster treats links as free).
    link = measure_link(quick=False, backend="gloo")
    gloo = Cluster.uniform(2, bandwidth=link["bandwidth"], latency=link["latency"], name="local gloo (measured)")
    plan = smp.plan(b.model, b.example_args, stages=2, microbatches=MICROBATCHES, schedule=a.schedule,
                    timing="measured", repeats=5, cluster=gloo)
    free_links = plan.resimulate(cluster=Cluster.free(2))
    out = Path(a.json).with_suffix(".raw.json")
    results = launch(f"{Path(__file__).resolve()}:worker", 2,
                     {"plan": plan.to_dict(), "steps": a.steps, "warmup": a.warmup, "out": str(out),
                      "schedule": a.schedule}, timeout=600, threads=1)
    for r in results:
        if r.returncode != 0:
            raise SystemExit(f"rank {r.rank} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    data = json.loads(out.read_text())
    out.unlink()
    med = {k: statistics.median(v) for k, v in data["times"].items()}
    measured = Timeline.from_dict(data["timeline"]).normalized()
    measured.label = "measured (smp, 2 gloo ranks)"
    predicted = plan.timeline()
    predicted.label = "predicted (simulator)"
    render_timeline([predicted, measured], a.img,
                    title=f"{SPEC}, {a.schedule}, {MICROBATCHES} microbatches: predicted vs measured")
    replay = replay_step_time(plan, measured)
    summary = {
        "model": SPEC, "schedule": a.schedule, "microbatches": MICROBATCHES, "steps": a.steps,
        "replay_step_s": replay, "timeline_step_s": measured.step_time,
        "replay_error": (replay - measured.step_time) / measured.step_time,
        "smp_median_s": med["smp"], "pipelining_median_s": med["pipelining"],
        "ratio_smp_over_pipelining": med["smp"] / med["pipelining"],
        "predicted_step_s": plan.step_time, "measured_step_s": med["smp"],
        "prediction_error": (plan.step_time - med["smp"]) / med["smp"],
        "predicted_free_links_s": free_links.step_time,
        "prediction_error_free_links": (free_links.step_time - med["smp"]) / med["smp"],
        "gloo_link": {"latency_s": link["latency"], "bandwidth_Bps": link["bandwidth"]},
        "measured_over_predicted": med["smp"] / plan.step_time,
        "measured_over_predicted_free_links": med["smp"] / free_links.step_time,
        "split": {s: sorted(n for n, st in plan.fx_stage_of.items() if st == s)[:3] for s in range(2)},
    }
    Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")
    text = section(summary)
    print(f"{SECTION}\n\n{text}")
    if a.write:
        write_section(a.write, SECTION, text)


def section(summary: dict[str, Any]) -> str:
    """The markdown section, from the run's summary (benchmarks/results/runtime_vs_pipelining.json)."""
    link = summary["gloo_link"]
    return "\n".join([
        "`.venv/bin/python benchmarks/runtime_vs_pipelining.py --write docs/benchmarks.md` (written by the script; "
        "raw figures in `benchmarks/results/runtime_vs_pipelining.json`, the timelines in "
        "`docs/img/runtime-timeline.png`). 2 gloo ranks on this machine, one thread each; the split of smp's plan "
        "(a chain, so torch.distributed.pipelining can run it too: manual `PipelineStage`s of the same layers, "
        f"`Schedule1F1B` or `ScheduleGPipe`). Both run in the same processes, in alternating blocks of {BLOCK} steps "
        f"(the first of each block discarded), a barrier around each step; median of {summary['steps']} steps each. "
        "Predicted = the Plan's simulated step time, from a profile measured on this machine with one thread, "
        f"with free links and with every SEND/RECV priced on the gloo link measured at the start "
        f"({link['latency_s'] * 1e6:.1f} us latency, {link['bandwidth_Bps'] / 1e9:.2f} GB/s).",
        "",
        "| model | schedule | microbatches | smp median step | pipelining median step | smp / pipelining | "
        "predicted, free links | measured / predicted | predicted, SEND/RECV priced | measured / predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| `{summary['model']}` | {summary['schedule']} | {summary['microbatches']} | "
        f"{summary['smp_median_s'] * 1e3:.1f} ms | {summary['pipelining_median_s'] * 1e3:.1f} ms | "
        f"{summary['ratio_smp_over_pipelining']:.3f} | {summary['predicted_free_links_s'] * 1e3:.1f} ms | "
        f"{summary['measured_over_predicted_free_links']:.2f} | {summary['predicted_step_s'] * 1e3:.1f} ms | "
        f"{summary['measured_over_predicted']:.2f} |",
        "",
        "Simulator replay of the measured step (the simulator fed the runtime's own median F and B duration per "
        f"stage, from the measured timeline): {summary['replay_step_s'] * 1e3:.1f} ms against "
        f"{summary['timeline_step_s'] * 1e3:.1f} ms for that step ({summary['replay_error']:+.1%}).",
        "",
        "![predicted vs measured](img/runtime-timeline.png)",
    ])

def replay_step_time(plan: Any, measured: Any) -> float:
    """The simulator's step time when fed the runtime's measured median F and B duration per stage.

    Separates the two sources of prediction error: the schedule model (how actions overlap
    and wait), checked here, and the op costs from the profile, which this replaces.
    """
    from partitioner.simulate import StageCosts, simulate

    durations: dict[tuple[int, str], list[float]] = {}
    for e in measured.events:
        durations.setdefault((e.stage, e.kind), []).append(e.end - e.start)
    stages = range(plan.num_stages)
    med = {k: statistics.median(v) for k, v in durations.items()}
    bwd = [med.get((s, "B"), 0.0) + med.get((s, "W"), 0.0) for s in stages]
    costs = StageCosts(fwd=[med.get((s, "F"), 0.0) for s in stages], bwd=bwd,
                       bwd_w=[med.get((s, "W"), 0.0) for s in stages],
                       comm={(t.src_stage, t.dst_stage, t.node): t.seconds for t in plan.partition.transfers})
    return simulate(plan.schedule, costs, timeline=False).step_time


if __name__ == "__main__":
    main()
