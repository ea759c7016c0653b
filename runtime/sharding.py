"""Sharded data parallelism at run time: this rank's stage programs under torch FSDP2's ``fully_shard`` over the replicas.

Each stage program (an fx GraphModule holding the model's own submodules and parameters by
reference) is wrapped by :func:`torch.distributed.fsdp.fully_shard` on the "dp" dimension of
the pipeline's DeviceMesh: its parameters become DTensors sharded over the stage's replicas
(``Shard(0)``), and FSDP2's hooks on the stage program's forward all-gather them for each
use. The mode (partitioner/sharding.py) sets when they are freed again: ``shard_grad_op``
keeps them gathered from the step's first forward to its gradient reduction,
``full_shard`` frees them after every forward and backward.

Gradients are synchronised once a step, as torch.distributed.pipelining's stage does
with FSDP: every backward of a step accumulates the stage's unsharded gradients without
communication (``set_requires_gradient_sync(False)``), and the schedule's REDUCE_SCATTER action
of the stage (:meth:`StageShards.reduce`) runs FSDP's post-backward, which reduce-scatters
them (mean over the replicas) into the sharded parameters' ``.grad`` and frees the
unsharded gradients and parameters.

Under tensor parallelism the stage programs' split parameters are DTensors over "tp" already
(runtime/tensor_parallel.py, applied first): ``fully_shard`` on the "dp" dimension of the same
mesh shards each tp rank's share (torchtitan's 2-D order), and what is read here of a parameter,
gradient or gathered copy is its local part (:func:`local`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn

from runtime.errors import RuntimeConfigError

__all__ = ["StageShards", "WorkingBytes", "local", "is_sharded", "is_strided", "storable", "gather_whole", "repoint",
           "shard_like", "copy_whole_into"]


def is_sharded(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a DTensor (a parameter, gradient or optimizer state sharded over the replicas)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def is_strided(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a DTensor strided over its ranks (each holds a share of each of several blocks: tensor
    parallelism's fused projections), which torch.distributed.checkpoint cannot store as chunks."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return is_sharded(t) and any(isinstance(p, _StridedShard) for p in t.placements)  # type: ignore[union-attr]


def storable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as torch.distributed.checkpoint stores it: a strided DTensor gathered whole (a collective over its
    mesh; every rank then writes the same whole tensor, stored once), any other as it is."""
    return gather_whole(t) if is_strided(t) else t


