"""Gloo rank workers for tests/test_sequence_parallel.py: new sequence lengths, the activations a rank holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.sharding import gather_whole as whole
from smp.models import build
from smp.partition import partition


def lengths_worker(rank: int, world: int, *, out: str, lengths: list[int], sequence_parallel: Any) -> None:
    """The zoo GPT at T 2 (one stage), a step on each sequence length in turn: loss and gradients, or the error."""
    b = build("gpt:size=tiny,batch=4", seed=0)
    pipe = partition(b.model, stages=1, tensor_parallel=2, microbatches=2, loss_fn=b.loss_fn, timeout=30,
                     timing="analytic", sequence_parallel=sequence_parallel)
    x, y = b.example_args[0], b.target
    runs: dict[int, Any] = {}
    for s in lengths:
        for p in pipe.parameters():
            p.grad = None
        try:
            loss = pipe.step(x[:, :s].contiguous(), target=y[:, :s].contiguous()).detach()
        except Exception as err:  # noqa: BLE001
            runs[s] = {"error": f"{type(err).__name__}: {err}"}
            break
        runs[s] = {"loss": loss, "grads": {n: whole(p.grad).clone() for n, p in pipe.named_parameters()
                                           if p.grad is not None}}
    torch.save({"runs": runs, "sequence_parallel": pipe.plan.sequence_parallel}, Path(out) / f"r{rank}.pt")


def memory_worker(rank: int, world: int, *, out: str, spec: str, sequence_parallel: Any) -> None:
    """A P 2 x T 2 pipeline, one microbatch in flight: the stashed activations' peak measured and predicted."""
    b = build(spec, seed=0)
    pipe = partition(b.model, stages=2, tensor_parallel=2, microbatches=2, loss_fn=b.loss_fn, timeout=60,
                     timing="analytic", sequence_parallel=sequence_parallel, schedule="gpipe", active_microbatches=1)
    pipe.step(b.example_args[0], target=b.target)
    torch.save({"sequence_parallel": pipe.plan.sequence_parallel,
                "measured": pipe.memory_stats()[pipe.pp_rank]["activations_peak"],
                "predicted": pipe.plan.simulated.peak_activation_bytes_per_rank[pipe.pp_rank]},
               Path(out) / f"r{rank}.pt")
