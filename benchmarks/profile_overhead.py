"""Wall time to trace + profile each zoo model, against one training step of the same model.

    .venv/bin/python benchmarks/profile_overhead.py [--repeats 5] [--threads 2] [--quick] [--write docs/benchmarks.md]

Prints its section of docs/benchmarks.md (``--write`` replaces it there). The ratio is what matters
on a shared machine: profiling cost in units of training steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._markdown import write_section  # noqa: E402
from partitioner import profile, trace  # noqa: E402
from smp.models import build  # noqa: E402

SECTION = "## Profiling overhead: trace + profile against one training step"

MODELS = {
    "gpt": "gpt:layers=4,d_model=256,heads=4,seq_len=128,batch=8,vocab=8192",
    "bert": "bert:layers=4,d_model=256,heads=4,seq_len=128,batch=8,vocab=8192",
    "t5": "t5:layers=2,dec_layers=2,d_model=256,heads=4,seq_len=64,dec_seq_len=64,batch=8,vocab=8192",
    "resnet": "resnet:size=small,image=64,batch=8",
    "unet": "unet:levels=3,base=16,image=64,batch=4",
    "mlp": "mlp:layers=8,hidden=1024,batch=64",
    "hf-gpt2": "hf-gpt2:layers=4,d_model=256,heads=4,seq_len=128,batch=8,vocab=8192",
}
QUICK = {k: v for k, v in MODELS.items() if k in ("gpt", "mlp")}


def train_step_seconds(bundle, steps: int = 5) -> float:
    model = bundle.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    samples = []
    for i in range(steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = bundle.loss_fn(model(*bundle.example_args, **bundle.example_kwargs), bundle.target)
        loss.backward()
        optimizer.step()
        if i:  # the first step allocates optimizer state
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def section(rows: list[dict], settings: str) -> str:
    """The markdown section: command, settings, the table, and the range of the ratio."""
    ratios = [r["ratio"] for r in rows]
    return "\n".join([
        "`.venv/bin/python benchmarks/profile_overhead.py --write docs/benchmarks.md` (written by the script). A "
        "training step is forward + backward + AdamW on the same batch (median of 5, after one that allocates the "
        "optimizer state).",
        "",
        settings,
        "",
        "| model | spec | params | ops | trace s | profile s | train step s | profile / step |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *(f"| {r['model']} | `{r['spec']}` | {r['params'] / 1e6:.1f}M | {r['ops']} | {r['trace_s']:.2f} | "
          f"{r['profile_s']:.2f} | {r['step_s']:.3f} | {r['ratio']:.0f}x |" for r in rows),
        "",
        f"Profiling costs {min(ratios):.0f}-{max(ratios):.0f} training steps: every op runs `warmup + repeats` times "
        "in forward sweeps and in two sets of backward sweeps (docs/profiling.md). `--timing analytic` costs one "
        "forward and one backward of FLOP counting instead.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="two small models only")
    parser.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    settings = (f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                f"torch {torch.__version__}; profile repeats={opts.repeats}.")
    print(settings, flush=True)
    rows = []
    for name, spec in (QUICK if opts.quick else MODELS).items():
        bundle = build(spec)
        start = time.perf_counter()
        gm = trace(bundle.model, bundle.example_args, bundle.example_kwargs)
        traced = time.perf_counter() - start
        start = time.perf_counter()
        graph = profile(bundle.model, bundle.example_args, bundle.example_kwargs, graph_module=gm,
                        repeats=opts.repeats, threads=None)  # on --threads, as the training step
        profiled = time.perf_counter() - start
        step = train_step_seconds(bundle)
        rows.append({"model": name, "spec": spec, "params": bundle.num_params(), "ops": len(graph),
                     "trace_s": traced, "profile_s": profiled, "step_s": step, "ratio": (traced + profiled) / step})
        print(json.dumps(rows[-1]), flush=True)
    text = section(rows, settings)
    print(f"\n{SECTION}\n\n{text}")
    if opts.write:
        write_section(opts.write, SECTION, text)


if __name__ == "__main__":
    main()
