"""Trace an unmodified nn.Module into an fx GraphModule (torch.fx, falling back to torch.export)."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import linecache
import logging
import traceback
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from partitioner.user_code import is_user_file, user_code_message

__all__ = [
    "trace",
    "TraceInfo",
    "TraceError",
    "UserCodeError",
    "untangle_return_dict",
    "node_module",
    "FRONTENDS",
]

FRONTENDS = ("auto", "fx", "export")

# fx nodes that only check something (shapes, specialised constants); they produce no
# value anyone reads, so the tracer drops them from export graphs.
_EXPORT_CHECK_TARGETS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
}


class TraceError(ValueError):
    """A model could not be traced; the message says which front end failed where, and what to try."""


class UserCodeError(TraceError):
    """The user's own code raised (a model's forward on its sample inputs, a model factory).

    The message names the exception, the file and line, the module and the input shapes;
    the original exception is the ``__cause__``.
    """


@dataclass
class TraceInfo:
    """How a GraphModule was traced: which front end, and why the other one failed."""

    frontend: str
    input_names: list[str]
    fx_error: str | None = None
    leaf_modules: list[str] = field(default_factory=list)
    training: bool = True


class _LeafTracer(fx.Tracer):
    """fx tracer whose leaf modules are torch.nn's own plus any named by the caller."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_paths: frozenset[str]):
        super().__init__()
        self._leaf_types = leaf_types
        self._leaf_paths = leaf_paths

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self._leaf_types and isinstance(m, self._leaf_types):
            return True
        if module_qualified_name in self._leaf_paths:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def trace(
    model: nn.Module,
    example_args: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    frontend: str = "auto",
    leaf_modules: Iterable[type | str] = (),
    check: bool = True,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> fx.GraphModule:
    """Trace ``model`` on the sample inputs into a ``torch.fx.GraphModule``.

    ``frontend="auto"`` tries ``torch.fx.symbolic_trace`` first and falls back to
    ``torch.export.export(strict=False)``; ``"fx"`` or ``"export"`` forces one.
    ``leaf_modules`` (module classes or module paths) stay single fx nodes under
    ``torch.fx``. The result is called like the model (``gm(*args, **kwargs)``) and, when
    ``check`` is set, is verified to return the model's output on the sample.

    Every op node carries ``node.meta["smp_module"]`` (module path it came from) and
    ``node.meta["smp_params"]`` / ``["smp_buffers"]`` (fully qualified names of the
    parameters and buffers it reads); ``gm.meta["smp_trace"]`` is a ``TraceInfo``.
    """
    if frontend not in FRONTENDS:
        raise ValueError(f"unknown frontend {frontend!r}; choose one of {', '.join(FRONTENDS)}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"smp traces torch.nn.Module objects; got {type(model).__name__}")
    args = _as_args(example_args)
    kwargs = dict(example_kwargs or {})
    bound = _bind(model, args, kwargs)
    untangle_return_dict(model)
    drop_generation_cache(model)
    # The model runs once as it is: an error there is the model's (or its inputs'), not the tracer's,
    # and its output is what the traced program must reproduce.
    expected = None
    if check:
        if _on_meta(model):  # nothing to compare on meta, but wrong shapes fail there too
            _raise_model_failure(model, args, kwargs, bound)
        else:
            expected = _run_model(model, args, kwargs, bound)

    gm, fx_error = (None, None)
    if frontend in ("auto", "fx"):
        gm, fx_error = _try_fx(model, args, kwargs, bound, leaf_modules, forced=frontend == "fx",
                               check=(expected, rtol, atol) if check else None)
    frontend_used = "fx" if gm is not None else "export"
    if gm is None:
        gm = _export_or_explain(model, args, kwargs, bound, fx_error, check=(expected, rtol, atol) if check else None)

    _annotate(gm, model)
    gm.meta["smp_trace"] = TraceInfo(
        frontend=frontend_used,
        input_names=list(bound.arguments),
        fx_error=fx_error,
        leaf_modules=[m if isinstance(m, str) else m.__name__ for m in leaf_modules],
        training=model.training,
    )
    return gm


def _try_fx(model: nn.Module, args: tuple, kwargs: dict, bound: inspect.BoundArguments,
            leaf_modules: Iterable[type | str], *, forced: bool, check: tuple[Any, float, float] | None
            ) -> tuple[fx.GraphModule | None, str | None]:
    """(the fx program, None), or (None, why fx failed) for the export fallback; TraceError when fx is forced."""
    try:
        gm = _trace_fx(model, bound, leaf_modules)
    except Exception as err:  # noqa: BLE001 - any tracer failure means: try export
        fx_error = _describe_failure(err, model)
        if forced:
            raise TraceError(
                f"torch.fx could not trace {type(model).__name__}: {fx_error}\n"
                "Try frontend='export' (torch.export handles data-dependent Python "
                "control flow on shapes), or mark the failing module as a leaf with "
                "leaf_modules=[...] so fx keeps it whole."
            ) from None
        return None, fx_error
    if check is not None:
        mismatch = _output_mismatch(model, gm, args, kwargs, *check)
        if mismatch is not None:
            fx_error = f"torch.fx traced, but the traced program disagrees with the model: {mismatch}"
            if forced:
                raise TraceError(fx_error + "; try frontend='export'")
            return None, fx_error
    return gm, None


def _export_or_explain(model: nn.Module, args: tuple, kwargs: dict, bound: inspect.BoundArguments,
                       fx_error: str | None, *, check: tuple[Any, float, float] | None) -> fx.GraphModule:
    """The torch.export program, or a TraceError saying what both front ends hit and what to try."""
    try:
        gm = _trace_export(model, args, kwargs)
    except Exception as err:  # noqa: BLE001
        if check is None:  # the model has not run yet: is it the model that fails?
            _raise_model_failure(model, args, kwargs, bound)
        export_error = _describe_failure(err, model)
        first = f"torch.fx failed: {fx_error}\n" if fx_error else ""
        raise TraceError(
            f"could not trace {type(model).__name__}.\n{first}"
            f"torch.export (non-strict) failed: {export_error}\n"
            "What to try: make the failing code avoid Python control flow that depends on "
            "tensor values, pass the inputs the model really expects, or mark the failing "
            "submodule as a leaf (leaf_modules=[...]) for the fx front end."
        ) from None
    if check is not None:
        mismatch = _output_mismatch(model, gm, args, kwargs, *check)
        if mismatch is not None:
            raise TraceError(f"torch.export traced {type(model).__name__}, but the traced program "
                             f"disagrees with the model on the sample: {mismatch}")
    return gm


# ------------------------------------------------------------------ inputs


def _as_args(example_args: Any) -> tuple:
    if isinstance(example_args, tuple):
        return example_args
    if isinstance(example_args, list):
        return tuple(example_args)
    return (example_args,)


def _bind(model: nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Bind the sample to ``model.forward``, or say clearly how they disagree."""
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise TraceError(
            f"the sample inputs do not match {type(model).__name__}.forward{signature}: {err}. "
            "Pass example_args / example_kwargs the way you would call the model."
        ) from None
    return bound


# ------------------------------------------------------------------ front ends


def _trace_fx(model: nn.Module, bound: inspect.BoundArguments, leaf_modules: Iterable[type | str]) -> fx.GraphModule:
    leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
    leaf_paths = frozenset(m for m in leaf_modules if isinstance(m, str))
    signature = inspect.signature(model.forward)
    concrete: dict[str, Any] = {}
    for name, param in signature.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            if name in bound.arguments:
                raise TraceError(f"torch.fx cannot trace *args/**kwargs of {type(model).__name__}.forward")
            continue
        if name in bound.arguments:
            value = bound.arguments[name]
            if not _has_tensor(value):
                concrete[name] = value  # a flag or size: specialise on it
        elif param.default is not inspect.Parameter.empty:
            concrete[name] = param.default
    tracer = _LeafTracer(leaf_types, leaf_paths)
    graph = tracer.trace(model, concrete_args=concrete or None)
    # fx names specialised arguments ``x_1``; keep the model's own argument names so the
    # traced program is called exactly like the model.
    names = [n for n, p in signature.parameters.items()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) == len(names):
        for node, name in zip(placeholders, names):
            node.target = name
    gm = fx.GraphModule(tracer.root, graph, model.__class__.__name__)
    return gm


def _trace_export(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    with _quiet_torch_logs():
        exported = torch.export.export(model, args, kwargs, strict=False)
    gm = exported.module()
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
        elif node.op == "call_function" and str(node.target) in _EXPORT_CHECK_TARGETS and not node.users:
            graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    graph.lint()
    gm.recompile()
    return gm


def _has_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


def _describe_failure(err: BaseException, model: nn.Module, limit: int = 500) -> str:
    """One line: the exception, the deepest submodule of ``model`` and the line of its code."""
    modules = {id(m): name for name, m in model.named_modules()}
    module_path: str | None = None
    user_frame = None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in modules:
            module_path = modules[id(owner)]
        filename = frame.f_code.co_filename
        if is_user_file(filename):
            user_frame = (filename, lineno, frame.f_code.co_name)
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    head = lines[0][:limit] if lines else ""
    text = f"{type(err).__name__}: {head}"
    if module_path is not None:
        text += f" [in module '{module_path or '(root)'}' ({type(model.get_submodule(module_path)).__name__})]"
    if user_frame is not None:
        filename, lineno, func = user_frame
        code = linecache.getline(filename, lineno).strip()
        text += f" at {filename}:{lineno} in {func}: `{code}`"
    return text


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs whole graphs and fake-tensor tracebacks on failure; our error says what matters."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)  # its loggers hold their own handlers: levels on "torch" do not reach them
    try:
        # export prints the partial graph of a failed trace straight to stderr.
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _fresh(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A copy of the inputs: a model may write into them, and the caller's stay as they were."""
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))


@contextlib.contextmanager
def _side_effect_free(model: nn.Module) -> Iterator[None]:
    """Run the model without a trace of it: no gradients, seeded, buffers and RNG restored after."""
    state = _snapshot_buffers(model)
    rng = torch.get_rng_state()
    try:
        with torch.no_grad():
            torch.manual_seed(0)
            yield
    finally:
        _restore_buffers(model, state)
        torch.set_rng_state(rng)


def _run_model(model: nn.Module, args: tuple, kwargs: dict, bound: inspect.BoundArguments) -> Any:
    """The model's output on the sample; UserCodeError when the model itself raises."""
    try:
        with _side_effect_free(model):
            call_args, call_kwargs = _fresh(args, kwargs)
            return model(*call_args, **call_kwargs)
    except Exception as err:  # noqa: BLE001 - whatever the model raises is the model's
        raise UserCodeError(user_code_message(
            err, f"{type(model).__name__} raised", model=model, inputs=bound.arguments)) from err


def _raise_model_failure(model: nn.Module, args: tuple, kwargs: dict, bound: inspect.BoundArguments) -> None:
    """Run the model eagerly; raise UserCodeError when it fails for a reason of its own (not the meta device)."""
    try:
        _run_model(model, args, kwargs, bound)
    except UserCodeError as err:
        cause = err.__cause__
        # Some models cannot run eagerly on meta tensors (data-dependent code, .item()) and yet export:
        # such a failure says nothing about the model.
        if _on_meta(model) and (isinstance(cause, NotImplementedError) or "meta" in str(cause).lower()):
            return
        raise


def _output_mismatch(model: nn.Module, gm: fx.GraphModule, args: tuple, kwargs: dict, expected: Any,
                     rtol: float, atol: float) -> str | None:
    """None when the traced program reproduces the model's output (``expected``) on the sample."""
    if _on_meta(model) or expected is None:
        return None  # nothing to compare on the meta device, or no check asked for
    try:
        with _side_effect_free(model):
            call_args, call_kwargs = _fresh(args, kwargs)
            got = gm(*call_args, **call_kwargs)
    except Exception as err:  # noqa: BLE001
        return f"running it raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    got_leaves, got_spec = pytree.tree_flatten(got)
    if len(exp_leaves) != len(got_leaves):
        return f"the model returns {len(exp_leaves)} values, the traced program {len(got_leaves)}"
    for i, (e, g) in enumerate(zip(exp_leaves, got_leaves)):
        if isinstance(e, torch.Tensor):
            if not isinstance(g, torch.Tensor) or e.shape != g.shape:
                return f"output {i}: expected a tensor of shape {tuple(e.shape)}, got {getattr(g, 'shape', type(g).__name__)}"
            if e.is_floating_point() or e.is_complex():
                if not torch.allclose(e, g, rtol=rtol, atol=atol, equal_nan=True):
                    diff = (e - g).abs().max().item()
                    return f"output {i} differs by up to {diff:.3g}"
            elif not torch.equal(e, g):
                return f"output {i} differs"
    return None


def untangle_return_dict(model: nn.Module) -> None:
    """Let only the top-level model of a Hugging Face model return tuples (a no-op for any other model).

    With ``return_dict=False`` in its config, transformers 5 makes the inner models (the
    GPT2Model inside GPT2LMHeadModel, the T5 stacks) return tuples too, and the heads,
    which read ``outputs.last_hidden_state``, fail: the model cannot run at all. The top
    level gets its own copy of the config with ``return_dict=False`` and the inner configs
    return dicts again, so the model returns the tuple its config asks for.
    """
    top = getattr(model, "config", None)
    if top is None or getattr(top, "return_dict", None) is not False:
        return
    inner = {id(c): c for m in model.modules() if m is not model
             for c in [getattr(m, "config", None)] if c is not None and getattr(c, "return_dict", None) is False}
    if id(top) in inner:
        model.config = copy.copy(top)
    for config in inner.values():
        config.return_dict = True


def drop_generation_cache(model: nn.Module) -> None:
    """Turn a Hugging Face model's key/value cache off (a no-op for any other model).

    ``use_cache=True`` (transformers' default) makes the model return a ``DynamicCache``,
    which torch.export cannot trace through; the cache serves generation, not training
    steps or the forward passes smp runs, so it is switched off in the model's config.
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", None) is True:
            config.use_cache = False


def _on_meta(model: nn.Module) -> bool:
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    return tensor is not None and tensor.is_meta


def _snapshot_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _restore_buffers(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in state:
                b.copy_(state[name])


# ------------------------------------------------------------------ node metadata


def node_module(node: fx.Node) -> str:
    """Module path the node came from ('' for the root module)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, _ = list(stack.values())[-1]
        return _clean_path(str(path))
    return ""


def _clean_path(path: str) -> str:
    # Older exporters spell paths as L['self'].layers[0] / L__self___layers_0.
    if path.startswith("L['self']."):
        path = path[len("L['self']."):]
    return path.replace("[", ".").replace("]", "").replace("'", "")


def _annotate(gm: fx.GraphModule, model: nn.Module) -> None:
    """Record each op's module path and the parameter/buffer names it reads."""
    param_ids = {id(p) for p in model.parameters()}
    buffer_ids = {id(b) for b in model.buffers()}
    gm_params = dict(gm.named_parameters(remove_duplicate=False))
    gm_buffers = dict(gm.named_buffers(remove_duplicate=False))
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        params: list[str] = []
        buffers: list[str] = []
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            for name, p in sub.named_parameters(remove_duplicate=False):
                params.append(f"{node.target}.{name}")
            for name, b in sub.named_buffers(remove_duplicate=False):
                buffers.append(f"{node.target}.{name}")
        for arg in _flat_nodes(node):
            if arg.op != "get_attr":
                continue
            target = str(arg.target)
            if target in gm_params:
                params.append(target)
            elif target in gm_buffers:
                tensor = gm_buffers[target]
                (params if id(tensor) in param_ids else buffers).append(target)
            else:
                tensor = _resolve_attr(gm, target)
                if isinstance(tensor, torch.Tensor):
                    if id(tensor) in param_ids:
                        params.append(target)
                    elif id(tensor) in buffer_ids:
                        buffers.append(target)
        node.meta["smp_module"] = node_module(node)
        node.meta["smp_params"] = tuple(dict.fromkeys(params))
        node.meta["smp_buffers"] = tuple(dict.fromkeys(buffers))



def _flat_nodes(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) or n)
    return found


def _resolve_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
