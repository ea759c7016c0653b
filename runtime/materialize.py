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
from runtime.computed_buffers import rebuilt_from_config, unrecoverable, was_set

__all__ = ["MaterializeError", "materialize", "LocalTensor", "local_tensors", "names_by_id"]


class MaterializeError(ValueError):
    """A tensor cannot be given values (no checkpoint entry, no initializer); the message names it and the fix."""


@dataclass
class LocalTensor:
    """A parameter or buffer this rank holds, where it lives in the model, and all its names."""

    tensor: torch.Tensor
    module_path: str
    module: nn.Module
    key: str
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
                    found[id(t)] = LocalTensor(t, path, mod, key, [name], is_param, persistent)
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
    A buffer that had no values and that no checkpoint gives (a non-persistent one, as a
    rotary embedding's frequencies) is computed again: its module built again from its
    config where it has one and no weights (``runtime.computed_buffers``), else by the
    module's initializer as above, which must set it; else MaterializeError names it.
    """
    tensors = local_tensors(model, local_ids)
    for lt in tensors:
        lt.was_meta = lt.tensor.is_meta
    # Decide where every value comes from before touching anything: a failure leaves the model as it was
    # (an initializer found not to set a buffer is seen only after running: the replacements are undone).
    fill = _checkpoint_names(tensors, source) if source is not None else {}
    filled = {id(t) for t in fill.values()}
    computed = [lt for lt in tensors if lt.was_meta and not lt.is_param and id(lt.tensor) not in filled]
    rebuilt, why_not = _rebuilt_owners(computed)
    # without a checkpoint every tensor that had no values is initialized; with one, only the computed buffers
    to_init = [lt for lt in (computed if source is not None else tensors)
               if lt.was_meta and id(lt.module) not in rebuilt]
    checkpoint = str(source.path) if source is not None else None
    inits = _initializers(model, to_init, init_fn, why_not, checkpoint)
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
    try:
        with torch.no_grad():
            for lt in computed:
                if id(lt.module) in rebuilt:
                    lt.tensor.copy_(rebuilt[id(lt.module)]._buffers[lt.key])
        buffers = [lt for lt in to_init if not lt.is_param]
        versions = [lt.tensor._version for lt in buffers]
        for path, _, init in inits:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                torch.manual_seed(seed + zlib.crc32(path.encode()))
                init()
        used = {path: label for path, label, _ in inits}
        for lt, version in zip(buffers, versions):
            if not was_set(lt.module, lt.key, lt.tensor, version):
                why = f"{why_not[id(lt.module)]}; its initializer, {used[lt.module_path]}, did not set it"
                raise MaterializeError(unrecoverable(lt.names[0], lt.module_path, lt.module, why, checkpoint))
    except MaterializeError:
        _replace(model, roots, {id(new): old for old, new in pairs})
        raise
    if source is not None:
        source.read({name: replaced.get(id(t), t) for name, t in fill.items()})
    return pairs


def _rebuilt_owners(computed: list[LocalTensor]) -> tuple[dict[int, nn.Module], dict[int, str]]:
    """Each module owning computed buffers, by id: built again from its config, or why it cannot be."""
    owned: dict[int, tuple[nn.Module, dict[str, torch.Tensor]]] = {}
    for lt in computed:
        owned.setdefault(id(lt.module), (lt.module, {}))[1][lt.key] = lt.tensor
    rebuilt: dict[int, nn.Module] = {}
    why_not: dict[int, str] = {}
    for key, (module, buffers) in owned.items():
        fresh = rebuilt_from_config(module, buffers)
        if isinstance(fresh, str):
            why_not[key] = fresh
        else:
            rebuilt[key] = fresh
    return rebuilt, why_not


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
        elif lt.persistent:  # a non-persistent buffer is in no checkpoint: it keeps or computes its value
            missing.append(lt.names[0])
    if missing:
        sample = sorted(available)[:3]
        raise MaterializeError(
            f"the checkpoint {source.path} has no tensor {missing[0]!r}" +
            (f" (nor {len(missing) - 1} more of this rank's)" if len(missing) > 1 else "") +
            f"; it has e.g. {sample}: use the checkpoint of this model (tensor names as in model.state_dict())")
    return targets


def _initializers(model: nn.Module, fresh: list[LocalTensor], init_fn: Callable[[nn.Module], None] | None,
                  why_not: Mapping[int, str], checkpoint: str | None) -> list[tuple[str, str, Callable[[], object]]]:
    """(module path, what it runs, initializer) for every module owning a tensor in ``fresh``; MaterializeError if one
    has none (naming its first buffer when it owns no parameter there)."""
    hf_init = _module_initializer(model)
    modules: dict[str, tuple[nn.Module, list[LocalTensor]]] = {}
    for lt in fresh:
        modules.setdefault(lt.module_path, (lt.module, []))[1].append(lt)
    out: list[tuple[str, str, Callable[[], object]]] = []
    for path, (module, owned) in sorted(modules.items()):
        reset = getattr(module, "reset_parameters", None)
        if init_fn is not None:
            out.append((path, "init_fn", lambda m=module: init_fn(m)))
        elif callable(reset) or hf_init is not None:
            # the module's own reset, then the model's policy (Hugging Face's std 0.02 where it has one)
            steps = [f for f in (reset if callable(reset) else None,
                                 (lambda m=module: hf_init(m)) if hf_init is not None else None) if f is not None]
            label = " then ".join(n for n, f in (("reset_parameters()", callable(reset)),
                                                 ("the model's _init_weights", hf_init is not None)) if f)
            out.append((path, label, lambda steps=steps: [f() for f in steps]))
        elif any(lt.is_param for lt in owned):
            names = [lt.names[0] for lt in owned]
            raise MaterializeError(
                f"module {path or '(root)'!r} ({type(module).__name__}) holds {names[:3]} on the meta device and has "
                "no reset_parameters(): pass checkpoint=... to load its weights, or init_fn=... to initialize it "
                "(build with smp.delay_param_initialization() to keep buffers real)")
        else:
            why = f"{why_not[id(module)]}; it has no reset_parameters(), nor the model an _init_weights"
            raise MaterializeError(unrecoverable(owned[0].names[0], path, module, why, checkpoint))
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
