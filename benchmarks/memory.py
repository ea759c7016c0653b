"""Measured memory per rank against the plan's predicted memory, for zoo models and every schedule.

Run:  .venv/bin/python benchmarks/memory.py [--write docs/benchmarks.md]

Each model is planned (analytic timing; the memory model does not depend on it), run for
two training steps with Adam (whose state is two tensors per parameter, the plan's
state factor of 4) in one process, every rank's stages through the same engine as on
real ranks, and each rank's holdings counted exactly by ``pipe.memory_stats``:
parameters, gradients, optimizer state, buffers and the peak of stashed activations
(every storage autograd saves for the backward, and the inputs and outputs the engine
keeps, each once). Predicted is the plan's ``rank_memory``: the rank's stages' parameters,
gradients, optimizer state and buffers, plus the simulated peak of their activations
(per microbatch: the bytes autograd saves for the backward, from the profile, and the
tensors the stage receives).
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
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-4)
    for _ in range(2):  # the second step runs with Adam's state in place
        pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
        opt.step()
    stats = pipe.memory_stats(opt)
    rows = []
    for r in range(plan.pipeline_ranks):
        stages_here = plan.schedule.stages_of(r)
        predicted = plan.rank_memory[r]
        predicted_act = plan.simulated.peak_activation_bytes_per_rank[r]
        got = stats[r]
        measured = got["params"] + got["grads"] + got["optimizer"] + got["buffers"] + got["activations_peak"]
        rows.append({"model": spec, "schedule": schedule, "rank": r, "stages": stages_here,
                     "predicted": predicted, "measured": measured, "ratio": measured / predicted,
                     "predicted_activations": predicted_act, "measured_activations": got["activations_peak"],
                     "activation_ratio": got["activations_peak"] / predicted_act if predicted_act else None})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | schedule | rank | predicted | measured | measured / predicted | activations predicted | "
             "activations measured | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        act = f"{r['activation_ratio']:.3f}" if r["activation_ratio"] is not None else "-"
        lines.append(f"| `{r['model']}` | {r['schedule']} | {r['rank']} | {r['predicted'] / 2**20:.2f} MiB | "
                     f"{r['measured'] / 2**20:.2f} MiB | {r['ratio']:.3f} | {r['predicted_activations'] / 2**20:.2f} MiB "
                     f"| {r['measured_activations'] / 2**20:.2f} MiB | {act} |")
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
    text = table(rows)
    summary = (f"\nLargest error of the total: {worst:.1%}; of the activations alone: {worst_act:.1%} "
               f"({len(rows)} ranks, {len(CASES)} models x {len(SCHEDULES)} schedules, {MICROBATCHES} microbatches).")
    print(text + "\n" + summary)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rows, indent=1) + "\n")
    if a.write:
        body = (f"{SECTION}\n\n`.venv/bin/python benchmarks/memory.py --write docs/benchmarks.md` (written by the "
                f"script; raw rows in `benchmarks/results/memory.json`).\n{__doc__.split(chr(10), 2)[2].strip()}\n\n"
                f"{text}\n{summary}\n")
        doc = a.write.read_text()
        if SECTION in doc:
            start = doc.index(SECTION)
            end = doc.find("\n## ", start + len(SECTION))
            doc = doc[:start] + body + (doc[end:] if end >= 0 else "")
        else:
            doc = doc.rstrip() + "\n\n" + body
        a.write.write_text(doc)


if __name__ == "__main__":
    main()
