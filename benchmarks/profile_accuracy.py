"""How well per-op profiles add up: Σ fwd and Σ bwd of the OpGraph against the whole model, timed.

    .venv/bin/python benchmarks/profile_accuracy.py [--threads 1]

Prints the markdown table of docs/profiling.md and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

import torch

from partitioner import profile
from partitioner.profile import time_whole_model
from smp.models import build

SPECS = [
    "gpt:layers=2,d_model=256,heads=4,seq_len=128,batch=4,vocab=2048",  # the one tests/test_profile.py checks
    "gpt:layers=4,d_model=512,heads=8,seq_len=256,batch=4,vocab=8192",
    "bert:layers=4,d_model=256,heads=4,seq_len=128,batch=8,vocab=8192",
    "t5:layers=2,dec_layers=2,d_model=256,heads=4,seq_len=64,dec_seq_len=64,batch=8,vocab=8192",
    "resnet:size=small,image=64,batch=8",
    "unet:levels=3,base=16,image=64,batch=4",
    "mlp:layers=8,hidden=1024,batch=64",
    "mlp:layers=8,d_in=768,hidden=768,d_out=768,batch=32",  # weights larger than L2: one microbatch of the runtime benchmark
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    print(f"{torch.get_num_threads()} thread(s), profile repeats={opts.repeats}\n")
    print("| model | ops | Σ fwd ms | whole fwd ms | ratio | Σ bwd ms | whole bwd ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec in SPECS:
        bundle = build(spec)
        graph = profile(bundle.model, bundle.example_args, bundle.example_kwargs, repeats=opts.repeats)
        fwd, bwd = time_whole_model(bundle.model, bundle.example_args, bundle.example_kwargs)
        print(f"| `{spec}` | {len(graph)} | {graph.total_fwd * 1e3:.2f} | {fwd * 1e3:.2f} | "
              f"{graph.total_fwd / fwd:.2f} | {graph.total_bwd * 1e3:.2f} | {bwd * 1e3:.2f} | "
              f"{graph.total_bwd / bwd:.2f} |", flush=True)


if __name__ == "__main__":
    main()
