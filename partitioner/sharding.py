"""Sharded data parallelism's modes: what a stage's replicas split among themselves, and what each rank holds.

- ``none``: every replica holds the stage's whole parameters, gradients and optimizer state;
  the gradients are all-reduced once a step (plain data parallelism).
- ``shard_grad_op``: optimizer state and gradients are sharded over the replicas (ZeRO-2);
  parameters are all-gathered once a step and kept through its microbatches, the gradients
  reduce-scattered after the last one (FSDP2's ``reshard_after_forward=False``).
- ``full_shard``: parameters are sharded too (ZeRO-3), all-gathered for each microbatch's
  forward and backward and freed after each use (``reshard_after_forward=True``).

The memory each mode holds per rank is :func:`state_bytes`, the one formula the planner
counts (docs/sharding.md); the collectives each mode adds are priced by
:class:`~partitioner.cluster.Link` (ring all-gather and reduce-scatter) on the replicas' link.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020;
Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SHARDING_MODES", "StateBytes", "check_sharding", "check_backward", "state_bytes", "PARAMETER_BYTES", "GRADIENT_BYTES",
           "OPTIMIZER_BYTES"]

#: The modes a plan can run under, least sharded first.
SHARDING_MODES = ("none", "shard_grad_op", "full_shard")

# Bytes a training rank keeps per byte of parameters it updates, everything in the parameters'
# stored dtype (fp32 training, or mixed precision's fp32 master copy: 4 + 4 + 8 = 16 bytes per
# parameter under AdamW): the weights, their gradients and AdamW's two moments.
PARAMETER_BYTES = 1.0
GRADIENT_BYTES = 1.0
OPTIMIZER_BYTES = 2.0


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds per byte of its stage's parameters under a sharding mode, by what they are and when.

    Held the whole step: ``parameters``, ``gradients``, ``optimizer`` (its shards, or the whole)
    and ``buckets`` (plain data parallelism's flat gradient buckets, alive from their
    all-reduce's launch to the step's end: runtime/engine.py). Held only while the stage's
    microbatches run, not at the optimizer's step: ``gathered`` (the all-gathered parameters)
    and ``unsharded_gradients`` (the whole gradients the microbatches accumulate until the
    reduce-scatter after the last one: FSDP2 syncs gradients on the last microbatch only
    under pipelining, torch.distributed.pipelining does the same). ``workspace``: what the
    optimizer's step allocates, over the parameters it updates.
    """

    parameters: float
    gradients: float
    optimizer: float
    buckets: float
    gathered: float
    unsharded_gradients: float
    workspace: float

    @property
    def state(self) -> float:
        """Held the whole step (the planner's ``state_factor``)."""
        return self.parameters + self.gradients + self.optimizer + self.buckets

    @property
    def working(self) -> float:
        """Held while the stage computes, freed before the optimizer's step (the planner's ``working_factor``)."""
        return self.gathered + self.unsharded_gradients


def state_bytes(mode: str, data_parallel: int, workspace: float, stages_per_rank: int = 1) -> StateBytes:
    """What a rank of a ``data_parallel``-replica plan holds per parameter byte under ``mode`` (``workspace``: the
    unsharded optimizer step's, per parameter byte).

    With D replicas: ``none`` holds everything whole, plus the gradient buckets when D > 1;
    ``shard_grad_op`` and ``full_shard`` hold 1/D of the parameters, gradients and optimizer
    state, and while the stage computes its parameters gathered whole and its unsharded
    gradients. ``shard_grad_op`` keeps the gathered parameters through the step; ``full_shard``
    gathers one stage (its FSDP unit) at a time, so a rank holding ``stages_per_rank``
    interleaved stages holds one of them gathered (counted as 1/v of each stage's parameters).
    """
    check_sharding(mode, data_parallel)
    if mode == "none":
        return StateBytes(PARAMETER_BYTES, GRADIENT_BYTES, OPTIMIZER_BYTES,
                          GRADIENT_BYTES if data_parallel > 1 else 0.0, 0.0, 0.0, workspace)
    d = float(data_parallel)
    gathered = PARAMETER_BYTES if mode == "shard_grad_op" else PARAMETER_BYTES / stages_per_rank
    return StateBytes(PARAMETER_BYTES / d, GRADIENT_BYTES / d, OPTIMIZER_BYTES / d, 0.0, gathered, GRADIENT_BYTES,
                      workspace / d)


def check_backward(mode: str, schedule: str, split_backward: bool) -> None:
    """ValueError when ``mode`` shards and ``schedule`` splits its backward into B and W (zero-bubble): FSDP2's
    hooks gather and reduce around one backward per microbatch, not two halves of it."""
    if mode not in ("none", "auto") and split_backward:
        raise ValueError(f"schedule {schedule!r} splits the backward (B, then W), which FSDP2's hooks do not follow: "
                         f"sharding={mode!r} runs under gpipe, 1f1b or interleaved; or use sharding='none'")


def check_sharding(mode: str, data_parallel: int) -> str:
    """``mode`` if a plan with ``data_parallel`` replicas can run under it; ValueError naming the fix if not."""
    if mode not in SHARDING_MODES:
        raise ValueError(f"unknown sharding {mode!r}; use one of {', '.join(SHARDING_MODES)} (or 'auto' to plan it)")
    if mode != "none" and data_parallel < 2:
        raise ValueError(f"sharding={mode!r} splits a stage's state over its data-parallel replicas, and this plan "
                         "has one (data_parallel=1); use more ranks than stages, or sharding='none'")
    return mode
