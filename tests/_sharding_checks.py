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
MAX_NORM = 1.0  # gradients are clipped to this global norm before every step (the tiny GPT's are ~1.5-2)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=EPS)


def reference_run(spec: str, pieces: int, steps: int, precision: str = "fp32") -> dict[str, Any]:
    """The unpartitioned model on the global batch, as ``pieces`` microbatches (loss / pieces each), clipped AdamW
    steps; then its eval-mode output on the batch."""
    b = build(spec, seed=0)
    model = b.model
    opt = adamw(model.parameters())
    losses, norms = [], []
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    for _ in range(steps):
        opt.zero_grad()
        total = torch.zeros(())
        inputs = split_microbatches(b.example_args, b.example_kwargs, pieces)
        targets = [t[0][0] for t in split_microbatches((b.target,), None, pieces)]
        for (a, k), tgt in zip(inputs, targets):
            with autocast:
                loss = b.loss_fn(model(*a, **k), tgt)
            (loss / pieces).backward()
            total += loss.detach().float() / pieces
        losses.append(total)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
    model.eval()
    with torch.no_grad(), autocast:
        output = model(*b.example_args, **b.example_kwargs)
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "eval": output}


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on this rank: each sharded tensor's local shard."""
    return sum(local(v).numel() * local(v).element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def shard_worker(rank: int, world: int, *, spec: str, stages: int, sharding: str, out: str, steps: int = 3,
                 microbatches: int = 2, schedule: str = "1f1b", recompute: str = "none", precision: str = "fp32",
                 checkpoint_to: str | None = None) -> None:
    """One rank of world / stages replicas under ``sharding``: its replica's share of the global batch, clipped
    AdamW steps on ``pipe.parameters()``; losses, norms, whole parameters (gathered), optimizer bytes, the eval
    output of its rows (output stage), the state dict (rank 0)."""
    b = build(spec, seed=0)
    pipe = partition(b.model, stages=stages, microbatches=microbatches, schedule=schedule, loss_fn=b.loss_fn,
                     timeout=60, timing="analytic", sharding=sharding, recompute=recompute, precision=precision)
    x, y = b.example_args[0], b.target
    share = x.shape[0] // (world // stages)
    rows = slice(pipe.dp_rank * share, (pipe.dp_rank + 1) * share)
    pipe.prepare(x[rows])
    opt = adamw(pipe.parameters())
    res: dict[str, Any] = {"losses": [], "norms": [], "rows": rows, "dp_rank": pipe.dp_rank, "pp_rank": pipe.pp_rank,
                           "sharding": pipe.plan.sharding, "recompute": list(pipe.plan.recompute),
                           "dtensors": [type(p).__name__ for p in pipe.parameters()]}
    for _ in range(steps):
        res["losses"].append(pipe.step(x[rows], target=y[rows]).detach())
        res["norms"].append(pipe.clip_grad_norm_(MAX_NORM))
        opt.step()
        opt.zero_grad()
    pipe.eval()
    res["eval"] = pipe(x[rows])
    pipe.train()
    res["params"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for n, p in pipe.named_parameters()}
    res["optimizer_bytes"] = optimizer_bytes(opt)
    res["param_bytes"] = sum(p.numel() * p.element_size() for p in pipe.parameters())  # whole (a DTensor's global)
    res["state_dict"] = pipe.state_dict()
    res["optimizer"] = whole_optimizer_state(pipe, opt)
    if checkpoint_to is not None:
        pipe.save_checkpoint(checkpoint_to, opt)
    torch.save(res, Path(out) / f"shard-{rank}.pt")


def whole_optimizer_state(pipe: Any, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Each of this rank's parameters' optimizer state tensors, gathered whole (a collective when sharded)."""
    return {n: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in opt.state[p].items()}
            for n, p in pipe.named_parameters() if p in opt.state}


def load_worker(rank: int, world: int, *, spec: str, stages: int, sharding: str, checkpoint_from: str, out: str,
                checkpoint_to: str | None = None) -> None:
    """One rank of a fresh pipeline (another seed) loading ``checkpoint_from`` with its AdamW state: the state
    dict (rank 0), the optimizer state gathered whole; saved again to ``checkpoint_to``."""
    b = build(spec, seed=1)
    pipe = partition(b.model, stages=stages, microbatches=2, loss_fn=b.loss_fn, timeout=60, timing="analytic",
                     sharding=sharding)
    x = b.example_args[0]
    pipe.prepare(x[: x.shape[0] // (world // stages)])
    opt = adamw(pipe.parameters())
    pipe.load_checkpoint(checkpoint_from, opt)
    res = {"state_dict": pipe.state_dict(), "optimizer": whole_optimizer_state(pipe, opt),
           "dtensors": [type(p).__name__ for p in pipe.parameters()]}
    if checkpoint_to is not None:
        pipe.save_checkpoint(checkpoint_to, opt)
    torch.save(res, Path(out) / f"load-{rank}.pt")


def refusal_worker(rank: int, world: int, *, spec: str, schedule: str, out: str) -> None:
    """One rank of 2 x 2 under full_shard with ``schedule``: the message partitioning raised ("" if none)."""
    from runtime.errors import RuntimeConfigError

    b = build(spec, seed=0)
    try:  # refused by the request itself, on every rank, before any rank plans
        pipe = partition(b.model, stages=2, microbatches=2, schedule=schedule, loss_fn=b.loss_fn, timeout=60,
                         timing="analytic", sharding="full_shard")
        pipe.prepare(b.example_args[0][:4])
        message = ""
    except RuntimeConfigError as err:
        message = str(err)
    Path(out, f"refusal-{rank}.txt").write_text(message)


def memory_worker(rank: int, world: int, *, spec: str, sharding: str, out: str) -> None:
    """One rank of 2 x 2 under ``sharding`` (4 microbatches: full_shard gathers and frees 4 times a step): two
    metered AdamW (foreach) steps, then ``memory_stats``, the whole bytes of this rank's parameters (a DTensor's
    global size) and the plan's activations of its stages."""
    import json

    from runtime.memory import OptimizerStepMeter

    b = build(spec, seed=0)
    pipe = partition(b.model, stages=2, microbatches=4, loss_fn=b.loss_fn, timeout=60, timing="analytic",
                     sharding=sharding)
    x, y = b.example_args[0], b.target
    share = x.shape[0] // (world // 2)
    rows = slice(pipe.dp_rank * share, (pipe.dp_rank + 1) * share)
    pipe.prepare(x[rows])
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR, foreach=True)
    meter = OptimizerStepMeter(opt)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        pipe.step(x[rows], target=y[rows])
        opt.step()
    res = {"stats": pipe.memory_stats(opt, step_meter=meter)[pipe.pp_rank],
           "whole": sum(p.numel() * p.element_size() for p in pipe.parameters()),
           "tensors": len(list(pipe.parameters())),
           "planned_activations": sum(pipe.plan.memory_split()[s]["activations"]
                                      for s in pipe.plan.schedule.stages_of(pipe.pp_rank))}
    Path(out, f"memory-{rank}.json").write_text(json.dumps(res))
