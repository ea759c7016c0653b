"""smp.init(): the process-wide state of a v1 script (configuration, ranks, process groups, its DistributedModel)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.faults import Arrivals
from runtime.teardown import destroy_groups_at_exit, release_at_exit
from smp.launch import init_distributed
from smp.v1.config import V1Config, load_config
from smp.v1.errors import V1Error
from smp.v1.ranks import Launch, Topology, export_for_torch, from_environment, topology

__all__ = ["State", "init", "is_initialized", "current"]


@dataclass
class State:
    """What ``smp.init`` set up: ``group`` is a gloo group over every rank for object collectives (None alone);
    ``store`` is the rendezvous store, ``arrivals`` the checks on it that every rank entered a collective (bounded
    waits that name an absent rank); ``gloo_groups`` and
    ``process_groups`` hold, for the ranks of every model replica (mp group) and of every partition's
    replicas (dp group), a gloo group (object collectives) and a group of the default backend (the script's).
    ``model`` and ``optimizer`` are the script's DistributedModel and DistributedOptimizer (typed by their base
    classes: those modules build on this one). ``checkpointed``: the modules ``smp.set_activation_checkpointing`` asked to recompute.
    """

    config: V1Config
    launch: Launch
    topology: Topology
    group: Any = None
    store: Any = None
    arrivals: Arrivals | None = None
    gloo_groups: dict[tuple[int, ...], Any] = field(default_factory=dict)
    process_groups: dict[tuple[int, ...], Any] = field(default_factory=dict)
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    checkpointed: list[nn.Module] = field(default_factory=list)
    generation: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        return self.topology.world > 1

    def release_groups(self) -> None:
        """Let go of the groups at exit, after smp destroyed them (runtime/teardown.py): their threads stop then."""
        self.group = None
        self.gloo_groups = {}
        self.process_groups = {}

    def next_key(self, what: str) -> str:
        """A store key for the next collective named ``what``: every rank calls them in the same order, and
        ``generation`` (the how-many-th ``smp.init``) keeps a new start from meeting an old one's keys."""
        self.counters[what] = self.counters.get(what, 0) + 1
        return f"smp.v1/{self.generation}/{what}/{self.counters[what]}"


_state: State | None = None
_generation = 0


def init(config: dict[str, Any] | None = None) -> None:
    """Read the v1 configuration and join the ranks the launcher started (torchrun or mpirun), as v1's ``smp.init``.

    Without a launcher every partition runs in this one process. Calling it again reads
    the configuration again and forgets the DistributedModel and DistributedOptimizer (the
    process group stays).
    """
    global _state, _generation
    cfg = load_config(config)
    launch = from_environment(os.environ)
    topo = topology(launch.rank, launch.world, cfg)
    if topo.dp_size > 1 and not cfg.ddp:
        raise V1Error(f"{launch.world} ranks hold {topo.dp_size} copies of the {cfg.partitions} partitions, but "
                      "ddp is false: set \"ddp\": true for data parallelism (each replica trains on its share of "
                      f"the data), or launch {cfg.partitions} processes")
    _generation += 1
    state = State(cfg, launch, topo, generation=_generation)
    if launch.world > 1:
        state.group, state.store = _join(launch, cfg.timeout)
        state.arrivals = Arrivals(state.store, f"smp.v1/{_generation}", launch.rank)
        state.gloo_groups, state.process_groups = _subgroups(cfg, launch.world, state.group, cfg.timeout)
        destroy_groups_at_exit()  # v1 scripts never destroy them; exiting with them alive can abort
        release_at_exit(state.release_groups)
    _state = state


def _join(launch: Launch, timeout: float) -> tuple[Any, Any]:
    """The default process group (made here unless the script made one), a gloo group, and the store."""
    export_for_torch(launch, os.environ)
    limit = datetime.timedelta(seconds=timeout)
    init_distributed(timeout=timeout)  # unless the script joined: NCCL on cuda:LOCAL_RANK where there is a GPU
    if dist.get_world_size() != launch.world or dist.get_rank() != launch.rank:
        raise V1Error(f"the process group (rank {dist.get_rank()} of {dist.get_world_size()}) is not the launch's "
                      f"(rank {launch.rank} of {launch.world})")
    group = dist.new_group(backend="gloo", timeout=limit)
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as err:  # noqa: BLE001 - a process group made without a store
        raise V1Error(f"the default process group has no rendezvous store ({err}); initialise it with "
                      "init_method env://, tcp:// or file://") from None
    return group, store


def _subgroups(cfg: V1Config, world: int, gloo_world: Any, timeout: float
               ) -> tuple[dict[tuple[int, ...], Any], dict[tuple[int, ...], Any]]:
    """A gloo group and a default-backend group for every mp group and dp group (every rank makes every group,
    in the same order, as torch.distributed requires); the whole world's are the existing ones."""
    places = [topology(r, world, cfg) for r in range(world)]
    every = sorted({t.mp_group for t in places} | {t.dp_group for t in places})
    limit = datetime.timedelta(seconds=timeout)
    gloo: dict[tuple[int, ...], Any] = {}
    default: dict[tuple[int, ...], Any] = {}
    for ranks in every:
        if len(ranks) == world:
            gloo[ranks], default[ranks] = gloo_world, dist.group.WORLD
        else:
            gloo[ranks] = dist.new_group(list(ranks), backend="gloo", timeout=limit)
            default[ranks] = dist.new_group(list(ranks), timeout=limit)
    return gloo, default


def is_initialized() -> bool:
    """Whether ``smp.init`` has run in this process."""
    return _state is not None


def current() -> State:
    """The state ``smp.init`` made; a clear error when it has not run."""
    if _state is None:
        raise V1Error("call smp.init() first (at the top of the training script, as with SageMaker's library)")
    return _state
