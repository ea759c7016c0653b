"""Survive a lost rank: torchrun restarts the job, which resumes from its last checkpoint as if nothing happened.

    # 2 stages; rank 1 kills itself after step 5 (first attempt only); torchrun restarts both ranks,
    # which resume from the step-4 checkpoint and finish: the same losses and weights as without the kill
    torchrun --nproc-per-node 2 --max-restarts 1 examples/resume_after_failure.py \\
        --checkpoints ckpt --steps 8 --save-every 2 --kill-at 5 --kill-rank 1
    # 2 stages x 2 replicas
    torchrun --nproc-per-node 4 --max-restarts 1 examples/resume_after_failure.py --stages 2 --checkpoints ckpt ...

What it takes (docs/runtime.md, "Surviving a lost rank"): join with ``smp.init_distributed``
(a restarted attempt re-forms the group); save every few steps with the step
(``pipe.save_checkpoint(dir, opt, step=n)``); at start resume from ``smp.latest_checkpoint``,
whose ``load_checkpoint`` returns the step to go on from; and a data order that follows from the
step alone (here each step's batch is drawn from a generator seeded by the step), so that the
resumed run reads the batches the lost one would have.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import smp  # noqa: E402

FEATURES, BATCH = 16, 8


def make_model() -> nn.Module:
    """A small MLP with dropout: an exact resume must also replay each rank's random draws."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.ReLU(),
                         nn.Dropout(0.1), nn.Linear(32, 4))


def batch(step: int, replica: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, drawn from a generator seeded by the step alone, and this replica's share."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, FEATURES, generator=g), torch.randn(BATCH, 4, generator=g)
    share = BATCH // replicas
    return x[replica * share:(replica + 1) * share], y[replica * share:(replica + 1) * share]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=Path, required=True, help="a folder of step-N checkpoints")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--stages", type=int, default=None, help="default: the world size (no replicas)")
    ap.add_argument("--sharding", default="auto", help="none, shard_grad_op, full_shard or auto (with replicas)")
    ap.add_argument("--kill-at", type=int, default=None, help="kill one rank after this step, in the first attempt")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="rank 0 writes the losses and final weights here")
    args = ap.parse_args()

    smp.init_distributed(timeout=60)  # before smp.partition: this script wants its rank first
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    # an analytic plan is the same in every attempt: each stage's ops (and their dropout draws) stay on their rank
    pipe = smp.partition(make_model(), stages=args.stages or dist.get_world_size(), microbatches=2,
                         loss_fn=nn.functional.mse_loss, timing="analytic", timeout=60, sharding=args.sharding)
    pipe.prepare(batch(0, pipe.dp_rank, pipe.dp_size)[0])  # this rank's parameters, for the optimizer
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    start = 0
    latest = smp.latest_checkpoint(args.checkpoints)
    if latest is not None:
        start = pipe.load_checkpoint(latest, opt) or 0
        if rank == 0:
            print(f"attempt {attempt}: resuming from {latest.name} (step {start})", flush=True)
    losses: dict[int, float] = {}
    for step in range(start, args.steps):
        x, y = batch(step, pipe.dp_rank, pipe.dp_size)
        loss = pipe.step(x, target=y)
        opt.step()
        opt.zero_grad()
        done = step + 1
        losses[done] = loss.item()
        if rank == 0:
            print(f"attempt {attempt} step {done}: loss {loss.item()!r}", flush=True)
        if done == args.kill_at and rank == args.kill_rank and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost rank: no exception, no cleanup
        if done % args.save_every == 0:
            pipe.save_checkpoint(args.checkpoints / f"step-{done}", opt, step=done)
    state = pipe.state_dict()  # a collective: rank 0 gets the whole model
    if rank == 0 and args.out is not None:
        torch.save({"losses": losses, "state": state}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
