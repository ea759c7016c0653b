"""Activation offloading at run time: what a stage's forward saves for its backward, copied to host memory and back.

A stage planned with ``recompute="offload"`` (partitioner/recompute.py, docs/memory.md) runs its
forward with autograd, as under ``none``, inside :func:`offloading`: saved-tensor hooks that copy
every tensor autograd saves into host memory (pinned on a GPU, so the copy is a DMA) and copy it
back when the backward reads it, as ``torch.autograd.graph.save_on_cpu`` does. Two differences
from ``save_on_cpu``, each for the plan's accounting:

- what stays on the device anyway is not copied: the stage's parameters and the tensors it
  received (the engine keeps those for the backward), so the stash that leaves the device is
  exactly the activations the stage made;
- on a CPU device the copy is made too (``save_on_cpu`` keeps a CPU tensor as it is): the same
  path runs everywhere, and the copies are counted as the device's memory, which on a CPU they are.

A tensor subclass autograd saves (on a tensor-parallel stage, a DTensor) is taken apart and put
together again by torch's wrapper-subclass protocol (``__tensor_flatten__`` /
``__tensor_unflatten__``): its plain tensors (a DTensor's local shard) are what is copied, or
left in place as above.

The copies run on the current (compute) stream: nothing overlaps them with compute, as the planner
prices them. The values are copied, not changed: losses and gradients equal those without offloading.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["kept_storages", "offloading"]


@dataclass(frozen=True)
class _OnHost:
    """A saved tensor copied to host memory, and the device it goes back to."""

    device: torch.device
    host: torch.Tensor


@dataclass(frozen=True)
class _Subclass:
    """A saved tensor subclass taken apart: its inner values (each tensor packed), as its protocol rebuilds it."""

    cls: type
    inner: dict[str, Any]
    context: Any
    size: torch.Size
    stride: tuple[int, ...]


def offloading(device: torch.device, on_device: Callable[[int], bool],
               count: Callable[[torch.Tensor], None]) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that keep what autograd saves in host memory until the backward reads it.

    ``on_device``: whether the storage at a data pointer stays on the device anyway (left in place, not copied);
    ``count`` is told of every tensor that stays in the device's memory (on a CPU device, the copies)."""
    pin = device.type == "cuda" and torch.cuda.is_available()

    def pack(t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or t.is_meta:
            count(t)
            return t
        if is_traceable_wrapper_subclass(t):
            names, context = t.__tensor_flatten__()
            inner = {n: getattr(t, n) for n in names}  # (a DTensor's include its mesh)
            return _Subclass(type(t), {n: pack(v) if isinstance(v, torch.Tensor) else v for n, v in inner.items()},
                             context, t.size(), t.stride())
        if on_device(t.untyped_storage().data_ptr()):
            count(t)
            return t
        # (no sharing of one copy between two saves of a tensor: a freed tensor's address is reused)
        host = torch.empty_like(t, device="cpu", pin_memory=pin)  # the same strides (dense) as on the device
        host.copy_(t, non_blocking=pin)
        if device.type == "cpu":
            count(host)
        return _OnHost(t.device, host)

    def unpack(packed: Any) -> Any:
        if isinstance(packed, _OnHost):
            return packed.host.to(packed.device, non_blocking=pin)
        if isinstance(packed, _Subclass):
            return packed.cls.__tensor_unflatten__({n: unpack(v) for n, v in packed.inner.items()}, packed.context,
                                                   packed.size, packed.stride)
        return packed  # left on the device (or a subclass's inner value that is no tensor)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def kept_storages(tensors: Collection[Any]) -> set[int]:
    """Data pointers of the storages of ``tensors`` (the received inputs a stage keeps on its device)."""
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and not t.is_meta}
