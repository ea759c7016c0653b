"""Activation recomputation at run time: a stage's forward kept or dropped as its plan's choice says, and rerun in B.

The plan gives each stage one choice (``partitioner/recompute.py``, docs/memory.md):

- ``none``: the forward runs with autograd, which keeps what it saves until the backward.
- ``full``: the forward runs without autograd (nothing saved; the engine keeps the
  stage's received inputs and sent outputs); at the stage's B the forward runs again
  with autograd on the same inputs and the backward starts from the recomputed outputs.
  This is GPipe's re-materialization at stage granularity (Huang et al., NeurIPS 2019;
  torchgpipe's Checkpoint/Recompute pair, Kim et al. 2020), done by the engine rather
  than inside autograd so that a split backward (B, then a deferred W) differentiates
  one recomputed graph, held from B to W, exactly as the planner prices it
  (``peak_recomputing``): ``torch.utils.checkpoint`` would recompute again for W, and its
  selective mode refuses a second backward.
- ``selective``: the forward runs under torch's selective activation
  checkpointing modes (``torch.utils.checkpoint.create_selective_checkpoint_contexts``)
  with a :class:`~torch.utils.checkpoint.CheckpointPolicy` of ``MUST_SAVE`` for every
  aten op of a matmul-like fx node (the plan's own flag: the op graph's ``flops > 0``, so
  the runtime keeps exactly the nodes the planner priced as kept) and
  ``PREFER_RECOMPUTE`` for the rest: the caching mode keeps those outputs; B reruns
  the forward under the cached mode, which hands them back instead of recomputing them
  (Megatron-LM's selective recomputation, Korthikanti et al., MLSys 2023). On a
  tensor-parallel stage the policy sees the DTensor-level ops (modes run before tensor
  subclasses): the kept outputs are DTensors, their storages their local shards, and a matmul
  node's functional collectives (a rowwise output's all-reduce) are kept as well, as
  torchtitan's selective policy keeps its reduce-scatters: B reruns no collective, as the
  planner prices it (a matmul node's collective is part of its forward, which selective does
  not rerun). The forward runs with autograd on, as the replay does and as
  ``torch.utils.checkpoint`` runs it, but saves nothing (its saved tensors are dropped, its
  outputs detached): torch runs other aten ops with autograd off (DTensor's ``to_local``
  returns its local tensor, with autograd a view of it), which the replay would not find
  in the cache.

Both reruns restore the random number generators to their state at the forward (dropout
draws the same masks) and undo what the rerun writes to the stage's buffers (BatchNorm's
running statistics are updated once per microbatch, as without recomputation).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import flop_registry

__all__ = ["Rerun", "RecomputeError", "forward_for_recompute", "recompute"]


class RecomputeError(RuntimeError):
    """A stage's recomputation did not replay its forward (the forward is not deterministic in its aten ops)."""


@dataclass
class Rerun:
    """What a recomputing stage keeps from its forward to rerun it in B: RNG states and the selective cache."""

    choice: str
    cpu_rng: torch.Tensor
    device_rng: tuple[torch.device, torch.Tensor] | None
    replay: tuple[Any, Any] | None = None  # selective: the cached-outputs mode and the random replay (full: None)


