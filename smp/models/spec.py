"""Model spec strings (``gpt:layers=24``, ``path/to/file.py:factory``) resolved against the zoo, and ``build``."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_map

from partitioner.microbatch import batch_size as sample_batch_size
from partitioner.trace import UserCodeError
from partitioner.user_code import user_code_message
from smp.models.common import output_logits
from smp.models.registry import (BuildContext, ModelInfo, Option, SpecError, ZooEntry, did_you_mean, lookup,
                                 registered)

# Importing the zoo modules registers their models; the order here is the order `smp models` lists.
from smp.models import gpt, bert, t5, resnet, unet, mlp, hf  # noqa: F401  isort: skip

__all__ = [
    "ModelBundle",
    "parse_spec",
    "list_models",
    "get_model_info",
    "build",
    "build_step",
    "with_batch",
]


@dataclass
class ModelBundle:
    """A model, a sample batch for it, a target and a loss: everything ``smp`` needs to plan and check it.

    ``loss_fn(model(*example_args, **example_kwargs), target)`` is a scalar tensor.
    """

    name: str
    spec: str
    model: nn.Module
    example_args: tuple[Any, ...]
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    target: Any = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    config: dict[str, Any] = field(default_factory=dict)

    def num_params(self) -> int:
        """Unique parameters: a tied weight (GPT's LM head) is counted once."""
        seen: set[int] = set()
        total = 0
        for p in self.model.parameters():  # parameters() already de-duplicates; the set is belt and braces
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        return total

    def param_bytes(self) -> int:
        """Bytes of the unique parameters at their current dtype."""
        seen: set[int] = set()
        total = 0
        for p in self.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    def loss(self, output: Any | None = None) -> torch.Tensor:
        """The loss on the sample batch (runs the model when ``output`` is not given)."""
        if output is None:
            output = self.model(*self.example_args, **self.example_kwargs)
        if self.loss_fn is None:
            raise SpecError(f"model {self.name!r} has no loss_fn")
        return self.loss_fn(output, self.target)


def list_models() -> list[ModelInfo]:
    """Every zoo entry, in registration order."""
    return [e.info for e in registered()]


def get_model_info(name: str) -> ModelInfo:
    """The zoo entry called ``name`` (or an alias such as ``gpt-1b``); SpecError listing the known names if none."""
    return lookup(name)[0].info


# --------------------------------------------------------------------------- parsing


def _is_file_spec(spec: str) -> bool:
    head = spec.split(":", 1)[0]
    return head.endswith(".py") or "/" in head or os.sep in head


def _split_options(text: str, where: str) -> dict[str, str]:
    options: dict[str, str] = {}
    if not text.strip():
        return options
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise SpecError(f"bad option {item!r} in {where}: expected name=value (e.g. layers=4)")
        key, value = item.split("=", 1)
        key, value = key.strip(), value.strip()
        if not key:
            raise SpecError(f"bad option {item!r} in {where}: empty option name")
        if key in options:
            raise SpecError(f"option {key!r} given twice in {where}")
        options[key] = value
    return options


def _guess_value(text: str) -> Any:
    """A raw option value as the literal it looks like: bool, int, float, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(text.replace("_", ""))
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _split_spec(spec: str) -> tuple[str, dict[str, str], str | None]:
    """(model name or file path, raw option strings, factory name or None for zoo specs)."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError("empty model spec: give a zoo name such as 'gpt:layers=4' or 'path/to/file.py:factory'")
    spec = spec.strip()
    if _is_file_spec(spec):
        parts = spec.split(":", 2)
        path = parts[0]
        factory = parts[1].strip() if len(parts) > 1 and parts[1].strip() else None
        if factory is None:
            raise SpecError(
                f"file spec {spec!r} names no factory: write 'path/to/file.py:factory' "
                "where factory() returns the model and its sample inputs"
            )
        raw = _split_options(parts[2], f"spec {spec!r}") if len(parts) > 2 else {}
        return path, raw, factory
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise SpecError(f"model spec {spec!r} has no model name before ':'")
    return name, _split_options(rest, f"spec {spec!r}"), None


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split a spec into ``(name, options)``; values become bool/int/float/str by how they look.

    ``gpt:layers=24,d_model=1024`` -> ``("gpt", {"layers": 24, "d_model": 1024})``.
    A file spec ``path/file.py:factory[:k=v,...]`` -> ``("path/file.py", {"factory": "factory", ...})``.
    No check against the zoo is made here; ``build`` does that.
    """
    name, raw, factory = _split_spec(spec)
    options: dict[str, Any] = {k: _guess_value(v) for k, v in raw.items()}
    if factory is not None:
        options = {"factory": factory, **options}
    return name, options


# --------------------------------------------------------------------------- resolution



def _accepted(info: ModelInfo) -> str:
    return ", ".join(o.name for o in info.options)


def _coerce(info: ModelInfo, opt: Option, value: Any) -> Any:
    """``value`` (a raw string from a spec, or a Python value from a preset/keyword) as ``opt.type``."""

    def bad(why: str) -> SpecError:
        extra = f"; choices: {', '.join(map(str, opt.choices))}" if opt.choices else ""
        return SpecError(f"bad value {value!r} for option {opt.name!r} of model {info.name!r}: {why}{extra}")

    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        if opt.default is None:
            return None
        raise bad(f"expected {opt.type.__name__}, got none")
    t = opt.type
    if t is bool:
        if isinstance(value, bool):
            out: Any = value
        elif isinstance(value, str) and value.lower() in ("true", "yes", "on", "1"):
            out = True
        elif isinstance(value, str) and value.lower() in ("false", "no", "off", "0"):
            out = False
        elif isinstance(value, int) and value in (0, 1):
            out = bool(value)
        else:
            raise bad("expected true or false")
    elif t is int:
        if isinstance(value, bool):
            raise bad("expected an integer")
        if isinstance(value, int):
            out = value
        elif isinstance(value, float) and value.is_integer():
            out = int(value)
        else:
            try:
                out = int(str(value).replace("_", ""))
            except ValueError:
                raise bad("expected an integer") from None
    elif t is float:
        if isinstance(value, bool):
            raise bad("expected a number")
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise bad("expected a number") from None
    else:
        out = str(value)
    if opt.choices is not None and out not in opt.choices:
        raise bad("not one of the accepted values")
    if opt.min is not None and isinstance(out, (int, float)) and not isinstance(out, bool) and out < opt.min:
        raise bad(f"must be >= {opt.min}")
    return out


def _resolve(entry: ZooEntry, raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults, then the preset named by ``size``, then the spec's own options, then keyword overrides."""
    info = entry.info
    names = {o.name for o in info.options}
    for key in list(raw) + list(overrides):
        if key not in names:
            raise SpecError(
                f"unknown option {key!r} for model {info.name!r}; accepted: {_accepted(info)}"
                f"{did_you_mean(key, sorted(names))}"
            )
    config = dict(info.defaults)
    size_opt = info.option("size")
    size_raw = overrides.get("size", raw.get("size"))
    if size_opt is not None and size_raw is not None:
        size = _coerce(info, size_opt, size_raw)
        config.update(info.presets[size])
        config["size"] = size
    for key, value in raw.items():
        if key != "size":
            config[key] = _coerce(info, info.option(key), value)  # type: ignore[arg-type]
    for key, value in overrides.items():
        if key != "size":
            config[key] = _coerce(info, info.option(key), value)  # type: ignore[arg-type]
    if entry.validate is not None:
        entry.validate(config)
    return config


# --------------------------------------------------------------------------- building


def _to_device(obj: Any, device: torch.device | None, dtype: torch.dtype | None) -> Any:
    """Move tensors in (nested) args to ``device``; cast floating tensors to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        if dtype is not None and obj.is_floating_point():
            obj = obj.to(dtype)
        return obj.to(device) if device is not None else obj
    if isinstance(obj, tuple):
        return tuple(_to_device(x, device, dtype) for x in obj)
    if isinstance(obj, list):
        return [_to_device(x, device, dtype) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device, dtype) for k, v in obj.items()}
    return obj


def build(
    spec: str,
    *,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    meta: bool = False,
    seed: int = 0,
) -> ModelBundle:
    """Build a model and its sample batch from a spec string.

    ``spec`` is a zoo name with options (``gpt:layers=24,d_model=1024``, ``gpt:size=1b``,
    ``gpt-1b``) or ``path/to/file.py:factory[:k=v,...]``. ``batch_size``/``seq_len`` win
    over the spec's ``batch``/``seq_len``; a file model's sample inputs are cut or repeated
    along dim 0 to ``batch_size`` rows (see ``with_batch``), and its sizes come from its
    factory's options, not ``seq_len``. ``meta=True`` puts model and inputs on the meta
    device (no memory; for analytic planning). ``seed`` makes weights and inputs repeatable.
    """
    name, raw, factory = _split_spec(spec)
    if factory is not None:
        if seq_len is not None:
            raise SpecError(f"{spec!r} is a file model: its sizes come from its factory's options, not from a "
                            f"sequence length; write '{name}:{factory}:seq_len={seq_len}' if {factory}() takes "
                            "seq_len")
        bundle = _build_from_file(spec, name, factory, raw, meta=meta, seed=seed)
        if batch_size is not None:
            bundle = with_batch(bundle, batch_size)
    else:
        entry, alias_opts = lookup(name)
        overrides: dict[str, Any] = {}
        if batch_size is not None:
            if entry.info.option("batch") is None:
                raise SpecError(f"model {entry.info.name!r} has no batch option; accepted: {_accepted(entry.info)}")
            overrides["batch"] = batch_size
        if seq_len is not None:
            if entry.info.option("seq_len") is None:
                raise SpecError(
                    f"model {entry.info.name!r} takes no sequence length (seq_len); accepted: {_accepted(entry.info)}"
                )
            overrides["seq_len"] = seq_len
        config = _resolve(entry, {**alias_opts, **raw}, overrides)
        ctx = BuildContext(meta=meta, generator=torch.Generator().manual_seed(seed + 1))
        # fork_rng keeps the caller's global RNG untouched: building a model has no side effects.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if meta:
                with torch.device("meta"):
                    built = entry.builder(dict(config), ctx)
            else:
                built = entry.builder(dict(config), ctx)
        bundle = ModelBundle(
            name=entry.info.name,
            spec=spec,
            model=built.model,
            example_args=tuple(built.args),
            example_kwargs=dict(built.kwargs),
            target=built.target,
            loss_fn=built.loss_fn,
            config=config,
        )
    dev = torch.device(device) if device is not None else None
    if meta:
        dev = torch.device("meta")
    if dtype is not None:
        bundle.model.to(dtype)
    if dev is not None:
        bundle.model.to(dev)
    if dev is not None or dtype is not None:
        bundle.example_args = _to_device(bundle.example_args, dev, dtype)
        bundle.example_kwargs = _to_device(bundle.example_kwargs, dev, dtype)
        bundle.target = _to_device(bundle.target, dev, dtype)
    return bundle


def with_batch(bundle: ModelBundle, batch: int) -> ModelBundle:
    """``bundle`` with a batch of ``batch`` rows: its sample inputs and target cut or repeated along dim 0.

    Only tensors whose dim 0 is the sample's batch size change (as when a batch is split
    into microbatches); repeated rows are copies, which is all planning needs (shapes)
    and all synthetic training data is.
    """
    size = sample_batch_size(bundle.example_args, bundle.example_kwargs)
    if size is None:
        raise SpecError(f"cannot give {bundle.name!r} a batch of {batch}: none of its sample inputs is a tensor "
                        "with a batch dimension (dim 0)")
    if batch < 1:
        raise SpecError(f"a batch must have at least one row, got {batch}")
    if batch == size:
        return bundle

    def fit(leaf: Any) -> Any:
        if not (isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == size):
            return leaf
        if batch < size:
            return leaf[:batch]
        return leaf.repeat(-(-batch // size), *([1] * (leaf.dim() - 1)))[:batch]

    args, kwargs, target = tree_map(fit, (bundle.example_args, bundle.example_kwargs, bundle.target))
    return replace(bundle, example_args=tuple(args), example_kwargs=dict(kwargs), target=target)


def build_step(spec: str, *, microbatches: int, batch_size: int | None = None, seq_len: int | None = None,
               meta: bool = False, seed: int = 0) -> ModelBundle:
    """A bundle whose sample is the whole batch of one pipeline step, by the CLI's one rule.

    The sample batch a spec builds (a zoo model's ``batch`` option, a factory's inputs) is
    one microbatch, so a step's batch is ``microbatches`` times it; ``batch_size`` gives the
    step's batch instead. A zoo model draws fresh rows for the larger batch; a file model's
    rows are repeated (``with_batch``).
    """
    factory = _split_spec(spec)[2]
    if batch_size is not None or microbatches == 1:
        return build(spec, batch_size=batch_size, seq_len=seq_len, meta=meta, seed=seed)
    if factory is None:  # the zoo: read the sample batch on meta (no memory), then build once at the step's batch
        probe = build(spec, seq_len=seq_len, meta=True, seed=seed)
        size = sample_batch_size(probe.example_args, probe.example_kwargs)
        return build(spec, batch_size=size * microbatches if size else None, seq_len=seq_len, meta=meta, seed=seed)
    bundle = build(spec, seq_len=seq_len, meta=meta, seed=seed)
    size = sample_batch_size(bundle.example_args, bundle.example_kwargs)
    return with_batch(bundle, size * microbatches) if size else bundle


# --------------------------------------------------------------------------- file specs


def _load_module(path: Path, spec: str) -> Any:
    # A name derived from the path, stable across processes (str hash is salted per process).
    module_name = "_smp_user_model_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    mod_spec = importlib.util.spec_from_file_location(module_name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise SpecError(f"cannot import {str(path)!r} from spec {spec!r}: not a Python file")
    module = importlib.util.module_from_spec(mod_spec)
    # As Python runs a script: its folder first on the import path, so `from layers import block` finds the
    # layers.py beside it (at import and in functions that import later, so the folder stays).
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    # Registered so pickling (multiprocess runtime) and dataclasses inside the file work.
    sys.modules[module_name] = module
    try:
        mod_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever the file raises is the file's
        sys.modules.pop(module_name, None)
        raise UserCodeError(user_code_message(exc, f"importing {str(path)!r} (from spec {spec!r}) raised",
                                              file=str(path))) from exc
    return module


def _bundle_from_factory_result(result: Any, spec: str, path: str, factory: str, config: dict[str, Any]) -> ModelBundle:
    where = f"factory {factory!r} in {path!r}"
    expected = (
        "expected (model, args), (model, args, kwargs), a dict with 'model' and 'args' "
        "(optional 'kwargs', 'target', 'loss_fn'), or a smp.models.ModelBundle"
    )
    if isinstance(result, ModelBundle):
        result.spec = spec
        return result
    target: Any = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    if isinstance(result, Mapping):
        unknown = set(result) - {"model", "args", "kwargs", "target", "loss_fn", "name"}
        if "model" not in result or unknown:
            raise SpecError(f"{where} returned a dict with keys {sorted(result)}; {expected}")
        model = result["model"]
        args = result.get("args", ())
        kwargs = result.get("kwargs") or {}
        target = result.get("target")
        loss_fn = result.get("loss_fn")
    elif isinstance(result, tuple) and len(result) in (2, 3):
        model, args = result[0], result[1]
        kwargs = result[2] if len(result) == 3 else {}
    else:
        raise SpecError(f"{where} returned {type(result).__name__}; {expected}")
    if not isinstance(model, nn.Module):
        raise SpecError(f"{where} returned a model of type {type(model).__name__}, not a torch.nn.Module; {expected}")
    if isinstance(args, torch.Tensor):
        args = (args,)  # a lone tensor is the common case: accept it as a 1-tuple
    if isinstance(args, list):
        args = tuple(args)
    if not isinstance(args, tuple):
        raise SpecError(f"{where} returned args of type {type(args).__name__}; expected a tuple of inputs")
    if not isinstance(kwargs, Mapping):
        raise SpecError(f"{where} returned kwargs of type {type(kwargs).__name__}; expected a dict")
    if loss_fn is None:
        loss_fn = _default_loss
    return ModelBundle(
        name=f"{Path(path).stem}:{factory}",
        spec=spec,
        model=model,
        example_args=args,
        example_kwargs=dict(kwargs),
        target=target,
        loss_fn=loss_fn,
        config=config,
    )


def _default_loss(output: Any, target: Any) -> torch.Tensor:
    """Loss for user models that bring none: MSE to ``target`` if given, else the mean of the output."""
    out = output_logits(output)
    if target is None:
        return out.float().mean()
    return nn.functional.mse_loss(out.float(), target.float())


def _build_from_file(
    spec: str, path_text: str, factory: str, raw: Mapping[str, str], *, meta: bool, seed: int
) -> ModelBundle:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise SpecError(f"model file {path_text!r} not found (from spec {spec!r}); cwd is {os.getcwd()!r}")
    module = _load_module(path, spec)
    fn = getattr(module, factory, None)
    if fn is None or not callable(fn):
        available = [
            n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
        ]
        what = "is not callable" if fn is not None else "not found"
        raise SpecError(
            f"factory {factory!r} {what} in {path_text!r}; functions there: {', '.join(available) or '(none)'}"
            f"{did_you_mean(factory, available)}"
        )
    kwargs = {k: _guess_value(v) for k, v in raw.items()}
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as exc:
        raise SpecError(f"factory {factory!r} in {path_text!r} does not accept options {sorted(kwargs)}: {exc}") from None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device("meta") if meta else contextlib.nullcontext():
                result = fn(**kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the factory raises is the factory's
        raise UserCodeError(user_code_message(exc, f"factory {factory!r} in {path_text!r} raised",
                                              file=str(path))) from exc
    return _bundle_from_factory_result(result, spec, path_text, factory, kwargs)
