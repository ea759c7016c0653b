"""What a rank holds, in bytes, counted exactly: parameters, gradients, optimizer state, buffers, activations."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from runtime.sharding import WorkingBytes, local

__all__ = ["rank_memory", "AllocationMeter", "OptimizerStepMeter"]


class AllocationMeter(TorchDispatchMode):
    """Bytes of tensor storage that ops under this mode create, while they live, and their peak.

    An op's result is new unless it shares storage with one of the op's inputs (views and
    in-place results are not counted); a new storage is counted until the tensor the op
    returned is freed. That is what a device allocator would be asked for, without one (on
    CPU), except where a view outlives the tensor it was taken from: the storage is then
    counted as freed early, and the meter reads low.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # a sharded tensor (DTensor: a sharded optimizer's step) is seen whole here; its storage is its local shard's
        inputs = {local(t).untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = local(t).untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in inputs or ptr in self._alive:
                continue
            self._alive.add(ptr)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._freed, ptr, storage.nbytes())
        return out

    def _freed(self, ptr: int, nbytes: int) -> None:
        if ptr in self._alive:
            self._alive.discard(ptr)
            self.live -= nbytes


class OptimizerStepMeter:
    """The peak bytes ``optimizer.step()`` allocates beyond what it keeps: its workspace, metered on every
    step from now on (``peak``: the last step's; state an optimizer creates on its first
    step is counted there, later steps see only the workspace). ``close()`` stops it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.peak = 0
        self.steps = 0
        self._meter: AllocationMeter | None = None
        self._hooks = [optimizer.register_step_pre_hook(self._start), optimizer.register_step_post_hook(self._stop)]

    def _start(self, *_: Any) -> None:
        self._meter = AllocationMeter()
        self._meter.__enter__()

    def _stop(self, *_: Any) -> None:
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self.peak, self.steps, self._meter = self._meter.peak, self.steps + 1, None

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _bytes(t: torch.Tensor) -> int:
    """What ``t`` takes on this rank: a DTensor (sharded over the replicas) its local shard."""
    t = local(t)
    return t.numel() * t.element_size()


def rank_memory(model: nn.Module, ownership: Any, rank: int, optimizer: torch.optim.Optimizer | None,
                activations_peak: int, step_meter: OptimizerStepMeter | None = None,
                working: WorkingBytes | None = None, buckets: int = 0) -> dict[str, int]:
    """Bytes rank ``rank`` holds: its parameters, their gradients and optimizer state, its buffers, and
    ``activations_peak`` (the engine's stash meter); with ``step_meter`` the optimizer step's
    workspace, which comes after the stashed activations are gone, so the total holds the
    larger of the two (as the plan counts it); on a GPU also the allocator's peak.

    Under sharding, ``working`` is what the step held whole beside its shards at its peak
    (``gathered_peak``: all-gathered parameters, ``whole_grads_peak``: the unsharded gradients
    before the reduce-scatter), freed before the optimizer's step: the total counts it with the
    activations. Plain data parallelism's all-reduce ``buckets`` (flat copies of the gradients,
    alive to the step's end) count with the state.
    """
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
    if buckets:
        out["buckets"] = int(buckets)
    if working is not None:
        out["gathered_peak"], out["whole_grads_peak"] = int(working.gathered), int(working.gradients)
    if step_meter is not None:
        out["optimizer_step_peak"] = int(step_meter.peak)
    computing = out["activations_peak"] + out.get("gathered_peak", 0) + out.get("whole_grads_peak", 0)
    out["total"] = (out["params"] + out["grads"] + out["optimizer"] + out["buffers"] + out.get("buckets", 0)
                    + max(computing, out.get("optimizer_step_peak", 0)))
    device = params[0].device if params else torch.device("cpu")
    if device.type == "cuda":
        out["cuda_max_allocated"] = int(torch.cuda.max_memory_allocated(device))
    return out