class _MarkingInterpreter(fx.Interpreter):
    """Runs a stage program node by node, telling the selective policy whether the node is matmul-like."""

    def __init__(self, gm: fx.GraphModule, matmul_nodes: Collection[str]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.matmul_nodes = matmul_nodes
        self.in_matmul = False

    def run_node(self, n: fx.Node) -> Any:
        self.in_matmul = n.name in self.matmul_nodes
        try:
            return super().run_node(n)
        finally:
            self.in_matmul = False


#: The namespace of torch's functional collectives (what DTensor's redistributions run).
_COLLECTIVES = "_c10d_functional"


def _plain_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The plain tensors holding the tensors of ``tree``: a tensor subclass's (DTensor's local shard, an
    asynchronous collective's result) through torch's wrapper-subclass protocol."""
    for t in pytree.tree_leaves(tree):
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):  # (a DTensor's inner attributes include its mesh: skipped above)
            yield from _plain_tensors([getattr(t, name) for name in t.__tensor_flatten__()[0]])
        else:
            yield t


def _storages(tree: Any) -> set[int]:
    """Data pointers of the storages under the tensors of ``tree``."""
    return {t.untyped_storage().data_ptr() for t in _plain_tensors(tree)}


def _is_collective(op: Any) -> bool:
    """Whether ``op`` is one of torch's functional collectives (not their wait, which only waits)."""
    return op.namespace == _COLLECTIVES and op.overloadpacket is not torch.ops._c10d_functional.wait_tensor


def _nothing_saved() -> torch.autograd.graph.saved_tensors_hooks:
    """Autograd on, keeping none of what it saves (a graph no backward runs: the replay builds the one B uses)."""
    def dropped(_: torch.Tensor) -> None:
        return None

    def missing(_: None) -> torch.Tensor:
        raise RecomputeError("a selective stage's first forward was differentiated: only its replay keeps a graph")

    return torch.autograd.graph.saved_tensors_hooks(dropped, missing)


def _rng_states(device: torch.device) -> tuple[torch.Tensor, tuple[torch.device, torch.Tensor] | None]:
    dev = (device, torch.cuda.get_rng_state(device)) if device.type == "cuda" else None
    return torch.get_rng_state(), dev


@contextmanager
def _restored_rng(rerun: Rerun) -> Iterator[None]:
    """The generators as they were at the forward, and afterwards as they were before this rerun."""
    devices = [rerun.device_rng[0]] if rerun.device_rng is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(rerun.cpu_rng)
        if rerun.device_rng is not None:
            torch.cuda.set_rng_state(rerun.device_rng[1], rerun.device_rng[0])
        yield


@contextmanager
def _buffers_kept(gm: torch.nn.Module) -> Iterator[None]:
    """Undo what the rerun writes to the stage's buffers: the forward already applied it."""
    buffers = [b for b in gm.buffers() if not b.is_meta]
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in zip(buffers, saved):
                b.copy_(v)


def forward_for_recompute(gm: fx.GraphModule, args: list[Any], choice: str, matmul_nodes: Collection[str],
                          device: torch.device, keep: Callable[[torch.Tensor], None]) -> tuple[Any, Rerun]:
    """Run the stage's forward keeping nothing for autograd, as ``choice`` ("full" or "selective") says; ``keep``
    is told of every tensor the selective cache holds until B. Returns the outputs (no autograd graph) and what
    :func:`recompute` needs."""
    cpu_rng, device_rng = _rng_states(device)
    if choice == "full":
        with torch.no_grad():
            return gm(*args), Rerun(choice, cpu_rng, device_rng)
    interp = _MarkingInterpreter(gm, matmul_nodes)
    kept: set[int] = set()  # storages of the cached outputs
    # A cached op that draws random numbers (attention with dropout) does not draw them again in the replay:
    # the generators' state after it is recorded (by the index of the random op) and set again there.
    seeded = [0]
    after: dict[int, tuple[torch.Tensor, tuple[torch.device, torch.Tensor] | None]] = {}

    def writes_kept(op: Any, a: Any, k: Any) -> bool:
        return op._schema.is_mutable and not kept.isdisjoint(_storages((a, k)))

    def policy(ctx: Any, op: Any, *a: Any, **k: Any) -> CheckpointPolicy:
        save = interp.in_matmul and (op.overloadpacket in flop_registry or _is_collective(op) or
                                     writes_kept(op, a, k))
        if torch.Tag.nondeterministic_seeded in op.tags:
            seeded[0] += 1
            if save:
                after[seeded[0]] = _rng_states(device)
        if save:
            kept.update(_storages(ctx.op_output))
            return CheckpointPolicy.MUST_SAVE
        if writes_kept(op, a, k):
            raise RecomputeError(
                f"selective recomputation: {op} changes a kept matmul output in place outside the op that made it, "
                f"so the replay would read the changed value; plan this stage with recompute='full' (or 'none')")
        return CheckpointPolicy.PREFER_RECOMPUTE

    # Inside a matmul-like node the matmul kernels are cached (what torch's flop counter counts: the plan's own
    # test), and the in-place ops that change their outputs (Linear's matmul then add_(bias)): the replay returns
    # their final values without running them, so the change is not applied twice; a change from outside the
    # node is refused above.
    caching, cached = create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=True)
    with torch.enable_grad(), _nothing_saved(), caching:
        out = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, interp.run(*args))
    for entries in caching.storage.values():
        for entry in entries.values():
            for t in _plain_tensors([getattr(leaf, "val", None) for leaf in pytree.tree_leaves(entry)]):
                keep(t)
    return out, Rerun(choice, cpu_rng, device_rng, (cached, _RandomReplay(after)))


class _RandomReplay(TorchDispatchMode):
    """In the replay, sets the generators to their state after each cached random op, as the forward left them."""

    def __init__(self, after: dict[int, tuple[torch.Tensor, tuple[torch.device, torch.Tensor] | None]]) -> None:
        super().__init__()
        self.after = after
        self.seeded = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seeded += 1
            state = self.after.get(self.seeded)
            if state is not None:
                torch.set_rng_state(state[0])
                if state[1] is not None:
                    torch.cuda.set_rng_state(state[1][1], state[1][0])
        return out


def recompute(gm: fx.GraphModule, args: list[Any], rerun: Rerun, stage: int, *, hooks: bool = True) -> Any:
    """The stage's forward again, with autograd, on the same inputs and random state (see the module docstring).

    ``hooks=False`` runs ``gm.forward`` without the module's forward hooks (a sharded stage whose
    parameters the caller gathered: FSDP's hooks would run other ops than the first forward did)."""
    with ExitStack() as stack:
        stack.enter_context(_restored_rng(rerun))
        stack.enter_context(_buffers_kept(gm))
        stack.enter_context(torch.enable_grad())
        if rerun.replay is not None:  # the cache, then (innermost: sees each op first) the random replay
            for mode in rerun.replay:
                stack.enter_context(mode)
        try:
            return gm(*args) if hooks else gm.forward(*args)
        except RuntimeError as err:
            if rerun.replay is None or "selective activation checkpoint" not in str(err) and \
                    "found in storage" not in str(err):
                raise
            raise RecomputeError(
                f"stage {stage}: selective recomputation could not replay the forward ({str(err).splitlines()[0]}): "
                "the stage runs other aten ops the second time, or changes a kept matmul output in place. "
                "Plan this stage with recompute='full' (or 'none').") from None
