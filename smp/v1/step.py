"""``@smp.step``: split the arguments into microbatches, run the function once per microbatch, pipeline the model.

How a step runs (docs/smp-v1.md): every rank runs the function on each microbatch up to
its ``model(...)`` call, which records the model's inputs and stops it (the capture). The
microbatches' inputs go through smp's pipeline in one call, as captured
(``PipelinedModel.step_microbatches``, or ``forward_microbatches`` under ``torch.no_grad()``;
runtime/batch.py); on the rank holding the model's output,
each microbatch's function runs again (the replay) with ``model(...)`` returning that
microbatch's output and ``model.backward(loss)`` handing the loss to the engine. What the
function returns is then shared with every rank of the pipeline.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.microbatch import batch_size
from runtime.batch import Microbatches
from smp.v1.comm import cpu_copy, share_from_holder
from smp.v1.errors import V1Error
from smp.v1.model import DistributedModel
from smp.v1.run import ModelCall, StepRun, autocast_as
from smp.v1.state import current

__all__ = ["step", "StepOutput", "StepFunction", "split_arguments"]

class StepOutput:
    """One tensor the step function returned, per microbatch (v1's ``StepOutput``)."""

    def __init__(self, outputs: Sequence[torch.Tensor]) -> None:
        self.outputs = list(outputs)

    def reduce_mean(self) -> torch.Tensor:
        """The element-wise mean over microbatches (the batch's loss, for a mean-reduced loss)."""
        return torch.stack(self.outputs).mean(dim=0)

    def reduce_sum(self) -> torch.Tensor:
        """The element-wise sum over microbatches."""
        return torch.stack(self.outputs).sum(dim=0)

    def concat(self) -> torch.Tensor:
        """The microbatches' tensors concatenated along the batch dimension (dim 0)."""
        return torch.cat(self.outputs, dim=0)

    def stack(self) -> torch.Tensor:
        """The microbatches' tensors stacked along a new dim 0."""
        return torch.stack(self.outputs)

    def __repr__(self) -> str:
        return f"StepOutput({len(self.outputs)} microbatches, {self.outputs!r})"


# ---------------------------------------------------------------------- arguments


def split_arguments(signature: inspect.Signature, args: tuple, kwargs: dict, m: int,
                    non_split: Sequence[str] = (), axes: dict[str, int] | None = None) -> list[tuple[tuple, dict]]:
    """The step function's arguments of each of ``m`` microbatches (v1's rules).

    Every tensor, also inside lists, tuples and dicts, is cut into ``m`` equal pieces along
    its batch axis (0, or ``axes[name]``); an object with ``smp_slice(num_mb, mb, axis)`` is
    sliced by it; arguments named in ``non_split`` and everything else go to every
    microbatch as they are.
    """
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise V1Error(f"the smp.step function was called with arguments that do not fit it: {err}") from None
    axes = axes or {}
    per_mb: list[dict[str, Any]] = [{} for _ in range(m)]
    for name, value in bound.arguments.items():
        if name in non_split or m == 1:
            pieces = [value] * m
        else:
            pieces = _split_value(value, m, axes.get(name, 0), name)
        for i in range(m):
            per_mb[i][name] = pieces[i]
    out = []
    for values in per_mb:
        b = inspect.BoundArguments(signature, values)  # type: ignore[arg-type]
        out.append((b.args, b.kwargs))
    return out


def _split_value(value: Any, m: int, axis: int, name: str) -> list[Any]:
    leaves, spec = pytree.tree_flatten(value)
    columns = [_split_leaf(leaf, m, axis, name) for leaf in leaves]
    return [pytree.tree_unflatten([col[i] for col in columns], spec) for i in range(m)]


def _split_leaf(leaf: Any, m: int, axis: int, name: str) -> list[Any]:
    if hasattr(leaf, "smp_slice"):
        return [leaf.smp_slice(m, i, axis) for i in range(m)]
    if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
        return [leaf] * m
    if axis >= leaf.dim():
        raise V1Error(f"argument {name!r} of the smp.step function has {leaf.dim()} dimensions, so it cannot be split "
                      f"along axis {axis}; fix input_split_axes or list it in non_split_inputs")
    size = leaf.shape[axis]
    if size % m:
        raise V1Error(f"argument {name!r} of the smp.step function has size {size} along axis {axis}, which does not "
                      f"divide into {m} microbatches: use a batch size that is a multiple of {m} (e.g. "
                      "DataLoader(drop_last=True)), or list the argument in non_split_inputs")
    return list(torch.chunk(leaf, m, dim=axis))


# ---------------------------------------------------------------------- one step


def _microbatches(calls: list[ModelCall], name: str) -> Microbatches:
    """The microbatches' model inputs as captured, handed to the pipeline as they are (runtime.batch).

    smp runs one traced program for every microbatch: the calls must pass inputs of one
    structure, tensors where the first passes a tensor, and the same non-tensor values.
    """
    flat = [pytree.tree_flatten((c.args, c.kwargs)) for c in calls]
    spec = flat[0][1]
    if any(f[1] != spec for f in flat[1:]):
        raise V1Error(f"{name} calls the model with differently structured inputs in different microbatches")
    for j, first in enumerate(flat[0][0]):
        column = [f[0][j] for f in flat]
        if any(isinstance(v, torch.Tensor) for v in column):
            if not all(isinstance(v, torch.Tensor) for v in column):
                raise V1Error(f"{name}: model input {j} is a tensor in some microbatches only")
        elif any(v is not first and v != first for v in column):
            raise V1Error(f"{name}: model input {j} ({first!r}, ...) differs between microbatches; smp runs one "
                          "program for all of them, so non-tensor inputs must be the same")
    return Microbatches(tuple((c.args, c.kwargs) for c in calls))


def _joined(micro: Microbatches, name: str) -> tuple[tuple, dict]:
    """The microbatches as one batch that smp's planner cuts back into the same microbatches (planning only).

    A tensor that is the same object in every microbatch (a non-split argument) goes in
    once; the others are concatenated along dim 0, which must then be the batch's.
    """
    if len(micro) == 1:
        return micro.inputs[0]
    flat = [pytree.tree_flatten(piece) for piece in micro.inputs]
    spec = flat[0][1]
    merged: list[Any] = []
    concatenated: list[torch.Tensor] = []
    for j, first in enumerate(flat[0][0]):
        column = [f[0][j] for f in flat]
        if all(v is first for v in column) or not isinstance(first, torch.Tensor):
            merged.append(first)
        elif all(v.dim() > 0 for v in column):
            merged.append(torch.cat(column, dim=0))
            concatenated.append(merged[-1])
        else:
            raise V1Error(f"{name}: model input {j} is a tensor without a batch dimension that differs between "
                          "microbatches; smp cannot split it")
    args, kwargs = pytree.tree_unflatten(merged, spec)
    size = batch_size(args, kwargs)
    stray = [t for t in concatenated if t.shape[0] != size]
    if stray or not concatenated:
        raise V1Error(f"{name}: smp's planner cuts every model input along dim 0 by the first input's batch "
                      f"size ({size}); the model's inputs do not all have that batch size once the microbatches are "
                      "joined. Give the model its batch-sized tensor first, and split every per-example input along "
                      "dim 0 (input_split_axes)")
    return args, kwargs


def _to(value: Any, device: torch.device | None) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _assemble(returns: list[Any], name: str) -> Any:
    """The microbatches' returns as one structure: a StepOutput per tensor, a list per other value."""
    flat = [pytree.tree_flatten(r) for r in returns]
    spec = flat[0][1]
    if any(f[1] != spec for f in flat[1:]):
        raise V1Error(f"{name} returned differently structured values for different microbatches")
    out = []
    for j in range(len(flat[0][0])):
        column = [f[0][j] for f in flat]
        out.append(StepOutput(column) if all(isinstance(v, torch.Tensor) for v in column) else column)
    return pytree.tree_unflatten(out, spec)


# ---------------------------------------------------------------------- the decorator


class StepFunction:
    """A function decorated with ``@smp.step``; calling it runs one pipelined step (see the module docstring).

    ``detach_outputs`` is accepted for v1's signature: returned tensors are always detached
    (gradients flow through ``model.backward`` only, inside the step).
    """

    def __init__(self, fn: Callable[..., Any], non_split_inputs: Sequence[str] | None = None,
                 input_split_axes: dict[str, int] | None = None, detach_outputs: bool = True) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = f"smp.step function {getattr(fn, '__qualname__', fn)!r}"
        self.signature = inspect.signature(fn)
        self.non_split = tuple(non_split_inputs or ())
        self.axes = dict(input_split_axes or {})
        unknown = [n for n in [*self.non_split, *self.axes] if n not in self.signature.parameters]
        if unknown:
            raise V1Error(f"@smp.step names arguments {unknown} that {fn.__qualname__} does not have "
                          f"(it has {list(self.signature.parameters)})")
        self._warned = False

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """A decorated method binds its instance, as the plain function would."""
        return self if instance is None else functools.partial(self.__call__, instance)

    def warn_no_backward(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"{self.name} ran with gradients enabled but did not call model.backward(): the step ran "
                          "the pipeline's backward with zero gradients. Run evaluation steps under torch.no_grad() "
                          "to run the forward only", stacklevel=2)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        st = current()
        model = st.model
        if not isinstance(model, DistributedModel):
            raise V1Error(f"{self.name} was called before smp.DistributedModel(model) wrapped a model")
        m = st.config.microbatches
        micro = split_arguments(self.signature, args, kwargs, m, self.non_split, self.axes)
        run = StepRun(self.fn, self.name, self.warn_no_backward, micro, torch.is_grad_enabled(),
                      model.average_grads_across_microbatches)
        with model.running(run):
            calls = [run.capture(i) for i in range(m)]
            micro = _microbatches(calls, self.name)
            if not model.partitioned:  # planned on the batch the microbatches make together
                model.ensure_partitioned(micro, _joined(micro, self.name))
            with autocast_as(calls[0].autocast):
                holds, error = self._pipeline(model, run, micro)
        sendable = cpu_copy(run.returns) if holds and st.distributed else None
        failure = f"{type(error).__name__}: {error}" if error is not None else None
        shared = share_from_holder(f"the results of {self.name}", {"returns": sendable, "failure": failure}, holds, st)
        if error is not None:
            raise error
        if shared["failure"]:
            raise V1Error(f"{self.name} raised on the rank holding the model's output: {shared['failure']}")
        returns = run.returns if holds else [_to(r, model.device) for r in shared["returns"]]
        return _assemble(returns, self.name)

    def _pipeline(self, model: DistributedModel, run: StepRun, micro: Microbatches) -> tuple[bool, Exception | None]:
        """Run the pipeline: (whether this rank ran the function on the model's outputs, the error that raised)."""
        if run.training:
            model.train_step(micro)
            return run.replayed, None
        outputs = model.forward_only(micro)
        if outputs is None:  # another rank holds the model's output
            return False, None
        try:
            for i, piece in enumerate(outputs):
                run.replay(i, piece)
        except Exception as err:  # noqa: BLE001 - the other ranks must learn it first; it is raised here as it was
            return True, err
        return True, None


def step(fn: Callable[..., Any] | None = None, *, non_split_inputs: Sequence[str] | None = None,
         input_split_axes: dict[str, int] | None = None, detach_outputs: bool = True) -> Any:
    """``@smp.step`` or ``@smp.step(non_split_inputs=[...], input_split_axes={...})`` (v1's decorator)."""
    if fn is None:
        return functools.partial(StepFunction, non_split_inputs=non_split_inputs, input_split_axes=input_split_axes,
                                 detach_outputs=detach_outputs)
    return StepFunction(fn, non_split_inputs, input_split_axes, detach_outputs)
