"""What a rank keeps between a microbatch's forward and its backward, and the meter that counts those bytes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.recompute import Rerun
from runtime.sharding import local

__all__ = ["EdgeKey", "Stash", "StashMeter"]

EdgeKey = tuple[int, int, str]  # a cut edge's key (partitioner.ir.Edge.key): source stage, destination stage, tensor


@dataclass
class Stash:
    """What one (stage, microbatch) keeps between its forward and its backward."""

    inputs: dict[EdgeKey, list[torch.Tensor | None]]   # leaf tensors received per in-edge
    outputs: dict[EdgeKey, list[torch.Tensor]]         # tensors sent per out-edge
    loss: torch.Tensor | None = None
    rerun: Rerun | None = None                         # a recomputing stage: how to run its forward again
    received: dict[EdgeKey, list[torch.Tensor]] = field(default_factory=dict)  # what it ran on (for the rerun)
    roots: list[torch.Tensor] = field(default_factory=list)      # backward roots (kept for a split W)
    root_grads: list[torch.Tensor] = field(default_factory=list)


class StashMeter:
    """The bytes of activations a rank keeps between forward and backward, counted exactly.

    Every storage autograd saves for the backward (``saved_tensors_hooks``), and the
    received inputs and sent outputs the engine keeps, each storage once per
    (stage, microbatch), parameters excluded; released at the microbatch's last backward
    action. ``peak`` is the most held at once during the step (a recomputing stage's
    rerun included), ``kept`` per stage what one microbatch keeps from its forward.
    """

    def __init__(self, exclude: set[int], excluded_now: Callable[[int], bool] | None = None) -> None:
        self.exclude = exclude  # data pointers of this rank's parameter, buffer and batch storages
        # a storage that is no activation while it lives (FSDP's gathered parameters: freed and reallocated
        # each microbatch under full_shard, so their old addresses come back as activations' addresses)
        self.excluded_now = excluded_now
        self.live: dict[tuple[int, int], dict[int, int]] = {}
        self.current = 0
        self.peak = 0
        self.kept: dict[int, int] = {}  # stage -> most bytes one microbatch kept from its forward to its backward

    def forward_done(self, key: tuple[int, int]) -> None:
        """Note what ``key``'s forward left kept (the plan's ``activations`` of the stage)."""
        self.kept[key[0]] = max(self.kept.get(key[0], 0), sum(self.live.get(key, {}).values()))

    def add(self, key: tuple[int, int], t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return
        storage = local(t).untyped_storage()  # a DTensor (tensor parallel) saves its local shard
        ptr = storage.data_ptr()
        held = self.live.setdefault(key, {})
        if ptr in held or self.is_excluded(ptr):
            return
        held[ptr] = storage.nbytes()
        self.current += held[ptr]
        self.peak = max(self.peak, self.current)

    def is_excluded(self, ptr: int) -> bool:
        """Whether the storage at ``ptr`` is not an activation (a parameter, buffer or batch storage now)."""
        return ptr in self.exclude or (self.excluded_now is not None and self.excluded_now(ptr))

    def release(self, key: tuple[int, int]) -> None:
        self.current -= sum(self.live.pop(key, {}).values())

    def saving(self, key: tuple[int, int]) -> Any:
        """A context in which autograd's saved tensors are counted for ``key``."""
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.add(key, t)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
