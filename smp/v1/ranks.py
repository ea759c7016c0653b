"""Who this process is: ranks from torchrun's or mpirun's environment, and its pipeline / data-parallel coordinates."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from smp.v1.config import V1Config
from smp.v1.errors import V1Error

__all__ = ["Launch", "Topology", "from_environment", "export_for_torch", "topology"]

#: (rank, world size, local rank, local size) variables of each launcher, in the order they are tried.
_LAUNCHERS = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "Open MPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "MPICH / Intel MPI": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}

DEFAULT_MASTER_PORT = "29500"


@dataclass(frozen=True)
class Launch:
    """This process's place among the launched ones; ``launcher`` is None for a lone process."""

    rank: int
    world: int
    local_rank: int
    local_size: int
    launcher: str | None


def from_environment(env: Mapping[str, str]) -> Launch:
    """Read the launcher's variables (torchrun, then Open MPI, then MPICH-style PMI); a lone process is rank 0 of 1."""
    for name, (rank, world, local_rank, local_size) in _LAUNCHERS.items():
        if rank in env and world in env:
            try:
                r, w = int(env[rank]), int(env[world])
                lr = int(env.get(local_rank, r))
                ls = int(env.get(local_size, w))
            except ValueError as err:
                raise V1Error(f"{name} set a rank variable that is not an integer ({err})") from None
            return Launch(r, w, lr, ls, name)
    return Launch(0, 1, 0, 1, None)


def export_for_torch(launch: Launch, env: MutableMapping[str, str]) -> None:
    """Give torch.distributed (env://) and smp's runtime the torchrun names for an MPI launch.

    mpirun sets no rendezvous address: one machine gets 127.0.0.1; several must export
    MASTER_ADDR (the host of rank 0) to every rank, e.g. ``mpirun -x MASTER_ADDR=node0``.
    """
    if launch.launcher in (None, "torchrun"):
        return
    env.setdefault("RANK", str(launch.rank))
    env.setdefault("WORLD_SIZE", str(launch.world))
    env.setdefault("LOCAL_RANK", str(launch.local_rank))
    env.setdefault("LOCAL_WORLD_SIZE", str(launch.local_size))
    if "MASTER_ADDR" not in env:
        if launch.local_size != launch.world:
            raise V1Error(f"launched by {launch.launcher} on several machines without MASTER_ADDR: export the host "
                          "name of rank 0 to every rank (mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=<port>)")
        env["MASTER_ADDR"] = "127.0.0.1"
    env.setdefault("MASTER_PORT", DEFAULT_MASTER_PORT)


@dataclass(frozen=True)
class Topology:
    """This rank's coordinates: pipeline (pp) rank and size, data-parallel (dp) rank and size, and the ranks of
    its model replica (``mp_group``) and of its partition's replicas (``dp_group``), as global ranks."""

    rank: int
    world: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    mp_group: tuple[int, ...]
    dp_group: tuple[int, ...]


def topology(rank: int, world: int, cfg: V1Config) -> Topology:
    """Place ``rank`` on the D x P grid of ``world`` ranks by ``cfg.placement_strategy`` (v1's rules), as smp's
    runtime lays replicas out (runtime.layout.ReplicaLayout, for ``cfg.placement``).

    A lone process (world 1) runs every partition itself. "cluster" puts each model replica
    on neighbouring ranks, [0, 1], [2, 3], ...; "spread" puts each partition's replicas on
    neighbouring ranks, so the replicas are [0, 4], [1, 5], ... for 8 ranks and 2 partitions.
    """
    p = cfg.partitions
    if world == 1:
        return Topology(rank, 1, 0, p, 0, 1, (0,), (0,))
    if world % p:
        raise V1Error(f"{world} ranks cannot hold {p} partitions: launch a multiple of {p} processes "
                      f"(torchrun --nproc_per_node {p}, or D x {p} for D data-parallel replicas with \"ddp\": true)")
    d = world // p

    def coords(r: int) -> tuple[int, int]:
        return (r % p, r // p) if cfg.placement == "cluster" else (r // d, r % d)

    pp, dp = coords(rank)
    everyone = range(world)
    mp_group = tuple(r for r in everyone if coords(r)[1] == dp)
    dp_group = tuple(r for r in everyone if coords(r)[0] == pp)
    return Topology(rank, world, pp, p, dp, d, mp_group, dp_group)
