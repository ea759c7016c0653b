"""The batch of one step cut into microbatches, and the microbatches' outputs joined back into one batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.microbatch import split_microbatches
from partitioner.trace import flatten_inputs

__all__ = ["split_batch", "concat_outputs"]


def concat_outputs(outputs: list[Any]) -> Any:
    """Microbatch outputs back into one batch: tensors with a batch dimension are concatenated along dim 0."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    leaves0, spec = flat[0]
    merged = []
    for i, leaf in enumerate(leaves0):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            merged.append(torch.cat([f[0][i] for f in flat], dim=0))
        else:
            merged.append(leaf)
    return pytree.tree_unflatten(merged, spec)


def split_batch(gm_like: Any, args: Sequence[Any], kwargs: Mapping[str, Any], m: int) -> list[list[Any]]:
    """The flat placeholder values of each of ``m`` microbatches."""
    return [flatten_inputs(gm_like, a, k) for a, k in split_microbatches(args, kwargs, m)]
