"""Give this rank's parameters and buffers real storage on its device: from a checkpoint, or initialized there.

A model built on the meta device (or under ``smp.delay_param_initialization()``) holds
no weights. After partitioning, each rank materializes only the tensors its stages hold:
it allocates them on its device and fills them from a checkpoint (by name, reading only
those tensors), or runs each owning module's initializer. Tensors are swapped in place
(``torch.utils.swap_tensors``), so every reference to them (the traced programs, an
optimizer made before partitioning) sees the real tensor.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from runtime.checkpoint import WeightSource

__all__ = ["MaterializeError", "materialize", "LocalTensor", "local_tensors", "names_by_id"]


class MaterializeError(ValueError):
    """A tensor cannot be given values (no checkpoint entry, no initializer); the message names it and the fix."""


@dataclass
class LocalTensor:
    """A parameter or buffer this rank holds, where it lives in the model, and all its names."""

    tensor: torch.Tensor
    module_path: str
    module: nn.Module
    names: list[str]
    is_param: bool
    persistent: bool
    was_meta: bool = False


def local_tensors(model: nn.Module, local_ids: set[int]) -> list[LocalTensor]:
    """This rank's tensors, each once (a tied parameter under all its names), in the model's order."""
    found: dict[int, LocalTensor] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        for is_param, store in ((True, mod._parameters), (False, mod._buffers)):
            for key, t in store.items():
                if t is None or id(t) not in local_ids:
                    continue
                name = f"{path}.{key}" if path else key
                entry = found.get(id(t))
                if entry is None:
                    persistent = is_param or key not in mod._non_persistent_buffers_set
                    found[id(t)] = LocalTensor(t, path, mod, [name], is_param, persistent)
                elif name not in entry.names:
                    entry.names.append(name)
    return list(found.values())


def materialize(model: nn.Module, roots: Sequence[nn.Module], local_ids: set[int], device: torch.device, *,
                source: WeightSource | None = None, init_fn: Callable[[nn.Module], None] | None = None,
                seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Put this rank's tensors on ``device`` and give the ones that had no values (meta) their values.

    A tensor on the meta device is replaced by a new one on ``device`` in the model and in
    every ``roots`` module (the traced programs); the (replaced, replacement) pairs are
    returned. A real tensor moves in place (``.data``), so references to
    it, an optimizer's for one, stay valid. With ``source`` every parameter and persistent
    buffer is read from the checkpoint (by any of its names; a tied weight on every stage
    that holds it); a non-persistent buffer keeps its value unless it had none. Without
    one, each module owning a tensor that was on the meta device is initialized by
    ``init_fn(module)``, else by its own ``reset_parameters()`` followed by a Hugging Face
    model's ``_init_weights(module)`` (either alone when there is one); the random numbers are seeded by ``seed`` and the module's
    name, so a module gets the same weights on every rank and under every partition.
    """
    tensors = local_tensors(model, local_ids)
    for lt in tensors:
        lt.was_meta = lt.tensor.is_meta
    # Decide where every value comes from before touching anything: a failure leaves the model as it was.
    if source is not None:
        fill = _checkpoint_names(tensors, source)
    else:
        inits = _initializers(model, [lt for lt in tensors if lt.was_meta], init_fn)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for lt in tensors:
        t = lt.tensor
        if t.is_meta:
            new = torch.empty_like(t, device=device)
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            pairs.append((t, new))
            lt.tensor = new
        elif t.device != device:
            t.data = t.data.to(device)
    replaced = {id(old): new for old, new in pairs}
    _replace(model, roots, replaced)
    if source is not None:
        source.read({name: replaced.get(id(t), t) for name, t in fill.items()})
    else:
        for path, init in inits:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                torch.manual_seed(seed + zlib.crc32(path.encode()))
                init()
    return pairs


def _replace(model: nn.Module, roots: Sequence[nn.Module], replaced: Mapping[int, torch.Tensor]) -> None:
    """Swap each replaced tensor for its replacement wherever a module of the model or of a root holds it."""
    if not replaced:
        return
    for root in [model, *roots]:
        for module in root.modules():
            for store in (module._parameters, module._buffers):
                for key, t in list(store.items()):
                    if t is not None and id(t) in replaced:
                        store[key] = replaced[id(t)]


def _checkpoint_names(tensors: list[LocalTensor], source: WeightSource) -> dict[str, torch.Tensor]:
    """The checkpoint name of every tensor to read (any of its names); MaterializeError naming a missing one."""
    available = source.names()
    targets: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for lt in tensors:
        name = next((n for n in lt.names if n in available), None)
        if name is not None:
            targets[name] = lt.tensor
        elif lt.persistent or lt.was_meta:
            missing.append(lt.names[0])
    if missing:
        sample = sorted(available)[:3]
        raise MaterializeError(
            f"the checkpoint {source.path} has no tensor {missing[0]!r}" +
            (f" (nor {len(missing) - 1} more of this rank's)" if len(missing) > 1 else "") +
            f"; it has e.g. {sample}: use the checkpoint of this model (tensor names as in model.state_dict())")
    return targets


def _initializers(model: nn.Module, fresh: list[LocalTensor], init_fn: Callable[[nn.Module], None] | None
                  ) -> list[tuple[str, Callable[[], object]]]:
    """(module path, initializer) for every module owning a tensor that had no values; MaterializeError if one has none."""
    hf_init = _module_initializer(model)
    modules: dict[str, tuple[nn.Module, list[str]]] = {}
    for lt in fresh:
        modules.setdefault(lt.module_path, (lt.module, []))[1].append(lt.names[0])
    out: list[tuple[str, Callable[[], object]]] = []
    for path, (module, names) in sorted(modules.items()):
        reset = getattr(module, "reset_parameters", None)
        if init_fn is not None:
            out.append((path, lambda m=module: init_fn(m)))
        elif callable(reset) or hf_init is not None:
            # the module's own reset, then the model's policy (Hugging Face's std 0.02 where it has one)
            steps = [f for f in (reset if callable(reset) else None,
                                 (lambda m=module: hf_init(m)) if hf_init is not None else None) if f is not None]
            out.append((path, lambda steps=steps: [f() for f in steps]))
        else:
            raise MaterializeError(
                f"module {path or '(root)'!r} ({type(module).__name__}) holds {names[:3]} on the meta device and has "
                "no reset_parameters(): pass checkpoint=... to load its weights, or init_fn=... to initialize it "
                "(build with smp.delay_param_initialization() to keep buffers real)")
    return out


def _module_initializer(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """A Hugging Face model's ``_init_weights(module)`` (the one that takes a module), if it has one."""
    fn = getattr(model, "_init_weights", None)
    if not callable(fn):
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    return fn if len(params) == 1 else None


def names_by_id(model: nn.Module) -> Mapping[int, list[str]]:
    """Every name of every parameter and buffer (tied ones have several), by tensor id."""
    out: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        out.setdefault(id(t), []).append(name)
    return out