def _fused_under_dp(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fused projection's share (strided over "tp") that FSDP sharded over "dp" too.

    FSDP2 describes it as strided on both dimensions, which DTensor reads as another interleaving
    than the one its ranks hold (torch 2.13: its ``full_tensor()`` and ``distribute_tensor`` put
    the rows in the wrong places), so :func:`gather_whole` and
    :func:`shard_like` take it one dimension at a time: FSDP's chunks of the tp share, the tp
    shares of the whole.
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    if not is_sharded(t):
        return False
    names = t.device_mesh.mesh_dim_names or ()  # type: ignore[union-attr]
    return "dp" in names and "tp" in names and \
        isinstance(t.placements[names.index("tp")], _StridedShard)  # type: ignore[union-attr]


def _tp_share(t: Any) -> tuple[Any, Any, Any, torch.Size]:
    """A fused projection's (:func:`_fused_under_dp`) "dp" and "tp" meshes, its placement over "tp", and the
    shape of one tp rank's share (the style splits the rows evenly)."""
    mesh = t.device_mesh
    tp = mesh["tp"]
    placement = t.placements[mesh.mesh_dim_names.index("tp")]
    return mesh["dp"], tp, placement, torch.Size((t.shape[0] // tp.size(), *t.shape[1:]))


def gather_whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of ``t``: a DTensor gathered (a collective over its mesh), else ``t``."""
    if not is_sharded(t):
        return t
    if not _fused_under_dp(t):
        return t.full_tensor()  # type: ignore[attr-defined]
    from torch.distributed.tensor import DTensor, Shard

    dp, tp, placement, share = _tp_share(t)
    mine = DTensor.from_local(local(t), dp, [Shard(0)], run_check=False, shape=share,
                              stride=_contiguous_stride(share)).full_tensor()
    return DTensor.from_local(mine, tp, [placement], run_check=False, shape=t.shape,
                              stride=_contiguous_stride(t.shape)).full_tensor()


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what DTensor.from_local needs with a global shape)."""
    return torch.empty(shape, device="meta").stride()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (its storage: writes to it change ``t``), else ``t``."""
    return t.to_local() if is_sharded(t) else t


def shard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` cut as the DTensor ``like`` is (this rank's shard, no communication); ``whole`` if ``like`` is plain."""
    if not is_sharded(like):
        return whole
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    whole = whole.to(like.device)
    if not _fused_under_dp(like):
        return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)
    dp, tp, placement, _ = _tp_share(like)
    share = distribute_tensor(whole, tp, [placement], src_data_rank=None).to_local()
    mine = distribute_tensor(share, dp, [Shard(0)], src_data_rank=None).to_local()
    return DTensor.from_local(mine, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def copy_whole_into(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy the whole tensor ``whole`` into ``target``: into its shard when ``target`` is sharded."""
    with torch.no_grad():
        local(target).copy_(local(shard_like(whole, target)))


def repoint(roots: Sequence[nn.Module], pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every module of ``roots`` that holds an old tensor of ``pairs`` holds its new one instead."""
    new = {id(old): fresh for old, fresh in pairs}
    seen: set[int] = set()
    for root in roots:
        for mod in root.modules():
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            for key, t in list(mod._parameters.items()):
                if t is not None and id(t) in new:
                    mod._parameters[key] = new[id(t)]  # type: ignore[assignment]


class WorkingBytes(NamedTuple):
    """Bytes a rank holds whole while its stages compute under sharding: ``gathered`` parameters, unsharded
    ``gradients``."""

    gathered: int
    gradients: int

    @property
    def total(self) -> int:
        return self.gathered + self.gradients


class StageShards:
    """This rank's training stage programs, each wrapped by ``fully_shard`` over the replicas (``mesh``: 1-D, "dp").

    ``replaced`` pairs each original parameter with the sharded one that replaced it in the
    stage programs (the caller points the model and its other programs at the new ones). A
    parameter two stages of this rank share (a tie) cannot be one FSDP parameter of two
    modules: refused with the tie's name and the fix.
    """

    def __init__(self, mode: str, mesh: Any, stages: Mapping[int, nn.Module], names: Mapping[int, str]) -> None:
        from torch.distributed.fsdp import fully_shard

        self.mode = mode
        self.mesh = mesh
        _refuse_ties(stages, names)
        # where each parameter sits before FSDP replaces it there: FSDP names each of its parameters by place
        before = {(id(mod), name): p for gm in stages.values() for mod in gm.modules()
                  for name, p in mod._parameters.items() if p is not None}
        self.modules: dict[int, Any] = {}
        self.replaced: list[tuple[torch.Tensor, torch.Tensor]] = []
        for s, gm in stages.items():
            self.modules[s] = fully_shard(gm, mesh=mesh, reshard_after_forward=(mode == "full_shard"))
            for fp in _fsdp_params(self.modules[s]):
                info = fp._module_info
                self.replaced.append((before[(id(info.module), info.param_name)], fp.sharded_param))
        for old, _ in self.replaced:  # FSDP copied this rank's shard: the whole tensor is no longer needed
            old.data = torch.empty(0, dtype=old.dtype, device=old.device)
        self.gathered_storages: dict[int, torch.UntypedStorage] = {}  # the gathered parameters' (no activations)
        self.working_peak = WorkingBytes(0, 0)  # the step's most held whole at once (start_step resets it)
        self._sample_at_grad = False  # set by each backward's start: sample at its first gradient
        self._watched: set[int] = set()  # gathered parameters carrying the sampling hook
        for module in self.modules.values():
            module.register_forward_pre_hook(self._note_gathered)  # after FSDP's own pre-forward: gathered now

    def _note_gathered(self, module: nn.Module, args: Any) -> None:
        self._note_storages(_gathered_params(module))
        self._watch(module)
        self._note_working()

    def _note_storages(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            storage = local(p).untyped_storage()  # split over the tp ranks: a DTensor, its share's storage
            self.gathered_storages[storage.data_ptr()] = storage

    def holds_gathered(self, ptr: int) -> bool:
        """Whether ``ptr`` is a gathered parameter's storage now: FSDP frees a gathered storage by resizing it to
        nothing, and the allocator hands its address to what comes next (an activation, not a parameter)."""
        storage = self.gathered_storages.get(ptr)
        return storage is not None and storage.nbytes() > 0 and storage.data_ptr() == ptr

    def _watch(self, module: nn.Module) -> None:
        """Hook the module's gathered parameters (FSDP2 keeps one object per parameter across gathers) so a
        backward samples the working bytes at its first accumulated gradient: under full_shard the
        only moment its parameters are gathered beside the other microbatches' whole gradients."""
        for fp in _fsdp_params(module):
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None and unsharded.requires_grad and id(unsharded) not in self._watched:
                self._watched.add(id(unsharded))
                unsharded.register_post_accumulate_grad_hook(self._at_grad)

    def _at_grad(self, param: torch.Tensor) -> None:
        if self._sample_at_grad:
            self._sample_at_grad = False
            self._note_working()

    def backward_starts(self) -> None:
        """The engine runs a backward of a stage of this rank now (its first gradient samples the working bytes)."""
        self._sample_at_grad = True

    def working(self) -> WorkingBytes:
        """What this rank's stages hold whole now: the all-gathered parameters' storage, and the unsharded
        gradients the backwards accumulate until the reduce-scatter (partitioner.sharding's ``working``)."""
        gathered: dict[int, int] = {}
        grads = 0
        for module in self.modules.values():
            for fp in _fsdp_params(module):
                for t in fp.all_gather_outputs:  # freed (resized to 0) when resharded
                    gathered[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                unsharded = getattr(fp, "_unsharded_param", None)  # made at the first gather
                for g in (unsharded.grad if unsharded is not None else None, fp.unsharded_accumulated_grad):
                    if g is not None:
                        grads += local(g).untyped_storage().nbytes()
        return WorkingBytes(sum(gathered.values()), grads)

    def _note_working(self) -> None:
        """Sampled where the working bytes peak: after each forward's gather (the gradients of earlier
        backwards whole beside), at each backward's first gradient, and before each reduce-scatter."""
        now = self.working()
        if now.total > self.working_peak.total:
            self.working_peak = now

    def start_step(self) -> None:
        """Before a training step's first action: every backward accumulates without communicating; full_shard
        frees the gathered parameters after each backward, shard_grad_op keeps them to the reduction."""
        from torch.distributed.fsdp import fully_shard

        for module in self.modules.values():
            # each stage module is its own FSDP root, set up on its first forward through FSDP's hooks (a
            # selectively recomputing stage runs none): set up here, before the reduction needs it
            fully_shard.state(module)._lazy_init()
            module.set_requires_gradient_sync(False)
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(self.mode == "full_shard")
        self.working_peak = WorkingBytes(0, 0)

    def reduce(self, stage: int) -> None:
        """The stage's gradient reduction (its REDUCE_SCATTER action): FSDP's post-backward with sync on, which
        reduce-scatters the accumulated gradients into the sharded ``.grad`` and frees the gathered state."""
        from torch.distributed.fsdp import fully_shard

        module = self.modules.get(stage)
        if module is None:
            return
        self._note_working()
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        state = fully_shard.state(module)
        for st in state._state_ctx.all_states:
            for group in st._fsdp_param_groups:
                group.post_backward()
        # waits for the reduce-scatter (FSDP's streams on a GPU) and resets FSDP's per-backward state
        state._root_post_backward_final_callback()

    def gather(self, stage: int) -> None:
        """Gather the stage's parameters for a pass that runs outside FSDP's hooks: a selective recomputation's
        forwards (the first node by node; the rerun under the selective cache, which must see the same aten
        ops as the first, and FSDP's gathering would be others) and the backward that follows the rerun."""
        module = self.modules[stage]
        module.unshard()
        self._note_storages(_gathered_params(module))
        self._watch(module)

    def release(self, stage: int) -> None:
        """After a :meth:`gather`: full_shard frees the parameters again, shard_grad_op keeps them for the step."""
        if self.mode == "full_shard":
            self.modules[stage].reshard()

    def reshard_all(self) -> None:
        """Free every gathered parameter (after a forward-only pass, which runs no backward to free them)."""
        for module in self.modules.values():
            module.reshard()

    @contextmanager
    def gathered(self, roots: Sequence[nn.Module]) -> Iterator[None]:
        """Every parameter whole in ``roots`` (another program on the same parameters: the eval-mode trace)."""
        for module in self.modules.values():
            module.unshard()
        pairs = [(sharded, whole) for module in self.modules.values()
                 for sharded, whole in zip(_sharded_params(module), _gathered_params(module))]
        repoint(roots, pairs)
        try:
            yield
        finally:
            repoint(roots, [(whole, sharded) for sharded, whole in pairs])
            self.reshard_all()


def _fsdp_params(module: Any) -> list[Any]:
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)
    return [fp for group in state._fsdp_param_groups for fp in group.fsdp_params]


def _sharded_params(module: Any) -> list[nn.Parameter]:
    """The module's sharded parameters, in the order its ``parameters()`` gave them to ``fully_shard``."""
    return [fp.sharded_param for fp in _fsdp_params(module)]


def _gathered_params(module: Any) -> list[nn.Parameter]:
    return [fp.unsharded_param for fp in _fsdp_params(module)]


def _refuse_ties(stages: Mapping[int, nn.Module], names: Mapping[int, str]) -> None:
    owner: dict[int, int] = {}
    for s, gm in sorted(stages.items()):
        for p in gm.parameters():
            first = owner.setdefault(id(p), s)
            if first != s:
                raise RuntimeConfigError(
                    f"parameter {names.get(id(p), '?')!r} is tied between stages {first} and {s}, which run on the "
                    "same rank: FSDP2 cannot shard one parameter for two stage modules. Use sharding='none', or a "
                    "plan that puts the two stages on different ranks (another schedule or stage count).")
