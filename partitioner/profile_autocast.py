"""The profiler's walk under autocast: what a mixed-precision run saves and sends, for a model on any device.

A pipeline that runs ``precision="bf16"`` runs each stage under ``torch.autocast``: matmuls
make bf16 outputs, and autograd saves bf16 activations and the bf16 copy of each fp32 weight
(Micikevicius et al., "Mixed Precision Training", ICLR 2018). A plan made ahead of the run
(``smp plan --dtype bf16``, often on a model built on the meta device) must count those bytes,
not the fp32 ones the model is built in: twice the activations forced recomputation on most
stages of a 70B plan, and twice the bytes on every link.

Autocast has no kernels for the meta device, so a model on meta is walked on fake CPU tensors
(``torch._subclasses.FakeTensorMode``: shapes and dtypes, no storage) under CPU autocast. Its
op lists differ from CUDA's in a few places (CUDA keeps ``softmax``, ``layer_norm`` and a few
reductions in fp32 where CPU autocast runs them in their input's dtype): docs/memory.md.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from partitioner.devices import dtype_key
from partitioner.program import retarget_device

__all__ = ["AUTOCAST_DTYPES", "walk_autocast", "running_autocast", "autocast_walk"]

#: The ``dtype`` names that mean a mixed-precision run, and the dtype autocast makes its matmuls in.
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

_META = torch.device("meta")
_CPU = torch.device("cpu")


def walk_autocast(dtype: str | None, device: torch.device) -> torch.dtype | None:
    """The autocast dtype a walk on ``device`` priced in ``dtype`` enters: None for full precision, and when
    autocast is on there already (a pipeline profiling its stages under its own ``precision``)."""
    low = AUTOCAST_DTYPES.get(dtype or "")
    if low is None or running_autocast(device) is not None:
        return None
    return low


def running_autocast(device: torch.device) -> str | None:
    """The name of the autocast dtype already on for ``device`` (``"bf16"``), or None (none on; meta has none)."""
    if device.type == "meta" or not torch.is_autocast_enabled(device.type):
        return None
    return dtype_key(torch.get_autocast_dtype(device.type))


@contextlib.contextmanager
def autocast_walk(gm: fx.GraphModule, inputs: list, device: torch.device,
                  low: torch.dtype) -> Iterator[tuple[fx.GraphModule, list]]:
    """``gm`` and its flat ``inputs`` to walk under autocast in ``low`` on ``device``: themselves on a real device;
    on meta a copy on fake CPU tensors (the caller's program, its weights and its fingerprint stay as traced)."""
    if device.type != "meta":
        with torch.autocast(device.type, dtype=low):
            yield gm, inputs
        return
    with warnings.catch_warnings():  # torch.export's pytree specs warn about their own deprecated class when copied
        warnings.simplefilter("ignore", FutureWarning)
        fake_gm = copy.deepcopy(gm)
    _constants_as_attributes(fake_gm, gm)
    retarget_device(fake_gm, _META, _CPU)  # positions and masks the program makes "on the model's device"
    with FakeTensorMode(allow_non_fake_inputs=True):
        _fake_state(fake_gm)
        fake_inputs = [_fake(x) if isinstance(x, torch.Tensor) else x for x in inputs]
        with torch.autocast("cpu", dtype=low):
            yield fake_gm, fake_inputs


def _constants_as_attributes(copied: nn.Module, original: nn.Module) -> None:
    """Tensor constants the program reads (``get_attr``) back to plain attributes: copying a GraphModule registers
    them as buffers, which the walk would take for state, not for the values an op saves."""
    buffers = {name for name, _ in original.named_buffers(remove_duplicate=False)}
    for prefix, module in copied.named_modules(remove_duplicate=False):
        for name in [n for n in module._buffers if (f"{prefix}.{n}" if prefix else n) not in buffers]:
            value = module._buffers.pop(name)
            setattr(module, name, value)


def _fake(t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor like ``t`` (shape, strides, dtype, gradient need); call under a FakeTensorMode."""
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_CPU)
    return fake.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else fake


def _fake_state(gm: nn.Module) -> None:
    """Every parameter, buffer and tensor constant of ``gm`` replaced by a fake CPU one; a tensor held in
    several places (tied weights) stays one tensor, so the walk still counts it once."""
    made: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = nn.Parameter(_fake(t.detach()), requires_grad=t.requires_grad) \
                if isinstance(t, nn.Parameter) else _fake(t.detach())
        return made[id(t)]

    for module in gm.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = fake_of(p)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake_of(b)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):  # tensor constants (torch.export's lifted ones, fx's)
                setattr(module, name, fake_of(value))
