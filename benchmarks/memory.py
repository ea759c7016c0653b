"""Measured memory per rank against the plan's predicted memory, for zoo models and every schedule.

Run:  .venv/bin/python benchmarks/memory.py [--write docs/benchmarks.md]

Each model is planned (analytic timing; the memory model does not depend on it), run for
two training steps with AdamW (foreach, torch's default on GPUs; its state is two tensors
per parameter, the plan's state factor of 4), one optimizer per rank, in one process,
every rank's stages through the same engine as on real ranks, and each rank's holdings
counted exactly by ``pipe.memory_stats``: parameters, gradients, optimizer state,
buffers, and the larger of the peak of stashed activations (every storage autograd saves
for the backward, and the inputs and outputs the engine keeps, each once) and the
optimizer step's workspace (every storage the step allocates, metered by
``runtime.memory.OptimizerStepMeter``). Predicted is the plan's ``rank_memory``: the
rank's stages' parameters, gradients, optimizer state and buffers, plus the larger of the
simulated peak of their activations (per microbatch: the bytes autograd saves for the
backward, from the profile, and the tensors the stage receives) and the step's workspace
(one copy of the rank's parameters).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._markdown import write_section  # noqa: E402
from runtime.memory import OptimizerStepMeter  # noqa: E402

CASES = [
    ("gpt:layers=4,d_model=128,heads=4,seq_len=64,vocab=512,batch=8", 2),
    ("bert:layers=4,d_model=128,heads=4,seq_len=64,vocab=512,batch=8", 2),
    ("t5:size=tiny,batch=8", 2),
    ("resnet:size=tiny,batch=8", 2),
    ("unet:size=tiny,batch=8", 3),
    ("mlp:layers=6,d_in=256,hidden=512,d_out=64,batch=32", 3),
]
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
MICROBATCHES = 4
SECTION = "## Memory: predicted against measured"


def measure(spec: str, stages: int, schedule: str) -> list[dict]:
    import smp
    from smp.models import build

    b = build(spec, seed=0)
    plan = smp.plan(b.model, b.example_args, b.example_kwargs, stages=stages, microbatches=MICROBATCHES,
                    schedule=schedule, timing="analytic")
    pipe = smp.partition(b.model, plan=plan, loss_fn=b.loss_fn)
    pipe.prepare(*b.example_args, **b.example_kwargs)
    ranks = range(plan.pipeline_ranks)
    # One optimizer per rank, as separate processes would have, each step metered.
    opts = [torch.optim.AdamW(pipe.parameters(rank=r), lr=1e-4, foreach=True) for r in ranks]
    meters = [OptimizerStepMeter(opt) for opt in opts]
    for _ in range(2):  # the second step runs with AdamW's state in place
        pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
        for opt in opts:
            opt.step()
    rows = []
    for r in ranks:
        stages_here = plan.schedule.stages_of(r)
        predicted = plan.rank_memory[r]
        predicted_act = plan.simulated.peak_activation_bytes_per_rank[r]
        predicted_ws = sum(plan.partition.stages[s].workspace for s in stages_here)
        got = pipe.memory_stats(opts[r], step_meter=meters[r])[r]
        rows.append({"model": spec, "schedule": schedule, "rank": r, "stages": stages_here,
                     "predicted": predicted, "measured": got["total"], "ratio": got["total"] / predicted,
                     "predicted_activations": predicted_act, "measured_activations": got["activations_peak"],
                     "activation_ratio": got["activations_peak"] / predicted_act if predicted_act else None,
                     "predicted_workspace": predicted_ws, "measured_workspace": got["optimizer_step_peak"]})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | schedule | rank | predicted | measured | measured / predicted | activations predicted | "
             "activations measured | ratio | step workspace predicted | measured | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        act = f"{r['activation_ratio']:.3f}" if r["activation_ratio"] is not None else "-"
        lines.append(f"| `{r['model']}` | {r['schedule']} | {r['rank']} | {r['predicted'] / 2**20:.2f} MiB | "
                     f"{r['measured'] / 2**20:.2f} MiB | {r['ratio']:.3f} | {r['predicted_activations'] / 2**20:.2f} MiB "
                     f"| {r['measured_activations'] / 2**20:.2f} MiB | {act} | {r['predicted_workspace'] / 2**20:.2f} MiB "
                     f"| {r['measured_workspace'] / 2**20:.2f} MiB | {r['measured_workspace'] / r['predicted_workspace']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/memory.py", description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="replace the memory section of this markdown file")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/memory.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row for spec, stages in CASES for schedule in SCHEDULES for row in measure(spec, stages, schedule)]
    worst = max(abs(r["ratio"] - 1) for r in rows)
    worst_act = max(abs(r["activation_ratio"] - 1) for r in rows if r["activation_ratio"] is not None)
    worst_ws = max(abs(r["measured_workspace"] / r["predicted_workspace"] - 1) for r in rows)
    text = table(rows)
    summary = (f"\nLargest error of the total: {worst:.1%}; of the activations alone: {worst_act:.1%}; "
               f"of the optimizer step's workspace: {worst_ws:.1%} "
               f"({len(rows)} ranks, {len(CASES)} models x {len(SCHEDULES)} schedules, {MICROBATCHES} microbatches).")
    print(text + "\n" + summary)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rows, indent=1) + "\n")
    if a.write:
        write_section(a.write, SECTION, f"`.venv/bin/python benchmarks/memory.py --write docs/benchmarks.md` (written "
                      f"by the script; raw rows in `benchmarks/results/memory.json`).\n"
                      f"{__doc__.split(chr(10), 2)[2].strip()}\n\n{text}\n{summary}")


if __name__ == "__main__":
    main()
