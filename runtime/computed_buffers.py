"""Buffers a meta-built model holds no values for and no checkpoint has: rebuilt from their module's config, or refused by name.

A non-persistent buffer (a rotary embedding's ``inv_freq``) is computed by its module's
constructor and saved in no checkpoint; built under ``torch.device("meta")`` it has no
values. A Hugging Face module that owns such buffers and no weights (every rotary
embedding class) is constructed again from its ``config`` and its buffers copied; any
other module's initializer must set them, which is checked.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["rebuilt_from_config", "was_set", "unrecoverable"]


def rebuilt_from_config(module: nn.Module, buffers: dict[str, torch.Tensor]) -> nn.Module | str:
    """``module`` built again by its class from its own ``config`` (on the CPU), holding ``buffers`` (key: the
    model's tensor) with their shapes; else why not, in words."""
    config = getattr(module, "config", None)
    if config is None:
        return "it has no config to build it again from"
    if next(module.parameters(), None) is not None:
        return "it holds weights, so smp does not build it again from its config"
    try:
        # The CPU, as where a model is normally built: the values are the bits such a model holds.
        with torch.device("cpu"), torch.no_grad():
            fresh = type(module)(config)
    except Exception as err:  # noqa: BLE001 - any failure means only that this way is closed
        return f"building {type(module).__name__}(config) again failed ({type(err).__name__}: {err})"
    for key, held in buffers.items():
        value = fresh._buffers.get(key)
        if value is None or value.is_meta or value.shape != held.shape:
            got = "no such buffer" if value is None else f"shape {tuple(value.shape)}"
            return f"building it again from its config gives {got} for {key!r}, the model's is {tuple(held.shape)}"
    return fresh


def was_set(module: nn.Module, key: str, tensor: torch.Tensor, version: int) -> bool:
    """Whether an initializer gave ``module``'s buffer ``key`` (``tensor``, at ``version`` before) values: written in
    place, or re-created (then its values are copied into ``tensor``, which the traced programs hold, and it is put
    back)."""
    current = module._buffers.get(key)
    if current is tensor:
        return tensor._version != version
    module._buffers[key] = tensor
    if current is None or current.is_meta or current.shape != tensor.shape:
        return False
    with torch.no_grad():
        tensor.copy_(current)
    return True


def unrecoverable(name: str, module_path: str, module: nn.Module, why: str, checkpoint: str | None) -> str:
    """The message for a buffer built on the meta device that nothing gives values: it, its module, the two fixes."""
    kind = type(module).__name__
    where = (f"it is not in the checkpoint {checkpoint} (a non-persistent buffer is in none)" if checkpoint
             else "no checkpoint was given")
    return (f"buffer {name!r} of module {module_path or '(root)'!r} ({kind}) was built on the meta device and has no "
            f"values: {where}, and smp cannot compute it ({why}). Either build the model under "
            f"smp.delay_param_initialization() (parameters on the meta device, buffers keep the values their "
            f"constructor computed), or give its value with init_fn=... (called with the {kind} module: set "
            f"module.{name.rsplit('.', 1)[-1]} in place)")
