"""``smp.DistributedModel``: the model, partitioned by smp at the first ``smp.step`` call (a PipelinedModel inside)."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from partitioner.graph import OUTPUT_OP
from runtime.batch import Microbatches
from runtime.checkpoint import MissingStateError, merge_partial_states
from smp.partition import PipelinedModel
from smp.v1 import planning
from smp.v1.comm import CommGroup, cpu_copy, gather_objects, group_ranks
from smp.v1.errors import V1Error
from smp.v1.run import StepRun
from smp.v1.state import current

__all__ = ["DistributedModel", "PARTIAL_KEY", "set_activation_checkpointing", "CHECKPOINT_STRATEGIES"]

#: v1's ways of checkpointing an nn.Sequential (each layer, groups of N, one segment); smp's stage-level
#: recomputation covers every one of them (docs/smp-v1.md).
CHECKPOINT_STRATEGIES = ("each", "group_N", "contiguous")

#: The key v1 put in a partial (one partition's) state dict.
PARTIAL_KEY = "_smp_is_partial"

_TRACE_DEVICES = ("gpu", "cpu")


class _Handle:
    """What ``register_post_partition_hook`` returns: ``remove()`` unregisters the hook."""

    def __init__(self, hooks: list[Callable[[DistributedModel], None]], hook: Callable[[DistributedModel], None]):
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


class DistributedModel(nn.Module):
    """The model to partition, as v1's ``smp.DistributedModel``.

    It is partitioned at the first call of an ``smp.step`` function, on that batch:
    automatically by smp's planner, or by ``with smp.partition(i):`` blocks when the
    configuration says ``"auto_partition": false``. Call it (``model(x)``) and
    ``model.backward(loss)`` inside ``smp.step`` functions. After partitioning,
    ``parameters()`` are this rank's; ``state_dict()`` is the full model (a collective);
    ``pipe`` is smp's ``PipelinedModel`` (plan, timeline, memory_stats).

    Data parallelism (``"ddp": true``): ``broadcast_buffers`` (default True) copies dp rank 0's
    buffers to the other replicas before each training step, as DistributedDataParallel does
    before each forward; ``overlapping_allreduce``, ``backward_passes_per_step``,
    ``bucket_cap_mb`` and ``gradient_as_bucket_view`` change nothing: smp's engine all-reduces
    each stage's gradients in its own buckets as soon as they are final, every step (which
    gives the same accumulated gradients). ``trace_execution_times`` and ``trace_memory_usage``
    change nothing either: smp always profiles every op's time and memory.
    """

    def __init__(self, module: nn.Module, trace_device: str = "gpu", trace_execution_times: bool = False,
                 overlapping_allreduce: bool = True, backward_passes_per_step: int = 1,
                 average_grads_across_microbatches: bool = True, bucket_cap_mb: int = 25,
                 trace_memory_usage: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False) -> None:
        super().__init__()
        st = current()
        if not isinstance(module, nn.Module):
            raise V1Error(f"smp.DistributedModel takes a torch.nn.Module, got {type(module).__name__}")
        if st.model is not None:
            raise V1Error("a v1 script wraps one model in smp.DistributedModel; call smp.init() again to start over")
        if trace_device not in _TRACE_DEVICES:
            raise V1Error(f"trace_device={trace_device!r}: \"gpu\" or \"cpu\"")
        self.module = module
        self.trace_device = trace_device
        self.average_grads_across_microbatches = bool(average_grads_across_microbatches)
        self.broadcast_buffers = bool(broadcast_buffers)
        # v1 put the partitions on the current device (scripts call torch.cuda.set_device(smp.local_rank()))
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self._pipe: PipelinedModel | None = None
        self._output_recomputed = False
        self._active: StepRun | None = None
        self._hooks: list[Callable[[DistributedModel], None]] = []
        # Parameter names by identity, taken now: after partitioning the model holds placeholders for other
        # ranks' parameters, while an optimizer made earlier still holds (emptied) originals.
        self._names: dict[int, str] = {id(p): n for n, p in module.named_parameters()}
        self._pending_state: dict[str, torch.Tensor] | None = None
        st.model = self

    # ------------------------------------------------------------ partitioning

    @property
    def partitioned(self) -> bool:
        """Whether the first smp.step call has partitioned the model."""
        return self._pipe is not None

    @property
    def pipe(self) -> PipelinedModel | None:
        """smp's PipelinedModel running the partitions (None before the first smp.step call)."""
        return self._pipe

    def register_post_partition_hook(self, hook: Callable[[DistributedModel], None]) -> _Handle:
        """Run ``hook(model)`` right after partitioning, before the first forward (now, if already partitioned)."""
        if self.partitioned:
            hook(self)
        else:
            self._hooks.append(hook)
        return _Handle(self._hooks, hook)

    def ensure_partitioned(self, micro: Microbatches, joined: tuple[tuple, dict]) -> None:
        """Partition once: planned on ``joined`` (the microbatches' model inputs as one batch), traced on the
        first microbatch as it runs."""
        if self._pipe is not None:
            return
        st = current()
        plan = planning.partition_plan(self.module, *joined, st, self.device, self.trace_device)
        planning.check_fits(plan, st, self.device)
        pipe = PipelinedModel(self.module, plan=plan, loss_fn=self._loss, timeout=st.config.timeout,
                              device=self.device, broadcast_buffers=self.broadcast_buffers)
        try:
            pipe.prepare_microbatches(micro)
        except torch.OutOfMemoryError as err:
            raise planning.out_of_memory(plan, st, self.device, "placing its partition") from err
        self._pipe = pipe
        # a recomputing output partition runs its forward without autograd and again before its backward
        self._output_recomputed = plan.recompute[plan.partition.stage_of[OUTPUT_OP]] != "none"
        for n, p in self.module.named_parameters():  # parameters made at partitioning (a model built without weights)
            self._names.setdefault(id(p), n)
        planning.warn_unreached(plan)
        if self._pending_state is not None:
            pipe.load_state_dict(self._pending_state)
            self._pending_state = None
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook(self)

    def need_pipe(self, what: str) -> PipelinedModel:
        if self._pipe is None:
            raise V1Error(f"{what} needs the model partitioned, which happens at the first call of an smp.step "
                          "function")
        return self._pipe

    # ------------------------------------------------------------ running (from smp.step)

    @contextlib.contextmanager
    def running(self, run: StepRun) -> Iterator[None]:
        """Within the block, ``model(...)`` and ``model.backward`` act for the step call ``run``."""
        if self._active is not None:
            raise V1Error("an smp.step function was called from inside another one; call them one after the other")
        self._active = run
        try:
            yield
        finally:
            self._active = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._active is None:
            raise V1Error("call the DistributedModel (model(...)) inside an smp.step function: the microbatches of "
                          "a step run through the pipeline together")
        return self._active.model_called(args, kwargs)

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """Backpropagate the loss of this microbatch through every partition (inside an smp.step function)."""
        if self._active is None:
            raise V1Error("call model.backward(loss) inside an smp.step function")
        self._active.backward(tensors, grad_tensors)

    def _loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        assert self._active is not None
        if self._output_recomputed and not any(t.requires_grad for t in pytree.tree_leaves(output)
                                               if isinstance(t, torch.Tensor)):
            # the engine asks for the loss of the forward without autograd too; it is the rerun's loss that
            # backpropagates, so the step function replays there, once per microbatch
            return torch.zeros((), device=self.device)
        return self._active.loss_for(output, index)

    def train_step(self, micro: Microbatches) -> None:
        """Forward and backward of every microbatch through the pipeline; gradients accumulate in the parameters.

        Each microbatch's target is its index: the loss replays the step function on that microbatch's output."""
        pipe = self.need_pipe("a training step")
        try:
            pipe.step_microbatches(replace(micro, targets=torch.arange(len(micro)).split(1)))
        except torch.OutOfMemoryError as err:
            raise planning.out_of_memory(pipe.plan, current(), self.device, "during a training step") from err

    def forward_only(self, micro: Microbatches) -> list[Any] | None:
        """The pipelined forward of every microbatch (no gradients): each one's output on the rank holding them,
        else None."""
        pipe = self.need_pipe("an evaluation step")
        try:
            return pipe.forward_microbatches(micro)
        except torch.OutOfMemoryError as err:
            raise planning.out_of_memory(pipe.plan, current(), self.device, "during an evaluation step") from err

    # ------------------------------------------------------------ parameters

    def param_name(self, p: torch.Tensor) -> str:
        """The model's name of parameter ``p`` (also of an emptied one another rank holds)."""
        name = self._names.get(id(p))
        if name is None:
            raise V1Error(f"a parameter of shape {tuple(p.shape)} is not one of the DistributedModel's")
        return name

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        """Every parameter before partitioning; this rank's afterwards (names as in the original model)."""
        source = self._pipe.named_parameters() if self._pipe is not None else self.module.named_parameters()
        for name, p in source:
            yield prefix + name, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters with their names (after partitioning)."""
        return self.need_pipe("local_named_parameters()").named_parameters()

    def local_parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (after partitioning)."""
        for _, p in self.local_named_parameters():
            yield p

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers with their names (after partitioning)."""
        self.need_pipe("local_named_buffers()")
        return ((n, b) for n, b in self.module.named_buffers() if not b.is_meta)

    def local_buffers(self) -> Iterator[torch.Tensor]:
        """This rank's buffers (after partitioning)."""
        for _, b in self.local_named_buffers():
            yield b

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The modules whose own parameters and buffers are all on this rank (after partitioning)."""
        self.need_pipe("local_named_modules()")
        for name, mod in self.module.named_modules():
            own = [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
            if own and not any(t.is_meta for t in own):
                yield name, mod

    def local_modules(self) -> Iterator[nn.Module]:
        """The modules held on this rank (after partitioning)."""
        for _, mod in self.local_named_modules():
            yield mod

    # ------------------------------------------------------------ state

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers by their original names, marked partial (v1's ``_smp_is_partial``)."""
        self.need_pipe("local_state_dict()")
        local = {k: v for k, v in self.module.state_dict().items() if isinstance(v, torch.Tensor) and not v.is_meta}
        return {**local, PARTIAL_KEY: True}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The whole model's state on every rank: a collective over the ranks of this model replica once
        partitioned (a rank that does not call it is named, after ``timeout`` seconds)."""
        if self._pipe is None:
            return self.module.state_dict()
        parts = gather_objects("state_dict()", cpu_copy(self.local_state_dict()), group_ranks(CommGroup.MP_GROUP))
        return _merge_partials(parts, list(self.module.state_dict().keys()))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> None:
        """Load a full state dict, or this rank's partial one (``smp.load(..., partial=True)``).

        Partial ones are merged over the ranks first (a collective), so a checkpoint loads
        whatever partition each rank now holds. Before partitioning the model takes it at once
        (or, built without weights, right after partitioning).
        """
        sd = dict(state_dict)
        if sd.pop(PARTIAL_KEY, False):
            parts = gather_objects("load_state_dict()", cpu_copy(sd), group_ranks(CommGroup.MP_GROUP))
            sd = _merge_partials(parts, list(self.module.state_dict().keys()))
        if self._pipe is not None:
            self._pipe.load_state_dict(sd, strict=strict)
        elif any(t.is_meta for t in [*self.module.parameters(), *self.module.buffers()]):
            self._pending_state = sd
        else:
            self.module.load_state_dict(sd, strict=strict, assign=assign)

    def cpu(self) -> DistributedModel:
        """Before partitioning, the model on the CPU; afterwards refused (v1 gathered every partition here)."""
        if self._pipe is not None:
            raise V1Error("DistributedModel.cpu() after partitioning: take the whole model with state_dict() (every "
                          "rank gets it) and load it into an unpartitioned copy")
        return super().cpu()

    def join(self) -> None:
        raise V1Error("DistributedModel.join() (uneven inputs across data-parallel replicas) is not supported: smp's "
                      "replicas run every step together. Give every dp rank the same number of batches of the same "
                      "size, e.g. DistributedSampler(dataset, num_replicas=smp.dp_size(), rank=smp.dp_rank(), "
                      "drop_last=True) and DataLoader(..., drop_last=True)")

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        raise V1Error("DistributedModel.register_comm_hook() is not supported: smp's engine all-reduces each "
                      "stage's gradients itself (their mean over the replicas, in buckets, overlapping the "
                      "backward); a communication hook cannot replace it")


def _merge_partials(parts: list[dict[str, Any]], order: list[str]) -> dict[str, Any]:
    """One full state dict from the ranks' partial ones (runtime.checkpoint's merge), on every rank; a key no rank
    holds is an error that says how the partial ones were meant to be saved."""
    try:
        return merge_partial_states([{k: v for k, v in part.items() if k != PARTIAL_KEY} for part in parts], order)
    except MissingStateError as err:
        raise V1Error(f"the partial state dicts of the {len(parts)} ranks hold no {err.missing[:3]} "
                      f"({len(err.missing)} entries): were they saved from this model, with every partition (smp.save "
                      "on every rank with dp_rank() == 0)?") from None


def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True, pack_args_as_tuple: bool = False,
                                 strategy: str = "each") -> None:
    """Recompute ``module``'s activations in the backward: the partitions running its ops recompute their whole
    forward ("full", see :func:`smp.v1.planning.recompute_checkpointed`). Call it before the first smp.step call.

    The rerun always draws the forward's random numbers again (``preserve_rng_state=False``
    changes nothing); ``pack_args_as_tuple`` and ``strategy`` only shape v1's own wrappers.
    """
    st = current()
    if not isinstance(module, nn.Module):
        raise V1Error(f"smp.set_activation_checkpointing() takes a torch.nn.Module, got {type(module).__name__}")
    if not (strategy in ("each", "contiguous") or (strategy.startswith("group_") and strategy[6:].isdigit()
                                                     and int(strategy[6:]) > 0)):
        raise V1Error(f"smp.set_activation_checkpointing(strategy={strategy!r}): \"each\", \"contiguous\" or "
                      "\"group_N\" (N a whole number > 0)")
    model = st.model
    if isinstance(model, DistributedModel):
        if model.partitioned:
            raise V1Error("smp.set_activation_checkpointing() after the first smp.step call: the model is partitioned "
                          "and planned then; call it before")
        planning.module_paths(model.module, module)  # refused now when it is not the model's
    st.checkpointed.append(module)
