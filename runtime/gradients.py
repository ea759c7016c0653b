"""Gradients across the ranks of a pipeline: the global norm that clipping needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["global_grad_norm"]


def global_grad_norm(grads: Sequence[torch.Tensor], norm_type: float, groups: Sequence[Any] = ()) -> torch.Tensor:
    """The ``norm_type``-norm of every gradient of the pipeline, each counted once, on every rank (float32).

    ``grads`` are this rank's share (a tensor several ranks hold is given by one of
    them; a sharded one by its local shard); the shares are combined by an all-reduce
    over each process group of ``groups`` in turn (the replicas' when the gradients are
    sharded over them, then the pipeline's): the sum of ``|g|^p`` for a p-norm, the
    maximum for ``inf``.
    """
    inf = norm_type == float("inf")
    device = grads[0].device if grads else torch.device("cpu")
    if grads:
        norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type).to(device) for g in grads])
        local = norms.max() if inf else norms.pow(norm_type).sum()
    else:
        local = torch.zeros((), device=device)
    if groups:
        local = local.clone()
    for group in groups:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    return local if inf else local.pow(1.0 / norm_type)
