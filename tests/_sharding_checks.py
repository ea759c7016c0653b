"""Sharded data parallel on gloo ranks: the rank worker and the single-process AdamW reference it must equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from partitioner.microbatch import split_microbatches
from runtime.sharding import local
from smp.models import build
from smp.partition import partition

LR = 1e-3
# AdamW divides each gradient by its running size: an entry whose true gradient is zero (a key bias, which
# softmax ignores) gets rounding noise ~1e-9, and with the default eps=1e-8 moves a tenth of a full step on it,
# differently in any other summation order. eps=1e-4 damps exactly those entries and leaves the others
# (gradients ~1e-2) as default AdamW moves them.
EPS = 1e-4


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=EPS)


def reference_run(spec: str, pieces: int, steps: int) -> dict[str, Any]:
    """The unpartitioned model on the global batch, as ``pieces`` microbatches (loss / pieces each), AdamW steps."""
    b = build(spec, seed=0)
    model = b.model
    opt = adamw(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = torch.zeros(())
        inputs = split_microbatches(b.example_args, b.example_kwargs, pieces)
        targets = [t[0][0] for t in split_microbatches((b.target,), None, pieces)]
        for (a, k), tgt in zip(inputs, targets):
            loss = b.loss_fn(model(*a, **k), tgt)
            (loss / pieces).backward()
            total += loss.detach() / pieces
        losses.append(total)
        opt.step()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on this rank: each sharded tensor's local shard."""
    return sum(local(v).numel() * local(v).element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def shard_worker(rank: int, world: int, *, spec: str, stages: int, sharding: str, out: str, steps: int = 3,
                 microbatches: int = 2, schedule: str = "1f1b", recompute: str = "none",
                 checkpoint_to: str | None = None) -> None:
    """One rank of world / stages replicas under ``sharding``: its replica's share of the global batch, AdamW steps
    on ``pipe.parameters()``; losses, whole parameters (gathered), optimizer bytes, the state dict (rank 0)."""
    b = build(spec, seed=0)
    pipe = partition(b.model, stages=stages, microbatches=microbatches, schedule=schedule, loss_fn=b.loss_fn,
                     timeout=60, timing="analytic", sharding=sharding, recompute=recompute)
    x, y = b.example_args[0], b.target
    share = x.shape[0] // (world // stages)
    rows = slice(pipe.dp_rank * share, (pipe.dp_rank + 1) * share)
    pipe.prepare(x[rows])
    opt = adamw(pipe.parameters())
    res: dict[str, Any] = {"losses": [], "dp_rank": pipe.dp_rank, "pp_rank": pipe.pp_rank,
                           "sharding": pipe.plan.sharding, "recompute": list(pipe.plan.recompute),
                           "dtensors": [type(p).__name__ for p in pipe.parameters()]}
    for _ in range(steps):
        res["losses"].append(pipe.step(x[rows], target=y[rows]).detach())
        opt.step()
        opt.zero_grad()
    res["params"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for n, p in pipe.named_parameters()}
    res["optimizer_bytes"] = optimizer_bytes(opt)
    res["state_dict"] = pipe.state_dict()
    if checkpoint_to is not None:
        pipe.save_checkpoint(checkpoint_to, opt)
    torch.save(res, Path(out) / f"shard-{rank}.pt")
