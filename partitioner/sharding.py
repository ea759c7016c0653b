"""Sharded data parallelism's modes: what a stage's replicas split among themselves (torch FSDP2's semantics).

- ``none``: every replica holds the stage's whole parameters, gradients and optimizer state;
  the gradients are all-reduced once a step (plain data parallelism).
- ``shard_grad_op``: optimizer state and gradients are sharded over the replicas (ZeRO-2);
  parameters are all-gathered once a step and kept through its microbatches, the gradients
  reduce-scattered after the last one (FSDP2's ``reshard_after_forward=False``).
- ``full_shard``: parameters are sharded too (ZeRO-3), all-gathered for each microbatch's
  forward and backward and freed after each use (``reshard_after_forward=True``).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020;
Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023.
"""

from __future__ import annotations

__all__ = ["SHARDING_MODES", "check_sharding"]

#: The modes a plan can run under, least sharded first.
SHARDING_MODES = ("none", "shard_grad_op", "full_shard")


def check_sharding(mode: str, data_parallel: int) -> str:
    """``mode`` if a plan with ``data_parallel`` replicas can run under it; ValueError naming the fix if not."""
    if mode not in SHARDING_MODES:
        raise ValueError(f"unknown sharding {mode!r}; use one of {', '.join(SHARDING_MODES)} (or 'auto' to plan it)")
    if mode != "none" and data_parallel < 2:
        raise ValueError(f"sharding={mode!r} splits a stage's state over its data-parallel replicas, and this plan "
                         "has one (data_parallel=1); use more ranks than stages, or sharding='none'")
    return mode
