"""v1's rank helpers: rank, size, local_rank, local_size, pp/mp and dp coordinates, process groups.

The pipeline and data-parallel coordinates come from smp's PipelinedModel when it has them
(``pp_rank``, ``pp_size``, ``dp_rank``, ``dp_size``), else from the world size, the
partitions and ``placement_strategy`` (smp.v1.ranks.topology).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from smp.v1.errors import V1Error
from smp.v1.model import DistributedModel
from smp.v1.state import current

__all__ = ["rank", "size", "local_rank", "local_size", "pp_rank", "pp_size", "mp_rank", "mp_size", "dp_rank",
           "dp_size", "rdp_rank", "rdp_size", "tp_rank", "tp_size", "get_mp_group", "get_dp_group",
           "get_world_process_group", "get_mp_process_group", "get_dp_process_group", "get_pp_process_group",
           "get_rdp_process_group"]


def _coordinate(name: str) -> int:
    st = current()
    pipe = st.model.pipe if isinstance(st.model, DistributedModel) else None
    value = getattr(pipe, name, None)
    return int(value) if isinstance(value, int) else int(getattr(st.topology, name))


def rank() -> int:
    """This process's global rank."""
    return current().topology.rank


def size() -> int:
    """The number of processes."""
    return current().topology.world


def local_rank() -> int:
    """This process's rank among the processes of its machine (use it to pick the GPU)."""
    return current().launch.local_rank


def local_size() -> int:
    """The number of processes on this machine."""
    return current().launch.local_size


def pp_rank() -> int:
    """This rank's pipeline stage (partition) within its model replica; 0 in a lone process running them all."""
    return _coordinate("pp_rank")


def pp_size() -> int:
    """The number of partitions (pipeline stages)."""
    return _coordinate("pp_size")


def dp_rank() -> int:
    """This rank's data-parallel replica."""
    return _coordinate("dp_rank")


def dp_size() -> int:
    """The number of data-parallel replicas."""
    return _coordinate("dp_size")


mp_rank, mp_size = pp_rank, pp_size  # without tensor parallelism the model-parallel group is the pipeline
rdp_rank, rdp_size = dp_rank, dp_size  # without tensor parallelism "reduced" data parallelism is data parallelism


def tp_rank() -> int:
    """Always 0: smp has no tensor parallelism."""
    return 0


def tp_size() -> int:
    """Always 1: smp has no tensor parallelism."""
    return 1


def get_mp_group() -> list[int]:
    """The global ranks holding this rank's model replica."""
    return list(current().topology.mp_group)


def get_dp_group() -> list[int]:
    """The global ranks holding replicas of this rank's partition."""
    return list(current().topology.dp_group)


def get_world_process_group() -> Any:
    """torch.distributed's group of every process (the default group)."""
    if not current().distributed:
        raise V1Error("there is no process group in a lone process (no launcher)")
    return dist.group.WORLD


def _process_group(ranks: tuple[int, ...]) -> Any:
    st = current()
    if not st.distributed:
        raise V1Error("there is no process group in a lone process (no launcher)")
    return st.process_groups[ranks]


def get_mp_process_group() -> Any:
    """The torch.distributed group (default backend) of this model replica's ranks (its pipeline)."""
    return _process_group(current().topology.mp_group)


def get_dp_process_group() -> Any:
    """The torch.distributed group (default backend) of this partition's replicas: all-reduce over it to average
    a value over the data-parallel replicas (a group of this rank alone without data parallelism)."""
    return _process_group(current().topology.dp_group)


get_pp_process_group = get_mp_process_group  # v1's later names, without tensor parallelism the same groups
get_rdp_process_group = get_dp_process_group
