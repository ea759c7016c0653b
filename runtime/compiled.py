"""Compiled stages: each stage program wrapped in ``torch.compile`` for a plan priced for it (docs/runtime.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from runtime.errors import RuntimeConfigError
from runtime.split import StageProgram

__all__ = ["compile_stages"]


def compile_stages(stages: Mapping[int, StageProgram], recompute: Sequence[str], backend: str, *,
                   split_backward: bool, sharded: bool) -> dict[int, nn.Module]:
    """Stage -> its program compiled with ``torch.compile(backend=backend, dynamic=False)``.

    The microbatch shape is fixed by the plan, so each stage compiles for it once (a batch of
    another shape compiles again). The backward is AOTAutograd's, compiled with the forward.
    A stage that recomputes selectively is left out (it runs eagerly): its replay runs the
    program op by op under torch's selective checkpointing modes, which a compiled graph does
    not go through. Compiled, a stage's backward is one graph: a schedule that splits it into
    B and W, and FSDP2's hooks around it, are refused.
    """
    if split_backward:
        raise RuntimeConfigError("compiled stages run each backward as one graph, which cannot be split into B and "
                                 "W: run this plan under gpipe, 1f1b or interleaved, or without compile")
    if sharded:
        raise RuntimeConfigError("compiled stages run unsharded: re-plan with sharding='none', or without compile")
    compiled: dict[int, nn.Module] = {}
    for s, sp in stages.items():
        if recompute and recompute[s] == "selective":
            continue
        compiled[s] = torch.compile(sp.gm, backend=backend, dynamic=False)  # type: ignore[assignment]
    return compiled
