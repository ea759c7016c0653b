"""Sharded data parallelism on 4 gloo ranks (2 replicas x 2 stages): each rank's memory measured against the plan,
per mode, and the reduce-scatter issued as the schedule IR says against after the whole backward.

Run:  .venv/bin/python benchmarks/sharding_memory.py [--write docs/benchmarks.md]

Memory: a small GPT (parameters and AdamW state dominate its activations) is planned
under each mode with 2 replicas (analytic timing: the memory model does not depend on it)
and trained for two AdamW steps (foreach) on its replica's half of the batch. Each rank's
holdings are counted by ``pipe.memory_stats``: its shards of the parameters, gradients
and optimizer state; what it held whole while computing (the all-gathered parameters and
the unsharded gradients before the reduce-scatter, sampled after each forward's gather, at
each backward's first gradient and before each reduce-scatter); plain data parallelism's all-reduce buckets; the stashed
activations' peak; the optimizer step's workspace. Predicted: the plan's
``memory_split`` of the rank's stage (parameters: shard + gathered copy; gradients: shard
+ whole gradients, or buckets; optimizer state; activations) and ``rank_memory``.
full_shard runs under 1F1B here (the planner weighs it only with interleaved stages; an
explicit ``sharding=`` plans and runs it anyway), so its gathered copy is one stage's.

Overlap: a wider MLP under interleaved 1F1B (two stages per rank, so a stage's
reduce-scatter can overlap the rank's other stage's cool-down), each sharded mode's step
with the REDUCE_SCATTER right after the stage's last backward (the IR's default) against
the same collectives at the end of the rank's program (``with_allreduce(overlap=False)``),
the variants alternating in blocks of steps in one launch (as benchmarks/data_parallel.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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

#: 3.3 M parameters (13 MiB fp32, 53 MiB with gradients and AdamW state) against ~1 MiB of activations per rank.
MEMORY_SPEC = "gpt:layers=4,d_model=256,heads=4,seq_len=32,vocab=2048,batch=8"
MODES = ("none", "shard_grad_op", "full_shard")
#: benchmarks/data_parallel.py's model: weights large against the compute, so the collectives matter.
OVERLAP_SPEC = "mlp:layers=8,d_in=2048,hidden=2048,d_out=2048,batch=32"
OVERLAP_MODES = ("shard_grad_op", "full_shard")
STAGES, REPLICAS, MICROBATCHES = 2, 2, 4
BLOCK = 4  # steps of one variant in a row
SECTION = "## Sharded data parallelism: memory per rank against the plan, and the reduce-scatter's overlap"


def measure_memory(rank: int, plan_dict: dict, out: dict) -> None:
    import smp
    from runtime.memory import OptimizerStepMeter
    from smp.models import build
    from smp.partition import partition

    b = build(MEMORY_SPEC, seed=0)
    pipe = partition(b.model, plan=smp.Plan.from_dict(plan_dict), loss_fn=b.loss_fn, timeout=120)
    share = b.example_args[0].shape[0] // pipe.dp_size
    rows = slice(pipe.dp_rank * share, (pipe.dp_rank + 1) * share)
    x, y = b.example_args[0][rows], b.target[rows]
    pipe.prepare(x)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4, foreach=True)
    meter = OptimizerStepMeter(opt)
    for _ in range(2):  # the second step runs with AdamW's state in place
        opt.zero_grad(set_to_none=True)
        pipe.step(x, target=y)
        opt.step()
    out.update(rank=rank, pp_rank=pipe.pp_rank, dp_rank=pipe.dp_rank,
               measured=pipe.memory_stats(opt, step_meter=meter)[pipe.pp_rank])
    meter.close()
    del pipe, opt
    gc.collect()


def worker(rank: int, world: int, *, memory_plans: dict[str, dict], overlap_plans: dict[str, dict], steps: int,
           warmup: int, out: str) -> None:
    import torch.distributed as dist

    import smp
    from smp.models import build
    from smp.partition import partition

    torch.set_num_threads(1)
    result: dict[str, Any] = {"memory": {}}
    for mode, p in memory_plans.items():
        result["memory"][mode] = {}
        measure_memory(rank, p, result["memory"][mode])
    b = build(OVERLAP_SPEC, seed=0)
    pipes = {name: partition(build(OVERLAP_SPEC, seed=0).model, plan=smp.Plan.from_dict(p), loss_fn=b.loss_fn,
                             timeout=120) for name, p in overlap_plans.items()}
    opts = {name: torch.optim.SGD(pipe.parameters(), lr=1e-4) for name, pipe in pipes.items()}
    some = next(iter(pipes.values()))
    share = b.example_args[0].shape[0] // some.dp_size
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
    result["times"] = times
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def predicted(plan: Any, pp_rank: int) -> dict[str, float]:
    """The plan's figures for a rank holding one stage: its memory_split and rank_memory."""
    (stage,) = plan.schedule.stages_of(pp_rank)
    split = plan.memory_split()[stage]
    return {**{k: split[k] for k in ("parameters", "gradients", "optimizer", "activations")},
            "total": plan.rank_memory[pp_rank]}


