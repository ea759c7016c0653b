"""Mixed precision for a pipeline: each stage's forward under autocast, and a loss scaler that agrees across ranks.

``precision="bf16"`` or ``"fp16"`` runs every stage's forward (and its recomputation) under
``torch.autocast`` of that dtype on the stage's device; parameters and their gradients stay
in the model's dtype (fp32 master weights: autocast casts a weight for each op that wants
the low precision, and autograd returns the gradient in the parameter's dtype). A cut
tensor crosses the link in the dtype autocast made it in (bf16 on the wire when the op
that made it ran in bf16). ``"fp32"`` runs the model as it is.

fp16's narrow range needs loss scaling (Micikevicius et al., "Mixed Precision Training",
ICLR 2018): :class:`PipelineGradScaler` is torch's dynamic ``GradScaler`` for a pipeline,
whose gradients live on several ranks: the loss is multiplied by ``scale`` before the
backward, every rank unscales its own gradients, and one all-reduce (MAX) of a found-inf
flag over every rank of the world (each pipeline rank and data-parallel replica) decides
together whether the step is taken, so an overflow on any rank skips the optimizer step on
all of them. A skipped step halves the scale; ``growth_interval`` good steps in a row
double it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from partitioner.devices import DTYPE_ALIASES
from partitioner.profile_autocast import AUTOCAST_DTYPES

__all__ = ["PRECISIONS", "Precision", "PipelineGradScaler"]

#: What ``precision=`` accepts, and the autocast dtype of each (None: no autocast).
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, **AUTOCAST_DTYPES}


@dataclass(frozen=True)
class Precision:
    """The precision a pipeline's stages run in."""

    name: str

    @staticmethod
    def parse(value: str | None) -> Precision:
        key = str(value).strip().lower() if value is not None else "fp32"
        key = DTYPE_ALIASES.get(key, key)
        if key not in PRECISIONS:
            raise ValueError(f"unknown precision {value!r}; choose one of {', '.join(PRECISIONS)}")
        return Precision(key)

    @property
    def dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.name]

    @property
    def needs_scaling(self) -> bool:
        return self.name == "fp16"

    def autocast(self, device: torch.device) -> Any:
        """The context a stage's forward runs in on ``device``."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)


class PipelineGradScaler:
    """Dynamic loss scaling whose skip decision is the same on every rank (see the module docstring).

    ``found_inf`` is a callable that combines this rank's flag with every other rank's
    (the maximum over the world, bounded by the pipeline's timeout); a single process
    passes the identity.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError("PipelineGradScaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                             f"and growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.good_steps = 0
        self.skipped = 0
        self.last_skipped = False

    def unscale_and_check(self, grads: Sequence[torch.Tensor], found_inf: Callable[[torch.Tensor], torch.Tensor]
                          ) -> bool:
        """Divide this rank's ``grads`` by the scale; True when any rank found inf or NaN (then skip the step).

        Updates the scale: halved (``backoff_factor``) on a skip, grown after ``growth_interval`` good steps.
        """
        flag = torch.zeros((), dtype=torch.float32)
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
            if not bool(torch.isfinite(g).all()):
                flag.fill_(1.0)
        skip = bool(found_inf(flag).item() > 0)
        self.last_skipped = skip
        if skip:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        return skip

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped"])
