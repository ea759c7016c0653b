"""Train a model larger than one device: build it without weights, each rank loads only its stages from a checkpoint.

    # once: a checkpoint to start from (here random weights; in practice a downloaded one)
    python examples/train_large.py --make-checkpoint ckpt/init --model gpt:layers=8,d_model=512,vocab=8192
    # train on 4 ranks (gloo on CPU here; NCCL on GPUs), saving a resumable checkpoint
    torchrun --nproc_per_node 4 examples/train_large.py --checkpoint ckpt/init --save ckpt/step --steps 20
    # resume from it, on any number of ranks
    torchrun --nproc_per_node 2 examples/train_large.py --checkpoint ckpt/step --resume --steps 20

No rank ever holds the whole model: under ``smp.delay_param_initialization()`` the model's
parameters are on the meta device; ``smp.partition`` plans it (analytic timing: no
weights needed), and each rank reads only its stages' tensors from the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import smp  # noqa: E402
from runtime.checkpoint import save_sharded  # noqa: E402
from smp.models import build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt:layers=8,d_model=512,heads=8,vocab=8192,seq_len=128,batch=8",
                    help="a zoo spec (hf-llama:... with transformers installed)")
    ap.add_argument("--make-checkpoint", type=Path, help="write the model's initial weights here and stop")
    ap.add_argument("--checkpoint", type=Path, help="weights to start from (safetensors, HF directory, smp)")
    ap.add_argument("--resume", action="store_true", help="also restore the optimizer state from --checkpoint")
    ap.add_argument("--save", type=Path, help="write a resumable checkpoint here at the end")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()

    if args.make_checkpoint:
        bundle = build(args.model, seed=0)
        out = save_sharded(bundle.model.state_dict(), args.make_checkpoint, shard_bytes=64 << 20)
        print(f"wrote {out} ({bundle.param_bytes() / 2**20:.0f} MiB)")
        return
    if args.checkpoint is None:
        ap.error("give --checkpoint (make one with --make-checkpoint)")
    with smp.delay_param_initialization():  # parameters on the meta device: no memory
        bundle = build(args.model, seed=0)
    pipe = smp.partition(bundle.model, microbatches=args.microbatches, loss_fn=bundle.loss_fn,
                         checkpoint=args.checkpoint, timing="analytic")
    pipe.prepare(*bundle.example_args, **bundle.example_kwargs)  # plan, keep and load this rank's stages
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    if args.resume:
        pipe.load_checkpoint(args.checkpoint, optimizer)
    rank = int(os.environ.get("RANK", "0"))
    for step in range(args.steps):
        loss = pipe.step(*bundle.example_args, target=bundle.target, **bundle.example_kwargs)
        norm = pipe.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}, grad norm {norm.item():.3f}")
    if args.save:
        pipe.save_checkpoint(args.save, optimizer)
    held = pipe.memory_stats(optimizer)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    for r, stats in held.items():
        print(f"rank {r}: holds {stats['params'] / 2**20:.0f} MiB of the model's "
              f"{bundle.param_bytes() / 2**20:.0f} MiB parameters, {stats['total'] / 2**20:.0f} MiB in all "
              f"(predicted {pipe.plan.rank_memory[r] / 2**20:.0f} MiB); peak resident {peak:.0f} MiB")


if __name__ == "__main__":
    main()
