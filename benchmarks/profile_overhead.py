"""Wall time to trace + profile each zoo model, against one training step of the same model.

    .venv/bin/python benchmarks/profile_overhead.py [--repeats 5] [--threads 2] [--quick]

Prints a markdown table (the one in docs/benchmarks.md). The ratio is what matters on a
shared machine: profiling cost in units of training steps.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from partitioner import profile, trace
from smp.models import build

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="two small models only")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; profile repeats={opts.repeats}\n")
    print("| model | spec | params | ops | trace s | profile s | train step s | profile / step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, spec in (QUICK if opts.quick else MODELS).items():
        bundle = build(spec)
        start = time.perf_counter()
        gm = trace(bundle.model, bundle.example_args, bundle.example_kwargs)
        traced = time.perf_counter() - start
        start = time.perf_counter()
        graph = profile(bundle.model, bundle.example_args, bundle.example_kwargs, graph_module=gm,
                        repeats=opts.repeats)
        profiled = time.perf_counter() - start
        step = train_step_seconds(bundle)
        print(f"| {name} | `{spec}` | {bundle.num_params() / 1e6:.1f}M | {len(graph)} | {traced:.2f} | "
              f"{profiled:.2f} | {step:.3f} | {(traced + profiled) / step:.0f}x |", flush=True)


if __name__ == "__main__":
    main()
