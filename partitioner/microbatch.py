"""Split a batch into microbatches along dim 0 (shared by the planner and the runtime)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.checks import whole

__all__ = ["batch_size", "split_microbatches", "MicrobatchError"]


class MicrobatchError(ValueError):
    """The batch cannot be split into the requested microbatches."""


def batch_size(args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> int | None:
    """Dim 0 of the first tensor input with at least one dimension (the batch size)."""
    for leaf in pytree.tree_leaves((tuple(args), dict(kwargs or {}))):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def split_microbatches(args: Sequence[Any], kwargs: Mapping[str, Any] | None,
                       microbatches: int) -> list[tuple[tuple, dict]]:
    """``microbatches`` equal (args, kwargs) slices along dim 0.

    Tensors whose dim 0 is the batch size are sliced; everything else (masks shared by
    the whole batch, scalars, flags) is passed to every microbatch unchanged. The batch
    must divide evenly, so that the mean loss over microbatches equals the batch's.
    """
    whole(microbatches, "microbatches", error=MicrobatchError)
    args, kwargs = tuple(args), dict(kwargs or {})
    size = batch_size(args, kwargs)
    if microbatches == 1:
        return [(args, kwargs)]
    if size is None:
        raise MicrobatchError("no tensor input with a batch dimension to split into microbatches")
    if size % microbatches:
        raise MicrobatchError(
            f"batch size {size} does not divide into {microbatches} microbatches; use a batch size that is a "
            f"multiple of {microbatches} or a microbatch count that divides {size}")
    step = size // microbatches

    def piece(i: int):
        def cut(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == size:
                return leaf.narrow(0, i * step, step)
            return leaf
        return pytree.tree_map(cut, (args, kwargs))

    return [piece(i) for i in range(microbatches)]
