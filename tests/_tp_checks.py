"""Tensor parallelism inside pipeline stages on gloo ranks: the rank worker and the one-process run it must equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from partitioner.microbatch import split_microbatches
from runtime.precision import PipelineGradScaler
from runtime.sharding import gather_whole as whole, local
from runtime.tensor_parallel import split_over_tp
from smp.models import build
from smp.partition import partition


def sgd(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum: after one step each parameter's momentum buffer is its gradient (state to checkpoint)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


FP16_SCALE = PipelineGradScaler().scale  # the first loss scale of an fp16 pipeline


def reference_step(spec: str, pieces: int, precision: str = "fp32") -> dict[str, Any]:
    """One step of the unpartitioned model on the global batch as ``pieces`` microbatches: loss and gradients, the
    gradient norm; after an SGD step its state and eval-mode output. ``precision="bf16"`` or ``"fp16"``: under
    autocast."""
    b = build(spec, seed=0)
    model = b.model
    total = torch.zeros(())
    inputs = split_microbatches(b.example_args, b.example_kwargs, pieces)
    targets = [t[0][0] for t in split_microbatches((b.target,), None, pieces)]
    for (a, k), tgt in zip(inputs, targets):
        with torch.autocast("cpu", dtype=torch.float16 if precision == "fp16" else torch.bfloat16,
                            enabled=precision in ("bf16", "fp16")):
            loss = b.loss_fn(model(*a, **k), tgt)
        # fp16 as smp runs it: the loss scaled by the scaler's first scale before the backward, the
        # gradients unscaled after (powers of two: exact, but small half-precision gradients no longer underflow)
        (loss / pieces * (FP16_SCALE if precision == "fp16" else 1.0)).backward()
        total += loss.detach() / pieces
    if precision == "fp16":
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= FP16_SCALE
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    sgd(model.parameters()).step()
    model.eval()
    with torch.no_grad():
        output = model(*b.example_args, **b.example_kwargs)
    return {"loss": total, "grads": grads, "norm": norm, "state": {k: v.clone() for k, v in model.state_dict().items()},
            "eval": output}


def tp_worker(rank: int, world: int, *, spec: str, stages: int, tp: int, out: str, microbatches: int = 2,
              checkpoint_to: str | None = None, **options: Any) -> None:
    """One rank of (world / stages / tp) replicas of a ``stages`` x ``tp`` pipeline: one step on its replica's
    rows; the loss, every gradient gathered whole, and how much of each split weight it holds; the global
    gradient norm; after an SGD step the state dict (rank 0) and the eval-mode output, saved to ``checkpoint_to``
    too; whether the plan runs sequence parallelism, and how many of its gathers and scatters this rank's stage
    programs hold."""
    b = build(spec, seed=0)
    numel = {n: p.numel() for n, p in b.model.named_parameters()}
    pipe = partition(b.model, stages=stages, tensor_parallel=tp, microbatches=microbatches, loss_fn=b.loss_fn,
                     timeout=60, timing="analytic", **options)
    x, y = b.example_args[0], b.target
    share = x.shape[0] // pipe.dp_size
    rows = slice(pipe.dp_rank * share, (pipe.dp_rank + 1) * share)
    loss = pipe.step(x[rows], target=y[rows]).detach()
    params = dict(pipe.named_parameters())
    stage_programs = [sp.gm for sp in pipe._engines[True].split.stages.values()]  # this rank's, as split
    res = {"loss": loss, "tp_rank": pipe.tp_rank, "pp_rank": pipe.pp_rank, "dp_rank": pipe.dp_rank,
           "sequence_parallel": pipe.plan.sequence_parallel,
           "sequence_collectives": sum(n.op == "call_module" and str(n.target).startswith("smp_sequence_")
                                       for gm in stage_programs for n in gm.graph.nodes),
           "recompute": list(pipe.plan.recompute),
           "grads": {n: whole(p.grad).clone() for n, p in params.items() if p.grad is not None},
           "held": {n: local(p).numel() for n, p in params.items()}, "whole": {n: numel[n] for n in params},
           "split": sorted(n for n, p in params.items() if split_over_tp(p)),
           "meshes": {n: p.device_mesh.mesh_dim_names if hasattr(p, "device_mesh") else () for n, p in params.items()},
           "memory": pipe.memory_stats()[pipe.pp_rank],
           "tp_share_bytes": sum((numel[n] // tp if split_over_tp(p) else numel[n]) * p.element_size()
                                 for n, p in params.items())}
    res["norm"] = pipe.clip_grad_norm_(float("inf"))  # the norm, unclipped
    opt = sgd(pipe.parameters())
    opt.step()
    res["state"] = pipe.state_dict()
    pipe.eval()
    res["eval"], res["rows"] = pipe(x[rows]), rows  # the output stage's ranks: their replica's rows
    if checkpoint_to is not None:
        pipe.save_checkpoint(checkpoint_to, opt)
    torch.save(res, Path(out) / f"tp-{rank}.pt")


def load_worker(rank: int, world: int, *, spec: str, stages: int, tp: int, checkpoint_from: str, out: str,
                **options: Any) -> None:
    """One rank of a fresh ``stages`` x ``tp`` pipeline (another seed) loading ``checkpoint_from`` with its SGD
    state: the state dict (rank 0) and each parameter's momentum gathered whole."""
    b = build(spec, seed=1)
    pipe = partition(b.model, stages=stages, tensor_parallel=tp, microbatches=2, loss_fn=b.loss_fn, timeout=60,
                     timing="analytic", **options)
    pipe.prepare(b.example_args[0])
    opt = sgd(pipe.parameters())
    pipe.load_checkpoint(checkpoint_from, opt)
    momentum = {n: whole(opt.state[p]["momentum_buffer"]).clone() for n, p in pipe.named_parameters()}
    torch.save({"state": pipe.state_dict(), "momentum": momentum}, Path(out) / f"load-{rank}.pt")
