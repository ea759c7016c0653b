"""Train the zoo GPT as a pipeline: torchrun --nproc_per_node 2 examples/train_gpt.py (or plain python: one process)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import smp  # noqa: E402
from smp.models import build  # noqa: E402
from smp.partition import partition  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt:size=tiny,batch=8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved or zb-h1")
    ap.add_argument("--stages", type=int, default=None, help="default: the world size (2 in one process)")
    ap.add_argument("--save", default=None, help="write the full state dict here (rank 0)")
    args = ap.parse_args()

    if "RANK" in os.environ:  # launched by torchrun; joined here (not left to smp.partition) to know the rank
        smp.init_distributed("gloo", timeout=120)
        torch.set_num_threads(1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    stages = args.stages or (dist.get_world_size() if dist.is_initialized() else 2)

    bundle = build(args.model, seed=0)  # every rank builds the same model and reads the same batch
    pipe = partition(bundle.model, stages=stages, microbatches=args.microbatches, schedule=args.schedule,
                     loss_fn=bundle.loss_fn, timeout=120)
    optimizer = None
    for step in range(args.steps):
        loss = pipe.step(*bundle.example_args, target=bundle.target, **bundle.example_kwargs)
        if optimizer is None:  # this rank's parameters are known once the model is partitioned (first step)
            optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
            if rank == 0:
                print(pipe.plan.summary())
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    state = pipe.state_dict()  # a collective: every rank calls it; rank 0 gets the full state
    if rank == 0 and args.save:
        torch.save(state, args.save)
        print(f"saved {len(state)} tensors to {args.save}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
