"""``smp.amp.GradScaler``: torch's GradScaler, with every rank of the pipeline agreeing on whether to skip a step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from runtime.comm import Comm
from smp.v1.model import DistributedModel
from smp.v1.state import current

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """torch's ``GradScaler`` for a pipelined model (v1's ``smp.amp.GradScaler``).

    The loss is scaled on the rank holding the model's output (``model.backward(scaler.scale(loss))``
    inside the step function), so the other ranks start their scale from ``init_scale`` on
    first use. Each rank finds infs/NaNs only in its own stages' gradients; ``unscale_``
    takes the maximum over all ranks, so every rank skips the same steps and keeps the same
    scale. ``device`` defaults to "cuda" with a GPU, else "cpu".
    """

    def __init__(self, device: str | None = None, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        super().__init__(device or ("cuda" if torch.cuda.is_available() else "cpu"), init_scale=init_scale,
                         growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)

    def _ensure_scale(self) -> None:
        if self._enabled and self._scale is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self._device == "cuda" \
                else torch.device(self._device)
            self._lazy_init_scale_growth_tracker(device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._ensure_scale()
        super().unscale_(optimizer)
        if not self._enabled:
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        agreed = _any_rank(max((float(v.item()) for v in found.values()), default=0.0))
        for v in found.values():
            v.fill_(agreed)
        if not found:  # this rank's optimizer has no gradient at all; it still follows the others
            assert self._scale is not None
            found[self._scale.device] = torch.full((), agreed, device=self._scale.device)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        self._ensure_scale()
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self._ensure_scale()
        super().update(new_scale)


def _any_rank(found: float) -> float:
    """The largest ``found`` over every rank: the pipeline's own bounded agreement (``PipelinedModel.any_rank``),
    or, before the model is partitioned, the same bounded all-reduce over smp.init's group."""
    st = current()
    model = st.model
    flag = torch.tensor([found])
    if isinstance(model, DistributedModel) and model.pipe is not None:
        return float(model.pipe.any_rank(flag))
    if not st.distributed:
        return found
    comm = Comm(st.topology.rank, st.config.timeout)
    return float(comm.wait(comm.all_reduce(flag, st.group, "the fp16 overflow check over every rank",
                                           op=dist.ReduceOp.MAX))[0])
