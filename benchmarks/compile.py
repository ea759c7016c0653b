"""Compiled stages against eager on a CPU: one process, two stages of a small GPT, steps timed side by side.

Run:  .venv/bin/python benchmarks/compile.py [--write docs/benchmarks.md]

A zoo GPT is planned twice on the `cpu` profile (analytic timing, 2 stages, 4 microbatches,
1f1b): priced for eager stages (each op pays the profile's dispatch) and for compiled ones
(``compile=True``: the kernels alone). Both pipelines run in one process (every stage
through the same engine); after warm-up steps (the compiled one's first step compiles its
stages with inductor, timed on its own) their training steps alternate, eager then
compiled, so both see the same load on a shared machine; the median step is reported.
A CPU figure (one intra-op thread): what a GPU gains, where dispatch is most of an eager
small model's time, waits for a GPU run (benchmarks/gpu.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._markdown import write_section  # noqa: E402

SPEC = "gpt:layers=4,d_model=128,heads=4,seq_len=64,vocab=512,batch=8"
WARMUP = 2
STEPS = 10
SECTION = "## Compiled stages against eager (CPU, one process)"


def measure(steps: int) -> dict:
    import smp
    from smp.models import build

    torch.set_num_threads(1)
    pipes, plans, first = {}, {}, {}
    for mode, compiled in (("eager", False), ("compiled", True)):
        b = build(SPEC, seed=0)
        plans[mode] = smp.plan(b.model, b.example_args, b.example_kwargs, stages=2, microbatches=4,
                               schedule="1f1b", timing="analytic", device_profile="cpu", compile=compiled)
        pipes[mode] = smp.partition(b.model, plan=plans[mode], loss_fn=b.loss_fn)
        t0 = time.perf_counter()
        pipes[mode].step(*b.example_args, target=b.target, **b.example_kwargs)
        first[mode] = time.perf_counter() - t0
    b = build(SPEC, seed=0)
    times: dict[str, list[float]] = {m: [] for m in pipes}
    for i in range(WARMUP + steps):
        for mode, pipe in pipes.items():
            pipe.zero_grad()
            t0 = time.perf_counter()
            pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
            if i >= WARMUP:
                times[mode].append(time.perf_counter() - t0)
    return {"model": SPEC, "device": "cpu (1 intra-op thread)", "torch": torch.__version__, "backend": "inductor",
            "stages": 2, "microbatches": 4, "schedule": "1f1b", "steps": steps,
            "modes": {m: {"first_step_s": first[m], "median_step_s": statistics.median(times[m]),
                          "steps_s": times[m], "predicted_step_s": plans[m].step_time} for m in pipes}}


def table(res: dict) -> str:
    lines = ["| stages run | first step (compiles) | median step | predicted step (cpu profile) |",
             "|---|---:|---:|---:|"]
    for mode, r in res["modes"].items():
        lines.append(f"| {mode} | {r['first_step_s']:.2f} s | {r['median_step_s'] * 1e3:.1f} ms | "
                     f"{r['predicted_step_s'] * 1e3:.1f} ms |")
    e, c = res["modes"]["eager"], res["modes"]["compiled"]
    lines.append("")
    lines.append(f"Compiled / eager: measured {c['median_step_s'] / e['median_step_s']:.2f}, predicted "
                 f"{c['predicted_step_s'] / e['predicted_step_s']:.2f} (torch {res['torch']}, {res['device']}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/compile.py", description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="replace this section of the markdown file")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/compile.json")
    ap.add_argument("--steps", type=int, default=STEPS)
    a = ap.parse_args(argv)
    res = measure(a.steps)
    text = table(res)
    print(text)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(res, indent=1) + "\n")
    if a.write:
        write_section(a.write, SECTION, (f"`.venv/bin/python benchmarks/compile.py --write docs/benchmarks.md` "
                                         f"(written by the script; raw results in `benchmarks/results/compile.json`). "
                                         f"Model: `{SPEC}`.\n{__doc__.split(chr(10), 2)[2].strip()}\n\n{text}\n"))


if __name__ == "__main__":
    main()
