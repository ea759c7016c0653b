"""PipelinedModel's state across its ranks: the whole state dict, distributed checkpoints, global gradient clipping."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime.checkpoint import CheckpointError, MissingStateError, load_pipeline, merge_partial_states, save_pipeline
from runtime.errors import PipelineError, RuntimeConfigError
from runtime.gradients import global_grad_norm
from runtime.sharding import copy_whole_into, gather_whole, local, storable
from runtime.tensor_parallel import split_over_tp

__all__ = ["PipelineState"]


class PipelineState:
    """The state methods of :class:`smp.partition.PipelinedModel` (a base class of it: they read its layout,
    set-up and plan); each is a collective over the ranks where it says so."""

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state with the original names, on rank 0 ({} on the other ranks).

        A collective: every rank must call it (the first replica's pipeline gathers; the
        replicas hold the same weights; sharded over the replicas or split over the tp ranks,
        each tensor is gathered whole first).
        """
        if not self.distributed:
            return self._whole_state()
        with self._together.collective("state_dict()", "call it on every rank, then save on rank 0"):
            mine = self._whole_state()  # sharded (replicas, tp ranks): gathered whole first, a collective itself
            if not self.layout.is_first_replica or self.layout.tp_rank != 0:
                return {}
            first = self.layout.pp_ranks[0]
            gathered: list[Any] | None = [None] * self.layout.pp_size if self.rank == first else None
            dist.gather_object(mine, gathered, dst=first, group=self.layout.pp_group)
            if self.rank != first:
                return {}
            try:
                return merge_partial_states(gathered or [], list(self.module.state_dict().keys()))
            except MissingStateError as err:
                raise PipelineError(f"state_dict: {err}") from None

    def _whole_state(self) -> dict[str, torch.Tensor]:
        """This rank's tensors of the model state, on the CPU; sharded ones gathered whole (a collective then)."""
        return {k: gather_whole(v).detach().cpu()
                for k, v in self.module.state_dict().items() if isinstance(v, torch.Tensor) and not v.is_meta}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load a full (unpartitioned) state dict: each rank copies the entries it holds (sharded: its shard)."""
        own = self.module.state_dict(keep_vars=True)
        if strict:
            missing = [k for k in own if k not in state_dict]
            unexpected = [k for k in state_dict if k not in own]
            if missing or unexpected:
                raise RuntimeConfigError(f"load_state_dict: missing keys {missing[:5]}, unexpected keys "
                                         f"{unexpected[:5]}; pass strict=False to load a partial state")
        with torch.no_grad():
            for k, t in own.items():
                if k in state_dict and isinstance(t, torch.Tensor) and not t.is_meta:
                    copy_whole_into(t, state_dict[k])

    # ------------------------------------------------------------------ checkpoints

    def _local_state(self, what: str) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
        """This rank's state by original name (tied tensors under each of their names), and its parameters' names."""
        setup = self._require_setup(what)
        state = {k: v for k, v in self.module.state_dict(keep_vars=True).items()
                 if isinstance(v, torch.Tensor) and not v.is_meta}
        names = {i: setup.ownership.canonical[i] for i in setup.ownership.local_ids
                 if i in setup.ownership.canonical}
        return state, names

    def save_checkpoint(self, directory: str | Path, optimizer: torch.optim.Optimizer | None = None, *,
                        step: int | None = None) -> None:
        """Every rank writes its own tensors (and its optimizer's state), in parallel, to one checkpoint directory.

        A collective. Names are the original model's, so the checkpoint loads into a
        pipeline with any stage count (``load_checkpoint``, or ``checkpoint=`` of
        ``smp.partition``) and converts to one file for the unpartitioned model
        (``smp.consolidate_checkpoint``). Written with torch.distributed.checkpoint. Under
        ``precision="fp16"`` the loss scaler's state goes with it, so a resumed run scales as the
        uninterrupted one would. For an exact resume it also records ``step`` (the steps done;
        ``smp.latest_checkpoint`` finds the highest) and each rank's random generators. The
        directory appears only once every rank has written its part: a rank that dies while
        saving leaves no checkpoint under that name (an older one of that name stays whole).
        """
        state, names = self._local_state("save_checkpoint()")
        with self._together.collective("save_checkpoint()", "call it on every rank: each writes its own tensors"):
            save_pipeline(directory, {k: storable(v).detach() for k, v in state.items()}, optimizer, names,
                          scaler_state=self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
                          step=step, device=self.device)

    def load_checkpoint(self, directory: str | Path, optimizer: torch.optim.Optimizer | None = None) -> int | None:
        """Read this rank's tensors (and its parameters' optimizer state) from ``save_checkpoint``'s directory; returns
        the ``step`` it was saved with (None when saved without one).

        The checkpoint may come from any number of stages; each rank reads only its keys. Under
        ``precision="fp16"`` the loss scaler's state is restored where the checkpoint has one
        (saved under fp16); otherwise the scaler keeps its own. Saved by as many ranks as
        there are now, each rank's random generators are put back as they were at the save.
        """
        state, names = self._local_state("load_checkpoint()")
        with self._together.collective("load_checkpoint()", "call it on every rank: each reads its own tensors"):
            try:
                restored = load_pipeline(directory, state, optimizer, names, rank=self.rank,
                                         world_size=self.world_size, device=self.device)
            except CheckpointError as err:
                raise RuntimeConfigError(f"rank {self.rank}: {err}") from None
            if restored.scaler_state is not None and self.grad_scaler is not None:
                self.grad_scaler.load_state_dict(restored.scaler_state)
        return restored.step

    # ------------------------------------------------------------------ gradients

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole pipeline to a global norm, as ``torch.nn.utils.clip_grad_norm_`` would
        on the unpartitioned model; returns that total norm on every rank (a collective). Sharded over the
        replicas, each rank's shards count: their norms are summed over the replicas, then over the stages (and
        split over the tp ranks, over them)."""
        setup = self._require_setup("clip_grad_norm_()")
        # a parameter several ranks hold (a tied weight) counts once, on the lowest of them
        mine = [p for p in self.parameters() if p.grad is not None
                and (not self.distributed or min(setup.ownership.holders.get(id(p), {self.pp_rank})) == self.pp_rank)
                and (self.tp_rank == 0 or split_over_tp(p.grad))]  # a whole one counts once, on tp rank 0
        # unsharded, the replicas' gradients are the same: the pipeline's ranks alone hold all of them once
        groups = ([self.layout.dp_group] if self._plan.sharding != "none" else []) + [self.layout.pp_group] + \
            ([self.layout.tp_group] if self.tp_size > 1 else []) if self.distributed else []  # type: ignore[union-attr]
        with self._together.collective("clip_grad_norm_()", "call it on every rank, after step()"):
            total = global_grad_norm([local(p.grad) for p in mine], float(norm_type), groups)
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                g = local(p.grad)
                g.mul_(clip_coef.to(g.device, g.dtype))
        return total
