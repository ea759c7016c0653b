"""A step's batch cut into microbatches (inputs and target), and the microbatches' outputs joined: the one place."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.microbatch import MicrobatchError, split_microbatches
from partitioner.program import flatten_inputs

__all__ = ["Microbatches", "join_outputs"]


@dataclass(frozen=True)
class Microbatches:
    """One step's microbatches: each one's model inputs ``(args, kwargs)`` and, when given, each one's target.

    :meth:`cut` makes them from a whole batch (what ``PipelinedModel.step`` and ``pipe(x)``
    are given); a caller that already holds its microbatches (SMP v1's ``@smp.step``, which
    runs the user's step function once per microbatch) builds them directly.
    """

    inputs: tuple[tuple[tuple, dict], ...]
    targets: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        if not self.inputs:
            raise MicrobatchError("a step needs at least one microbatch")
        if self.targets is not None and len(self.targets) != len(self.inputs):
            raise MicrobatchError(f"{len(self.targets)} targets for {len(self.inputs)} microbatches")

    @classmethod
    def cut(cls, args: Sequence[Any], kwargs: Mapping[str, Any] | None, m: int, target: Any = None) -> Microbatches:
        """``m`` equal slices of the batch along dim 0 (partitioner.microbatch's rule), the target sliced alike."""
        inputs = split_microbatches(args, kwargs, m)
        targets = None
        if target is not None:  # without one, loss_fn(output, None) (e.g. a loss that is the output's mean)
            try:
                targets = tuple(piece[0][0] for piece in split_microbatches((target,), None, m))
            except MicrobatchError as err:
                raise MicrobatchError(f"the target cannot be split like the batch: {err}") from None
        return cls(tuple(inputs), targets)

    def __len__(self) -> int:
        return len(self.inputs)

    def flat(self, gm_like: Any) -> list[list[Any]]:
        """Each microbatch's flat placeholder values for the traced program ``gm_like``."""
        return [flatten_inputs(gm_like, args, kwargs) for args, kwargs in self.inputs]


def join_outputs(outputs: list[Any]) -> Any:
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
