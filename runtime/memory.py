"""What a rank holds, in bytes, counted exactly: parameters, gradients, optimizer state, buffers, activations."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["rank_memory"]


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def rank_memory(model: nn.Module, ownership: Any, rank: int, optimizer: torch.optim.Optimizer | None,
                activations_peak: int) -> dict[str, int]:
    """Bytes rank ``rank`` holds: its parameters, their gradients and optimizer state, its buffers, and
    ``activations_peak`` (the engine's stash meter); on a GPU also the allocator's peak."""
    held = {i for i, ranks in ownership.holders.items() if rank in ranks}
    params = [p for p in model.parameters() if id(p) in held and not p.is_meta]
    buffers = [b for b in model.buffers() if id(b) in held and not b.is_meta]
    optim = 0
    if optimizer is not None:
        for p in params:
            optim += sum(_bytes(v) for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    out = {
        "params": sum(_bytes(p) for p in params),
        "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": optim,
        "buffers": sum(_bytes(b) for b in buffers),
        "activations_peak": int(activations_peak),
    }
    out["total"] = sum(out.values())
    device = params[0].device if params else torch.device("cpu")
    if device.type == "cuda":
        out["cuda_max_allocated"] = int(torch.cuda.max_memory_allocated(device))
    return out
