"""Activation recomputation chosen by the planner against "full recomputation everywhere", on real-size GPTs.

Run:  .venv/bin/python benchmarks/recompute.py [--write docs/benchmarks.md] [--pictures docs/img]

Each case is a zoo GPT at real size built on the meta device and profiled analytically on
a device profile (fp32 weights and activations, Adam state: the plan's state factor 4),
with the device's memory as the limit: 40 GB on ``a100-sxm``, 80 GB on ``h100-sxm``. The
batch is chosen so that the limit binds: no plan without recomputation fits (the planner
refuses ``recompute="none"`` and says the least memory a plan without it needs). Then
``smp.plan`` (1F1B, default objective: the simulated step) plans it three ways: the
planner's choice (``recompute="auto"``: partition and per-stage recomputation together),
``"selective"`` on every stage, and ``"full"`` on every stage (what people set by hand:
Megatron's ``--recompute-granularity full``), each partition solved for its own choice.
``full / auto`` is the predicted step time of full recomputation over the planner's
(above 1: the planner's plan is faster).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._markdown import write_section  # noqa: E402
from smp.cli.render import runs_of  # noqa: E402

#: (spec, sequence length, step batch, microbatches, stages, device profile, memory limit in GB)
CASES = [
    ("gpt:size=1b", 2048, 64, 8, 4, "a100-sxm", 40),
    ("gpt:size=1b", 2048, 128, 8, 4, "h100-sxm", 80),
    ("gpt:size=large", 4096, 64, 8, 4, "a100-sxm", 40),
    ("gpt:size=1b", 4096, 64, 16, 8, "h100-sxm", 80),
]
SECTION = "## Activation recomputation chosen by the planner"


def run(spec: str, seq: int, batch: int, m: int, stages: int, device: str, limit_gb: float) -> tuple[dict, dict]:
    import smp
    from partitioner.errors import MemoryLimitError
    from smp.models import build_step

    b = build_step(spec, microbatches=m, batch_size=batch, seq_len=seq, meta=True)
    limit = limit_gb * 1e9
    common = dict(stages=stages, microbatches=m, schedule="1f1b", cluster=device, device_profile=device,
                  timing="analytic", memory_limit=limit)
    row: dict = {"model": spec, "seq_len": seq, "batch": batch, "microbatches": m, "stages": stages,
                 "device": device, "memory_limit": limit}
    try:
        smp.plan(b.model, b.example_args, b.example_kwargs, recompute="none", **common)
        row["none"] = "fits"
    except MemoryLimitError as err:
        row["none"] = "refused"
        row["none_least_memory"] = err.works
        row["none_needed_bound"] = err.needed
        row["none_recompute_fits"] = err.recompute_fits
    plans = {}
    for mode in ("auto", "selective", "full"):
        t0 = time.perf_counter()
        try:
            p = smp.plan(b.model, b.example_args, b.example_kwargs, recompute=mode, **common)
        except MemoryLimitError as err:
            row[mode] = {"error": " ".join(str(err).split())}
            continue
        plans[mode] = p
        row[mode] = {"step_time": p.step_time, "bottleneck": p.partition.bottleneck, "proven": p.partition.optimal,
                     "recompute": p.recompute, "stage_memory": p.stage_memory, "fits": p.partition.memory_ok,
                     "seconds": time.perf_counter() - t0}
    if "auto" in plans and "full" in plans:
        row["full_over_auto"] = plans["full"].step_time / plans["auto"].step_time
    if "auto" in plans and "selective" in plans:
        row["selective_over_auto"] = plans["selective"].step_time / plans["auto"].step_time
    # what the model would use without a limit: the "before" of the memory picture
    unlimited = {k: v for k, v in common.items() if k != "memory_limit"}
    plans["unlimited"] = smp.plan(b.model, b.example_args, b.example_kwargs, recompute="none", **unlimited,
                                  memory_limit=1e15)
    return row, plans


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def ratio(row: dict, key: str) -> str:
    """A step-time ratio, or "-" where one of the two plans does not fit."""
    return f"{row[key]:.3f}" if key in row else "-"


def table(rows: list[dict]) -> str:
    lines = ["| model | seq | batch / m | stages | device (limit) | none | auto: stages | auto step | selective step "
             "| full step | full / auto | selective / auto |",
             "|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        none = "fits" if r["none"] == "fits" else f"refused: needs {_gb(r['none_least_memory'])}"

        def step(mode: str) -> str:
            v = r.get(mode, {})
            return f"{v['step_time']:.3f} s" if "step_time" in v else "does not fit"

        auto = r.get("auto", {})
        runs = runs_of(auto.get("recompute", []))
        lines.append(
            f"| `{r['model']}` | {r['seq_len']} | {r['batch']} / {r['microbatches']} | {r['stages']} | {r['device']} "
            f"({_gb(r['memory_limit'])}) | {none} | {', '.join(f'{n}× {c}' for c, n in runs)} | {step('auto')} | "
            f"{step('selective')} | {step('full')} | "
            f"{ratio(r, 'full_over_auto')} | {ratio(r, 'selective_over_auto')} |")
    return "\n".join(lines)


def pictures(row: dict, plans: dict, folder: Path) -> list[Path]:
    """The timeline of the planner's plan with recomputation marked, and memory per stage before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from partitioner.timeline import render_timeline

    folder.mkdir(parents=True, exist_ok=True)
    auto = plans["auto"]
    tl = render_timeline(auto.timeline(), folder / "recompute-timeline.png",
                         title=f"{row['model']}, seq {row['seq_len']}, batch {row['batch']} on {row['stages']} x "
                               f"{row['device']}: recomputation chosen per stage ({', '.join(auto.recompute)})")
    fig, ax = plt.subplots(figsize=(9, 3.6))
    S = auto.num_stages
    width = 0.27
    series = [("no limit, no recomputation", plans["unlimited"], "#9E9E9E"),
              ("full recomputation everywhere", plans["full"], "#8172B3"),
              ("planner's choice (auto)", auto, "#C44E52")]
    for k, (label, p, color) in enumerate(series):
        xs = [s + (k - 1) * width for s in range(S)]
        ax.bar(xs, [m / 1e9 for m in p.stage_memory], width, label=label, color=color)
    ax.axhline(row["memory_limit"] / 1e9, color="black", linestyle="--", linewidth=1)
    ax.text(S - 0.5, row["memory_limit"] / 1e9, f" limit {_gb(row['memory_limit'])}", va="bottom", ha="right",
            fontsize=8)
    ax.set_xticks(range(S))
    ax.set_xticklabels([f"stage {s}\n{c}" for s, c in enumerate(auto.recompute)])
    ax.set_ylabel("predicted peak memory (GB)")
    ax.set_title(f"{row['model']}, seq {row['seq_len']}, batch {row['batch']}, {row['microbatches']} microbatches, "
                 f"1F1B (stage labels: the planner's choice)", fontsize=9)
    ax.legend(fontsize=8, loc="upper right", ncol=3, frameon=False, bbox_to_anchor=(1, 1.0))
    ax.set_ylim(0, max(max(p.stage_memory) for _, p, _ in series) / 1e9 * 1.25)
    fig.tight_layout()
    mem = folder / "recompute-memory.png"
    fig.savefig(mem, dpi=110)
    plt.close(fig)
    return [tl, mem]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/recompute.py", description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="replace this section of the markdown file")
    ap.add_argument("--pictures", type=Path, help="write the timeline and memory pictures of the first case here")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/recompute.json")
    a = ap.parse_args(argv)
    rows = []
    for k, case in enumerate(CASES):
        row, plans = run(*case)
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
        if k == 0 and a.pictures:
            for path in pictures(row, plans, a.pictures):
                print(f"wrote {path}")
    text = table(rows)
    ratios = [r["full_over_auto"] for r in rows if "full_over_auto" in r]
    summary = (f"\nIn every case the limit binds (no plan without recomputation fits) and the planner's plan fits; "
               f"full recomputation everywhere is {min(ratios):.3f}-{max(ratios):.3f}x the planner's predicted step "
               f"time.") if all(r["none"] == "refused" for r in rows) else ""
    print(text + "\n" + summary)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rows, indent=1) + "\n")
    if a.write:
        write_section(a.write, SECTION, (f"`.venv/bin/python benchmarks/recompute.py --write docs/benchmarks.md --pictures "
                f"docs/img` (written by the script; raw results in `benchmarks/results/recompute.json`).\n"
                f"{__doc__.split(chr(10), 2)[2].strip()}\n\n{text}\n{summary}\n"))


if __name__ == "__main__":
    main()