def measured_split(m: dict[str, int]) -> dict[str, float]:
    """memory_stats' figures grouped as the plan's memory_split groups them."""
    return {"parameters": m["params"] + m.get("gathered_peak", 0),
            "gradients": m["grads"] + m.get("whole_grads_peak", 0) + m.get("buckets", 0),
            "optimizer": m["optimizer"], "activations": m["activations_peak"], "total": m["total"]}


PARTS = ("parameters", "gradients", "optimizer", "activations", "total")


def memory_table(rows: list[dict]) -> str:
    head = "| mode | rank (stage) | " + " | ".join(f"{p} predicted / measured (ratio)" for p in PARTS) + " |"
    lines = [head, "|---|---|" + "---|" * len(PARTS)]
    for r in rows:
        cells = []
        for part in PARTS:
            pr, me = r["predicted"][part], r["measured_split"][part]
            ratio = f"{me / pr:.3f}" if pr else "-"
            cells.append(f"{pr / 2**20:.2f} / {me / 2**20:.2f} MiB ({ratio})")
        lines.append(f"| {r['mode']} | {r['rank']} ({r['pp_rank']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/sharding_memory.py", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/sharding_memory.json")
    ap.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    a = ap.parse_args(argv)

    import tempfile

    import smp
    from partitioner import Cluster
    from partitioner.plan import simulate_partition
    from partitioner.schedule import with_allreduce
    from _launch import launch
    from smp.calibrate import measure_link
    from smp.models import build

    torch.set_num_threads(1)
    started = time.perf_counter()
    link = measure_link(quick=False, backend="gloo")
    gloo = Cluster.uniform(STAGES * REPLICAS, bandwidth=link["bandwidth"], latency=link["latency"],
                           name="local gloo (measured)")
    mb = build(MEMORY_SPEC, seed=0)
    memory_plans = {mode: smp.plan(mb.model, (mb.example_args[0][: mb.example_args[0].shape[0] // REPLICAS],),
                                   stages=STAGES, microbatches=MICROBATCHES, schedule="1f1b", timing="analytic",
                                   cluster=gloo, data_parallel=REPLICAS, placement="cluster", sharding=mode,
                                   recompute="none")
                    for mode in MODES}
    ob = build(OVERLAP_SPEC, seed=0)
    oshare = ob.example_args[0][: ob.example_args[0].shape[0] // REPLICAS]
    overlap_plans = {}
    for mode in OVERLAP_MODES:
        early = smp.plan(ob.model, (oshare,), stages=STAGES, microbatches=MICROBATCHES, schedule="interleaved",
                         timing="measured", repeats=3, cluster=gloo, data_parallel=REPLICAS, placement="cluster",
                         sharding=mode, recompute="none")
        late = with_allreduce(early.schedule, REPLICAS, overlap=False, sharding=mode)
        overlap_plans[f"{mode}, as the IR says"] = early
        overlap_plans[f"{mode}, after the backward"] = dataclasses.replace(
            early, schedule=late, simulated=simulate_partition(late, early.partition, early.dp_link, early.graph))
    with tempfile.TemporaryDirectory(prefix="sharding-memory-") as tmp:
        results = launch(f"{Path(__file__).resolve()}:worker", STAGES * REPLICAS,
                         {"memory_plans": {k: p.to_dict() for k, p in memory_plans.items()},
                          "overlap_plans": {k: p.to_dict() for k, p in overlap_plans.items()},
                          "steps": a.steps, "warmup": a.warmup, "out": tmp}, timeout=1200, threads=1)
        for r in results:
            if r.returncode != 0:
                raise SystemExit(f"rank {r.rank} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(STAGES * REPLICAS)]

    rows = []
    for mode in MODES:
        for res in per_rank:
            got = res["memory"][mode]
            rows.append({"mode": mode, "rank": got["rank"], "pp_rank": got["pp_rank"], "dp_rank": got["dp_rank"],
                         "predicted": predicted(memory_plans[mode], got["pp_rank"]), "measured": got["measured"],
                         "measured_split": measured_split(got["measured"])})
    for r in rows:
        r["ratio"] = {p: (r["measured_split"][p] / r["predicted"][p] if r["predicted"][p] else None) for p in PARTS}
    worst = {p: max(abs(r["ratio"][p] - 1) for r in rows if r["ratio"][p] is not None) for p in PARTS}
    optimizer_fraction = {r["rank"]: r["measured"]["optimizer"] / next(
        o["measured"]["optimizer"] for o in rows if o["mode"] == "none" and o["rank"] == r["rank"])
        for r in rows if r["mode"] == "shard_grad_op"}
    times = per_rank[0]["times"]  # every rank timed the same barriered steps
    med = {k: statistics.median(v) for k, v in times.items()}
    after_over = {m: med[f"{m}, after the backward"] / med[f"{m}, as the IR says"] for m in OVERLAP_MODES}
    predicted_after_over = {m: overlap_plans[f"{m}, after the backward"].step_time
                            / overlap_plans[f"{m}, as the IR says"].step_time for m in OVERLAP_MODES}
    summary = {
        "memory_model": MEMORY_SPEC, "overlap_model": OVERLAP_SPEC, "replicas": REPLICAS, "stages": STAGES,
        "microbatches": MICROBATCHES, "gloo_link": {"latency_s": link["latency"], "bandwidth_Bps": link["bandwidth"]},
        "memory": rows, "worst_relative_error": worst, "shard_grad_op_optimizer_over_none": optimizer_fraction,
        "overlap": {"steps": a.steps, "measured_median_s": med,
                    "predicted_s": {k: p.step_time for k, p in overlap_plans.items()},
                    "measured_after_over_ir": after_over, "predicted_after_over_ir": predicted_after_over},
        "seconds": time.perf_counter() - started,
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(summary, indent=1) + "\n")

    lines = [
        "`.venv/bin/python benchmarks/sharding_memory.py --write docs/benchmarks.md` (written by the script; raw "
        "results in `benchmarks/results/sharding_memory.json`).",
        __doc__.split(chr(10), 2)[2].strip(),
        "",
        f"Memory: `{MEMORY_SPEC}`, {REPLICAS} replicas x {STAGES} stages, 1F1B, {MICROBATCHES} microbatches, fp32, "
        "AdamW (foreach), no recomputation. Bytes per rank, predicted / measured (measured / predicted):",
        "",
        memory_table(rows),
        "",
        "Largest error: " + ", ".join(f"{p} {worst[p]:.1%}" for p in PARTS) + ". Optimizer state per rank under "
        "shard_grad_op over none's: " + ", ".join(f"rank {k} {v:.3f}" for k, v in sorted(optimizer_fraction.items()))
        + f" (1/D = {1 / REPLICAS:.3f}).",
        "",
        f"Overlap: `{OVERLAP_SPEC}`, {REPLICAS} replicas x {STAGES} ranks x 2 interleaved stages, {MICROBATCHES} "
        f"microbatches; gloo link measured at {link['latency'] * 1e6:.0f} us, {link['bandwidth'] / 1e9:.2f} GB/s. "
        f"Median of {a.steps} steps each, alternating in blocks of {BLOCK}.",
        "",
        "| mode, reduce-scatter | measured median step | predicted step |",
        "|---|---|---|",
    ]
    for name, p in overlap_plans.items():
        lines.append(f"| {name} | {med[name] * 1e3:.1f} ms | {p.step_time * 1e3:.1f} ms |")
    lines += [""] + [f"{m}: after the backward / as the IR says, measured **{after_over[m]:.3f}**, predicted "
                     f"**{predicted_after_over[m]:.3f}**." for m in OVERLAP_MODES]
    text = "\n".join(lines)
    print(text)
    print(f"({summary['seconds']:.0f} s)")
    if a.write is not None:
        write_section(a.write, SECTION, text)
        print(f"wrote {a.write}")


if __name__ == "__main__":
    main()
