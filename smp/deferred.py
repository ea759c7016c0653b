"""Build a model without allocating its weights: ``smp.delay_param_initialization()`` (SMP v1's name)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["delay_param_initialization"]


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Inside the block, every parameter a module registers goes to the meta device; buffers stay real.

    For model code that cannot be changed to build under ``torch.device("meta")``: the
    model takes no memory for its weights (a constructor still allocates each parameter
    briefly before it moves, so the peak is the largest one, not the model), traces and
    plans, and ``smp.partition`` then materializes only each rank's stages, from
    ``checkpoint=`` or with each module's ``reset_parameters()``. Buffers (rotary
    frequencies, position ids, BatchNorm statistics) keep the values the constructor
    computed, which a checkpoint often does not carry. ``enabled=False`` does nothing, so a
    script can switch it with a flag.
    """
    if not enabled:
        yield
        return
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
