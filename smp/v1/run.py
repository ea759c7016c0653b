"""One call of an ``@smp.step`` function: its microbatches, and what ``model(...)`` and ``model.backward`` do in it.

The capture runs the function up to its ``model(...)`` call, which records the model's inputs
(a :class:`ModelCall`) and stops it; the replay runs it again with ``model(...)`` returning
the microbatch's output and ``model.backward(loss)`` recording the loss for the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from smp.v1.errors import V1Error

__all__ = ["StepRun", "ModelCall", "autocast_as"]

_AUTOCAST_DEVICES = ("cuda", "cpu")


class _ModelCalled(BaseException):
    """Raised by ``model(...)`` while capturing: the microbatch's model inputs (a BaseException, so that a step
    function's own ``except Exception`` lets it through)."""

    def __init__(self, call: ModelCall) -> None:
        super().__init__()
        self.call = call


@dataclass
class ModelCall:
    """The inputs one microbatch gave the model, and the autocast state around the call."""

    args: tuple
    kwargs: dict
    autocast: tuple[tuple[str, torch.dtype], ...]


class StepRun:
    """One call of a step function ``fn`` (called ``name`` in errors): its microbatches, and what ``model(...)`` /
    ``model.backward`` do right now; ``warn_no_backward()`` when a training microbatch called no backward."""

    def __init__(self, fn: Callable[..., Any], name: str, warn_no_backward: Callable[[], None],
                 micro: list[tuple[tuple, dict]], training: bool, average: bool) -> None:
        self.fn = fn
        self.name = name
        self.warn_no_backward = warn_no_backward
        self.micro = micro
        self.training = training
        self.average = average
        self.capturing = True
        self.output: Any = None
        self.called = False
        self.current = -1
        self.losses: list[torch.Tensor | None] = [None] * len(micro)
        self.returns: list[Any] = [None] * len(micro)
        self.replayed = False

    # ------------------------------------------------------------ what the model does

    def model_called(self, args: tuple, kwargs: dict) -> Any:
        if self.capturing:
            state = tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))
            raise _ModelCalled(ModelCall(args, kwargs, state))
        if self.called:
            raise V1Error(f"{self.name} called the DistributedModel twice for one microbatch: smp pipelines one "
                          "forward per microbatch; combine the calls into one forward")
        self.called = True
        return self.output

    def backward(self, tensors: Any, grad_tensors: Any) -> None:
        if self.capturing:
            raise V1Error(f"{self.name} called model.backward() before model(...)")
        if not self.training:
            raise V1Error(f"{self.name} called model.backward() under torch.no_grad(): run training steps with "
                          "gradients enabled, evaluation steps without model.backward()")
        loss = _scalar(tensors, grad_tensors)
        before = self.losses[self.current]
        self.losses[self.current] = loss if before is None else before + loss

    # ------------------------------------------------------------ the phases

    def capture(self, i: int) -> ModelCall:
        args, kwargs = self.micro[i]
        try:
            self.fn(*args, **kwargs)
        except _ModelCalled as called:
            return called.call
        raise V1Error(f"{self.name} returned without calling the DistributedModel: an smp.step function runs "
                      "the model (model(...)) once per microbatch")

    def replay(self, i: int, output: Any) -> None:
        self.capturing, self.current, self.output, self.called = False, i, output, False
        self.replayed = True
        args, kwargs = self.micro[i]
        result = self.fn(*args, **kwargs)
        if not self.called:
            raise V1Error(f"{self.name} did not call the DistributedModel for microbatch {i} when it ran again "
                          "with the model's output: its control flow must not depend on running twice")
        self.returns[i] = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, result)

    def loss_for(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The engine's loss function: microbatch ``index``'s function, replayed on its output."""
        i = int(index.reshape(-1)[0])
        self.replay(i, output)
        loss = self.losses[i]
        if loss is None:
            self.warn_no_backward()
            device = next((t.device for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)), None)
            # connected to nothing: the stages' backward carries zero gradients (added to, never changing, .grad)
            return torch.zeros((), device=device, requires_grad=True)
        return loss if self.average else loss * len(self.micro)


def _scalar(tensors: Any, grad_tensors: Any) -> torch.Tensor:
    """``model.backward(tensors, grad_tensors)`` as one scalar whose gradient is the same (torch.autograd.backward's
    contract): a scalar loss as it is, tensors with output gradients as sum(t * g)."""
    ts = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    if grad_tensors is None:
        gs: list[Any] = [None] * len(ts)
    else:
        gs = list(grad_tensors) if isinstance(grad_tensors, (list, tuple)) else [grad_tensors]
        if len(gs) != len(ts):
            raise V1Error(f"model.backward got {len(ts)} tensors and {len(gs)} gradients")
    total = None
    for t, g in zip(ts, gs):
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            raise V1Error("model.backward(loss): the loss does not depend on the DistributedModel's output (it does "
                          "not require grad); compute it from what model(...) returned")
        if g is None:
            if t.numel() != 1:
                raise V1Error(f"model.backward got a tensor of shape {tuple(t.shape)} without its gradient: pass a "
                              "scalar loss, or model.backward(outputs, output_gradients)")
            term = t.reshape(())
        else:
            term = (t * g.detach()).sum()
        total = term if total is None else total + term
    assert total is not None
    return total


def autocast_as(state: tuple[tuple[str, torch.dtype], ...]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype))
    return stack
