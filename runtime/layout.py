"""Where a rank sits among D replicas of a P-rank pipeline of T-rank stages: its groups, from a DeviceMesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from partitioner.plan import PLACEMENTS
from runtime.errors import RuntimeConfigError as LayoutError

__all__ = ["ReplicaLayout"]


@dataclass
class ReplicaLayout:
    """This rank's place: pipeline rank ``pp_rank`` of replica ``dp_rank``, and the groups it talks in.

    ``pp_ranks[r]`` is the global rank of pipeline rank r of this replica (what point-to-point
    transfers address); ``dp_group`` holds this pipeline rank in every replica (what its
    gradient all-reduces run over). A DeviceMesh with dimensions "dp" and "pp" makes the groups.

    Tensor parallel (``tp_size`` T > 1): each pipeline rank is T ranks, consecutive global
    ranks (as within a node), the mesh's innermost dimension "tp"; ``tp_rank`` is this rank's
    place among them. A pipeline is then the ranks of one tp index: tp rank t of stage s sends
    to tp rank t of stage s + 1 (a cut inside a split region sends each rank's own shard).
    """

    dp_size: int
    pp_size: int
    dp_rank: int
    pp_rank: int
    placement: str
    pp_ranks: list[int]
    pp_group: Any = None
    dp_group: Any = None
    mesh: Any = None
    tp_size: int = 1
    tp_rank: int = 0

    @classmethod
    def build(cls, world: int, stages: int, placement: str, device: torch.device,
              planned_replicas: int | None = None, tensor_parallel: int = 1) -> ReplicaLayout:
        """Lay ``world`` ranks out as replicas of a ``stages``-rank pipeline, each pipeline rank
        ``tensor_parallel`` ranks (a collective when they are several)."""
        if placement not in PLACEMENTS:
            raise LayoutError(f"unknown placement {placement!r}; choose {' or '.join(PLACEMENTS)}")
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed:
            if tensor_parallel > 1:
                raise LayoutError(f"tensor_parallel={tensor_parallel} splits each stage over {tensor_parallel} "
                                  "processes: launch D x P x T ranks (torchrun), or drop tensor_parallel")
            return cls(1, stages, 0, 0, placement, [0])
        replicas = cls.replicas(world, stages, planned_replicas, tensor_parallel)
        rank = dist.get_rank()
        if replicas == 1 and tensor_parallel == 1:
            return cls(1, stages, 0, rank, placement, list(range(world)), dist.group.WORLD, None)
        from torch.distributed.device_mesh import init_device_mesh

        kind = "cuda" if device.type == "cuda" else "cpu"
        shape, names = ((replicas, stages), ("dp", "pp")) if placement == "cluster" else \
            ((stages, replicas), ("pp", "dp"))
        if tensor_parallel > 1:  # innermost: a stage's tp ranks are consecutive, inside one node
            shape, names = (*shape, tensor_parallel), (*names, "tp")
        mesh = init_device_mesh(kind, shape, mesh_dim_names=names)
        pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp") if replicas > 1 else None
        return cls(replicas, stages, mesh.get_local_rank("dp"), mesh.get_local_rank("pp"), placement,
                   dist.get_process_group_ranks(pp_group), pp_group, dp_group, mesh, tensor_parallel,
                   mesh.get_local_rank("tp") if tensor_parallel > 1 else 0)

    @staticmethod
    def replicas(world: int, stages: int, planned_replicas: int | None = None, tensor_parallel: int = 1) -> int:
        """How many replicas of a ``stages``-rank pipeline of ``tensor_parallel``-rank stages a ``world`` holds;
        a clear error when none fits."""
        ranks = stages * tensor_parallel  # one replica's
        if world % ranks and tensor_parallel > 1:
            raise LayoutError(
                f"the world size {world} is not a multiple of {stages} stages x tensor_parallel={tensor_parallel} "
                f"({ranks} ranks a replica): launch D x {ranks} processes")
        if world % ranks:
            raise LayoutError(
                f"the world size {world} is not a multiple of the pipeline's {stages} ranks: launch a multiple "
                f"of {stages} processes (torchrun --nproc_per_node {stages}, or D x {stages} for D replicas), "
                f"or pass stages= a divisor of {world}")
        replicas = world // ranks
        if planned_replicas not in (None, 1, replicas):
            raise LayoutError(
                f"the plan is for {planned_replicas} replicas of {ranks} ranks ({planned_replicas * ranks} in "
                f"all), the world has {world}: launch {planned_replicas * ranks} processes or re-plan")
        return replicas

    @property
    def is_first_replica(self) -> bool:
        return self.dp_rank == 0

    @property
    def tp_group(self) -> Any:
        """The process group of this rank's stage's tp ranks (None without tensor parallelism)."""
        return self.mesh.get_group("tp") if self.tp_size > 1 else None
