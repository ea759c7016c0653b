"""The tensor-parallel plan of a model: module-name patterns to styles, resolved and checked against its modules."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from partitioner.tp_graph import ModuleSplit, TensorParallelError

__all__ = ["TP_STYLES", "resolve_tp_plan", "check_tp_plan", "module_splits"]

#: The style names a tp plan takes (Hugging Face's words): colwise/rowwise pairs; "_rep": the output (colwise) or
#: the input (rowwise) whole; "fused_colwise:N": a Linear that is N projections side by side (a fused k/v).
TP_STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "fused_colwise:N")
#: Hugging Face's other names of the same styles (transformers 5: an LM head's "colwise_gather_output").
STYLE_ALIASES = {"colwise_gather_output": "colwise_rep", "rowwise_split_input": "rowwise_rep"}


def resolve_tp_plan(model: nn.Module, tp_plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """The tp plan (module-name pattern -> style) for ``model``: ``tp_plan`` when given, else a Hugging Face
    model's ``config.base_model_tp_plan`` (its names relative to the base model, put under its prefix) with its
    class's own entries (:func:`_head_plan`: the LM head), else the model's own ``tp_plan`` (smp's zoo models). A
    clear error when there is none."""
    if tp_plan is not None:
        if not isinstance(tp_plan, Mapping) or not tp_plan:
            raise TensorParallelError(f"tp_plan takes a dict of module-name patterns to styles, got {tp_plan!r}")
        return _canonical(tp_plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if base:
        prefix = getattr(model, "base_model_prefix", "")
        under = prefix and hasattr(model, prefix) and getattr(model, prefix) is not model
        plan = {f"{prefix}.{k}" if under else k: v for k, v in base.items()}
        return _canonical({**plan, **_head_plan(model)})
    own = getattr(model, "tp_plan", None)
    if isinstance(own, Mapping) and own:
        return _canonical(own)
    raise TensorParallelError(f"tensor_parallel needs a tp plan for {type(model).__name__}, which has none (no "
                              "config.base_model_tp_plan, no tp_plan): pass tp_plan={pattern: style} with styles "
                              f"{', '.join(TP_STYLES)} (e.g. {{'layers.*.attn.q': 'colwise', 'layers.*.attn.out': "
                              "'rowwise'}})")


def _canonical(plan: Mapping[str, Any]) -> dict[str, Any]:
    """The plan with Hugging Face's other style names (:data:`STYLE_ALIASES`) as smp's."""
    return {k: STYLE_ALIASES.get(v.strip().lower(), v) if isinstance(v, str) else v for k, v in plan.items()}


def _head_plan(model: nn.Module) -> dict[str, Any]:
    """A Hugging Face model class's own plan entries beyond its base model's (``_tp_plan``: an LM head's
    "colwise_gather_output", names relative to the model), as Hugging Face's tensor parallelism applies them;
    a module whose weight is tied to another (an LM head sharing the embedding) is left whole, which is
    Hugging Face's choice too where it cannot split a tied weight."""
    head = getattr(type(model), "_tp_plan", None)
    if not isinstance(head, Mapping):
        return {}
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    modules = dict(model.named_modules())
    return {name: style for name, style in head.items() if name in modules and
            all(owners.get(id(p), 0) == 1 for p in modules[name].parameters())}


def _matches(pattern: str, name: str) -> bool:
    """A plan pattern matches a module's qualified name atom by atom ("*" one atom, as torch's parallelize_module)."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))


def _split_of(style: Any, module: nn.Module, where: str) -> ModuleSplit:
    """What ``style`` (a name of TP_STYLES or a torch ParallelStyle) does to the module's activations."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, str):
        name = style.strip().lower()
        if name.startswith("fused_colwise:"):
            try:
                n = int(name.split(":", 1)[1])
            except ValueError:
                n = 0
            if n < 1 or embedding:
                raise TensorParallelError(f"{where}: style {style!r} takes a Linear and a count of projections "
                                          "(fused_colwise:2 for a fused k/v)")
            return ModuleSplit(False, True, n)
        known = {"colwise": ModuleSplit(False, True), "rowwise": ModuleSplit(not embedding, False, rowwise=True),
                 "colwise_rep": ModuleSplit(False, False), "rowwise_rep": ModuleSplit(False, False, rowwise=True)}
        if name not in known:
            raise TensorParallelError(f"{where}: unknown style {style!r}; use one of {', '.join(TP_STYLES)} or a "
                                      "torch ColwiseParallel/RowwiseParallel")
        return known[name]
    if getattr(style, "use_local_output", True) is False:
        raise TensorParallelError(f"{where}: use_local_output=False (DTensor activations) is not supported; the "
                                  "stage programs run on local shards")
    if isinstance(style, ColwiseParallel):
        return ModuleSplit(False, not isinstance(style.output_layouts[0], Replicate))
    if isinstance(style, RowwiseParallel):
        return ModuleSplit(not embedding and not isinstance(style.input_layouts[0], Replicate), False, rowwise=True)
    raise TensorParallelError(f"{where}: style {type(style).__name__} is not supported; use ColwiseParallel, "
                              f"RowwiseParallel or a name of {', '.join(TP_STYLES)}")


def check_tp_plan(model: nn.Module, plan: Mapping[str, Any], tp_size: int) -> dict[str, tuple[Any, ModuleSplit]]:
    """Every module of ``model`` the plan names (qualified name -> (style, how it splits)), checked before any
    collective: a pattern that names no module, a module that is no Linear or Embedding, or a feature count
    ``tp_size`` does not divide is a clear error naming both."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    modules = dict(model.named_modules())
    chosen: dict[str, tuple[Any, ModuleSplit]] = {}
    for pattern, style in plan.items():
        names = [n for n in modules if n and _matches(pattern, n)]
        if not names:
            raise TensorParallelError(f"tp_plan names {pattern!r}, which matches no module of "
                                      f"{type(model).__name__} (its modules are named like "
                                      f"{', '.join(list(modules)[1:4])}, ...)")
        for name in names:
            module = modules[name]
            where = f"tp_plan's {pattern!r} on module {name}"
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise TensorParallelError(f"{where}: a {type(module).__name__}; tensor parallelism splits "
                                          "nn.Linear and nn.Embedding modules")
            how = _split_of(style, module, where)
            colwise = how.makes_split or (isinstance(style, str) and style.strip().lower() == "colwise_rep") or \
                isinstance(style, ColwiseParallel)
            if isinstance(module, nn.Linear):
                count, what = (module.out_features, "output features") if colwise else \
                    (module.in_features, "input features")
            else:
                count, what = (module.embedding_dim, "embedding dims") if colwise else \
                    (module.num_embeddings, "embeddings")
            if count % (tp_size * how.parts):
                each = f" ({how.parts} projections of {count // how.parts})" if how.parts > 1 else ""
                raise TensorParallelError(f"module {name} has {count} {what}{each}, which tensor_parallel={tp_size} "
                                          "does not divide")
            chosen[name] = (style, how)
    _check_heads(modules, chosen, tp_size)
    _refuse_split_ties(model, chosen)
    return chosen


def _refuse_split_ties(model: nn.Module, chosen: Mapping[str, Any]) -> None:
    """A parameter the plan splits must belong to that module alone: a tied one (an LM head sharing the
    embedding's weight) would be split two ways, or split in one place and whole in the other."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for names in owners.values():
        split = [n for n in names if n.rpartition(".")[0] in chosen]
        if split and len(names) > 1:
            others = ", ".join(n for n in names if n != split[0])
            raise TensorParallelError(f"parameter {split[0]} is tied to {others}: tensor parallelism does not "
                                      "split a tied weight; keep its modules out of tp_plan")


def _check_heads(modules: Mapping[str, nn.Module], chosen: Mapping[str, Any], tp_size: int) -> None:
    """An attention module whose projections are split (a parent with a ``head_dim``: the zoo's, Hugging Face's)
    must have head counts ``tp_size`` divides; its own or its config's (grouped key/value heads too)."""
    for parent in sorted({name.rpartition(".")[0] for name in chosen}):
        module = modules.get(parent)
        if module is None or not hasattr(module, "head_dim"):
            continue
        config = getattr(module, "config", None)
        counts = {"heads": getattr(module, "heads", None), "num_heads": getattr(module, "num_heads", None),
                  "num_attention_heads": getattr(config, "num_attention_heads", None),
                  "num_key_value_heads": getattr(config, "num_key_value_heads", None)}
        for what, n in counts.items():
            if isinstance(n, int) and not isinstance(n, bool) and n % tp_size:
                raise TensorParallelError(f"attention module {parent} has {n} {what.replace('_', ' ')}, which "
                                          f"tensor_parallel={tp_size} does not divide")


def module_splits(model: nn.Module, plan: Mapping[str, Any], tp_size: int) -> dict[str, ModuleSplit]:
    """How each module the checked plan names (qualified name) treats its activations."""
    return {name: how for name, (_, how) in check_tp_plan(model, plan, tp_size).items()}
