"""Stashed activations measured on 2 gloo ranks, with and without recomputation, against the plan's prediction.

Run:  .venv/bin/python benchmarks/recompute_runtime.py [--write docs/benchmarks.md]

A zoo GPT with dropout is planned once (analytic timing, 2 stages, 4 microbatches, no
recomputation), then the same stage assignment is re-priced under each recomputation
choice forced on every stage (``Plan.resimulate(recompute=...)``) and each schedule, and
run for one training step on 2 CPU ranks over gloo. Each rank's engine counts exactly
what it keeps (every storage autograd saves, the selective cache's matmul outputs, the
inputs it received and the outputs it sent, each once per microbatch; parameters and the
batch excluded): ``kept`` per stage is what one microbatch keeps from its forward to its
backward (the plan's ``activations``), ``peak`` per rank the most held at once during the
step, a recomputing stage's rerun included (the plan's simulated
``peak_activation_bytes_per_rank``). Ratios are measured / predicted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))  # tests/_launch.py: the N-rank launcher, not shipped with the packages

from benchmarks._markdown import write_section  # noqa: E402

SPECS = ["gpt:layers=4,d_model=128,heads=4,seq_len=64,vocab=512,batch=8,dropout=0.1"]
SCHEDULES = ("gpipe", "1f1b", "zb-h1")
CHOICES = ("none", "selective", "full")
SECTION = "## Recomputation at run time: stashed bytes measured against the plan"


def measure(spec: str) -> list[dict]:
    import smp
    from _launch import launch
    from smp.models import build

    b = build(spec, seed=0)
    base = smp.plan(b.model, b.example_args, b.example_kwargs, stages=2, microbatches=4, schedule="1f1b",
                    timing="analytic", recompute="none")
    plans = {f"{s}-{c}": base.resimulate(schedule=s, recompute=c) for s in SCHEDULES for c in CHOICES}
    rows = []
    with tempfile.TemporaryDirectory() as out:
        results = launch(f"{ROOT / 'tests' / '_runtime_common.py'}:recompute_worker", 2,
                         {"spec": spec, "plans": {k: p.to_dict() for k, p in plans.items()}, "out": out}, timeout=600)
        for r in results:
            if r.returncode != 0:
                raise SystemExit(f"rank {r.rank} failed:\n{r.stderr[-4000:]}")
        for label, plan in plans.items():
            sched, choice = label.rsplit("-", 1)
            for rank in range(2):
                got = torch.load(Path(out) / f"{label}-{rank}.pt", weights_only=False)
                stages = plan.schedule.stages_of(rank)
                kept = sum(got["kept"][s] for s in stages)
                pred_kept = sum(plan.partition.stages[s].activations for s in stages)
                pred_peak = plan.simulated.peak_activation_bytes_per_rank[rank]
                rows.append({"model": spec, "schedule": sched, "recompute": choice, "rank": rank,
                             "kept": kept, "kept_predicted": pred_kept, "peak": got["peak"],
                             "peak_predicted": pred_peak})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| schedule | recompute | rank | kept / microbatch: measured | predicted | ratio | peak: measured | "
             "predicted | ratio |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['recompute']} | {r['rank']} | {r['kept'] / 2**10:.1f} KiB | "
                     f"{r['kept_predicted'] / 2**10:.1f} KiB | {r['kept'] / r['kept_predicted']:.3f} | "
                     f"{r['peak'] / 2**10:.1f} KiB | {r['peak_predicted'] / 2**10:.1f} KiB | "
                     f"{r['peak'] / r['peak_predicted']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/recompute_runtime.py", description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="replace this section of the markdown file")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/recompute_runtime.json")
    a = ap.parse_args(argv)
    rows = [r for spec in SPECS for r in measure(spec)]
    text = table(rows)
    by = {c: [r["peak"] / r["peak_predicted"] for r in rows if r["recompute"] == c] for c in CHOICES}
    kept = {c: [r["kept"] / r["kept_predicted"] for r in rows if r["recompute"] == c] for c in CHOICES}
    summary = "\n".join(f"- `{c}`: kept {min(kept[c]):.3f}-{max(kept[c]):.3f}, peak {min(by[c]):.3f}-"
                        f"{max(by[c]):.3f} of the prediction" for c in CHOICES)
    print(text + "\n\n" + summary)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rows, indent=1) + "\n")
    if a.write:
        write_section(a.write, SECTION, (f"`.venv/bin/python benchmarks/recompute_runtime.py --write docs/benchmarks.md` "
                f"(written by the script; raw results in `benchmarks/results/recompute_runtime.json`). Model: "
                f"`{', '.join(SPECS)}`.\n{__doc__.split(chr(10), 2)[2].strip()}\n\n{text}\n\n{summary}\n"))


if __name__ == "__main__":
    main()
