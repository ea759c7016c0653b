"""The zoo's registry: what a model declares, what its builder gets and returns, and lookup by name."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "SpecError",
    "Option",
    "ModelInfo",
    "BuildContext",
    "Built",
    "Builder",
    "ZooEntry",
    "register_model",
    "registered",
    "lookup",
    "did_you_mean",
]


class SpecError(ValueError):
    """A model spec that cannot be parsed or built; the message names the cause and the fix."""


# --------------------------------------------------------------------------- what a zoo model declares


@dataclass(frozen=True)
class Option:
    """One option a zoo model accepts: its name, default, type and a one-line help."""

    name: str
    default: Any
    type: type
    help: str = ""
    choices: tuple[Any, ...] | None = None
    # Ints must be >= this bound (None: no bound). Most sizes must be positive.
    min: int | float | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What ``smp models`` prints: a zoo entry's name, description, options and presets."""

    name: str
    description: str
    options: tuple[Option, ...]
    presets: Mapping[str, Mapping[str, Any]]
    aliases: tuple[str, ...] = ()

    @property
    def defaults(self) -> dict[str, Any]:
        return {o.name: o.default for o in self.options}

    def option(self, name: str) -> Option | None:
        for o in self.options:
            if o.name == name:
                return o
        return None


@dataclass
class BuildContext:
    """What a zoo builder gets besides its options: where to put tensors and how to draw sample inputs."""

    meta: bool
    generator: torch.Generator

    @property
    def input_device(self) -> torch.device:
        return torch.device("meta") if self.meta else torch.device("cpu")

    def randint(self, high: int, shape: Sequence[int], low: int = 0) -> torch.Tensor:
        if self.meta:
            return torch.empty(tuple(shape), dtype=torch.long, device="meta")
        return torch.randint(low, high, tuple(shape), generator=self.generator)

    def randn(self, shape: Sequence[int]) -> torch.Tensor:
        if self.meta:
            return torch.empty(tuple(shape), device="meta")
        return torch.randn(tuple(shape), generator=self.generator)

    def rand(self, shape: Sequence[int]) -> torch.Tensor:
        if self.meta:
            return torch.empty(tuple(shape), device="meta")
        return torch.rand(tuple(shape), generator=self.generator)


@dataclass
class Built:
    """What a zoo builder returns; ``build`` wraps it into a ModelBundle."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]


Builder = Callable[[dict[str, Any], BuildContext], Built]


# --------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class ZooEntry:
    """A registered zoo model: what ``smp models`` shows of it, its builder and its options' check."""

    info: ModelInfo
    builder: Builder
    # Optional check of the resolved options (raises SpecError); e.g. d_model % heads.
    validate: Callable[[dict[str, Any]], None] | None


_REGISTRY: dict[str, ZooEntry] = {}
_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {}


def register_model(
    name: str,
    description: str,
    options: Sequence[Option],
    presets: Mapping[str, Mapping[str, Any]] | None = None,
    validate: Callable[[dict[str, Any]], None] | None = None,
) -> Callable[[Builder], Builder]:
    """Decorator: add a builder to the zoo under ``name``.

    Every preset also becomes an alias ``name-preset`` (``gpt-1b`` == ``gpt:size=1b``).
    The ``size`` option is added automatically when presets exist; the option defaults
    are what ``size`` does not override.
    """
    presets = dict(presets or {})
    opts = list(options)
    if presets and not any(o.name == "size" for o in opts):
        # Listed right after `batch` (the sample options), before tuning knobs like dropout.
        names = [o.name for o in opts]
        at = names.index("batch") + 1 if "batch" in names else len(opts)
        opts.insert(at, Option("size", None, str, "named preset: " + "|".join(presets), choices=tuple(presets)))

    def deco(fn: Builder) -> Builder:
        aliases = tuple(f"{name}-{p}" for p in presets)
        info = ModelInfo(name, description, tuple(opts), presets, aliases)
        _REGISTRY[name] = ZooEntry(info, fn, validate)
        for p, alias in zip(presets, aliases):
            _ALIASES[alias] = (name, {"size": p})
        return fn

    return deco


def registered() -> list[ZooEntry]:
    """Every model registered so far, in registration order."""
    return list(_REGISTRY.values())


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the candidate closest to ``word``; '' when none is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def lookup(name: str) -> tuple[ZooEntry, dict[str, Any]]:
    """The model registered as ``name`` and the options its alias sets (``gpt-1b``: size=1b);
    SpecError listing the known names if none."""
    if name in _REGISTRY:
        return _REGISTRY[name], {}
    if name in _ALIASES:
        real, preset = _ALIASES[name]
        return _REGISTRY[real], dict(preset)
    known = list(_REGISTRY)
    raise SpecError(
        f"unknown model {name!r}; known models: {', '.join(known)}"
        f"{did_you_mean(name, known + list(_ALIASES))}. "
        "For your own model use 'path/to/file.py:factory'."
    )
