"""Checks of smp.v1 with "ddp": true on 4 ranks (2 replicas of 2 partitions) under torchrun, one JSON per rank.

Run: python -m torch.distributed.run --standalone --nproc_per_node 4 tests/_v1_ddp_checks.py OUT_DIR
Checked: the rank helpers in the default placement ("cluster"; OUT_DIR/ranks), batch-norm buffers broadcast
from dp rank 0 before a training step (broadcast_buffers), and smp.save_checkpoint / smp.resume_from_checkpoint
(partial) on replicated partitions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import smp.v1 as smp
from _v1_mnist import write_ranks


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with smp.partition(0):
            self.a = nn.Linear(8, 8)
            self.norm = nn.BatchNorm1d(8)
        with smp.partition(1):
            self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


@smp.step
def train_step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def main(out: Path) -> None:
    smp.init({"partitions": 2, "microbatches": 2, "ddp": True, "auto_partition": False, "timeout": 30})
    torch.manual_seed(0)
    model = smp.DistributedModel(Net())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    res: dict = {"rank": smp.rank(), "pp_rank": smp.pp_rank(), "dp_rank": smp.dp_rank()}

    def running_mean() -> list[float] | None:
        return model.module.norm.running_mean.tolist() if smp.pp_rank() == 0 else None

    # step 1: each replica its own data, so each replica's batch-norm statistics move differently
    optimizer.zero_grad()
    train_step(model, *batch(seed=smp.dp_rank()))
    optimizer.step()
    res["after_own_data"] = running_mean()
    # step 2: the same data everywhere; the statistics agree afterwards only if they agreed before it
    optimizer.zero_grad()
    train_step(model, *batch(seed=100))
    optimizer.step()
    res["after_same_data"] = running_mean()
    (out / "ranks").mkdir(exist_ok=True)
    write_ranks(model, out / "ranks")

    # a partial checkpoint of replicated partitions, then the weights moved, then resumed
    smp.save_checkpoint(out / "ckpt", tag="step2", partial=True, model=model, optimizer=optimizer,
                        user_content={"step": 2})
    saved = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    optimizer.zero_grad()
    train_step(model, *batch(seed=200))
    optimizer.step()
    res["moved"] = any(not torch.equal(p, saved[n]) for n, p in model.local_named_parameters())
    res["user_content"] = smp.resume_from_checkpoint(out / "ckpt")
    res["resumed"] = all(torch.equal(p, saved[n]) for n, p in model.local_named_parameters())
    (out / f"rank{smp.rank()}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
