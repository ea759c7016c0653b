"""v1's communication helpers (barrier, broadcast / recv_from, send, allgather) and bounded collectives.

Every collective here first meets its peers at a rendezvous on the store, bounded by the
configured ``timeout``: a rank that never comes is named (v1 hung instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from runtime.faults import NotArrived
from smp.v1.errors import V1Error
from smp.v1.state import State, current

__all__ = ["CommGroup", "RankType", "WORLD", "MP_GROUP", "PP_GROUP", "DP_GROUP", "rendezvous", "gather_objects",
           "barrier", "mp_barrier", "dp_barrier", "broadcast", "recv_from", "send", "allgather", "group_ranks",
           "share_from_holder", "cpu_copy"]


class CommGroup(Enum):
    """v1's groups: every rank; the ranks of this model replica (its pipeline); the replicas of this partition."""

    WORLD = "world"
    MP_GROUP = "mp_group"
    PP_GROUP = "mp_group"  # v1's later name of the same group (an alias)
    DP_GROUP = "dp_group"


class RankType(Enum):
    """How a rank number is read: global, within the model replica, or within the partition's replicas."""

    WORLD_RANK = "world"
    MP_RANK = "mp"
    DP_RANK = "dp"


WORLD, MP_GROUP, PP_GROUP, DP_GROUP = CommGroup.WORLD, CommGroup.MP_GROUP, CommGroup.PP_GROUP, CommGroup.DP_GROUP


def group_ranks(group: CommGroup, state: State | None = None) -> tuple[int, ...]:
    """The global ranks of ``group`` that contain this rank."""
    st = state or current()
    topo = st.topology
    if group is CommGroup.WORLD:
        return tuple(range(topo.world))
    return topo.mp_group if group is CommGroup.MP_GROUP else topo.dp_group


def _torch_group(state: State, ranks: Sequence[int]) -> Any:
    """The gloo group ``smp.init`` made for exactly ``ranks`` (the world, a model replica or a dp group)."""
    if len(ranks) == state.topology.world:
        return state.group
    return state.gloo_groups[tuple(ranks)]


def cpu_copy(obj: Any) -> Any:
    """``obj`` with every tensor detached and on the CPU: what object collectives send (a CUDA tensor would be
    unpickled on the sender's device index)."""
    return pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, obj)


def rendezvous(what: str, ranks: Sequence[int], state: State | None = None) -> None:
    """Wait until every rank of ``ranks`` reaches the collective ``what``, at most ``timeout`` seconds.

    Raises :class:`V1Error` naming the ranks that did not come: the collective is then
    never entered, so a call made on only some ranks is an error, not a hang.
    """
    st = state or current()
    if len(ranks) <= 1:
        return
    assert st.arrivals is not None  # made by smp.init with the process group
    try:
        st.arrivals.meet(what, ranks, st.config.timeout)
    except NotArrived as err:
        tail = ". Call it on every one of those ranks (v1 hung here instead)" if err.absent else ""
        raise V1Error(f"{what} is a collective over ranks {list(ranks)}: {err}{tail}") from None


def gather_objects(what: str, obj: Any, ranks: Sequence[int], state: State | None = None) -> list[Any]:
    """Every rank's ``obj`` (in rank order) on every rank of ``ranks``, after a bounded rendezvous."""
    st = state or current()
    if len(ranks) <= 1:
        return [obj]
    rendezvous(what, ranks, st)
    out: list[Any] = [None] * len(ranks)
    dist.all_gather_object(out, obj, group=_torch_group(st, ranks))
    return out


def share_from_holder(what: str, obj: Any, holds: bool, state: State | None = None) -> Any:
    """``obj`` of the one rank of this model replica that ``holds`` it, on every rank of the replica."""
    st = state or current()
    ranks = group_ranks(CommGroup.MP_GROUP, st)
    if len(ranks) <= 1:
        return obj
    group = _torch_group(st, ranks)
    src = torch.tensor([st.topology.rank if holds else -1])
    dist.all_reduce(src, op=dist.ReduceOp.MAX, group=group)
    if int(src) < 0:
        raise V1Error(f"{what}: no rank holds the value to share; this is a bug in smp.v1, please report it")
    box = [obj if holds else None]
    dist.broadcast_object_list(box, src=int(src), group=group)
    return box[0]


# ---------------------------------------------------------------------- v1's API


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Wait until every rank of ``group`` arrives (bounded: an absent rank is named)."""
    rendezvous(f"barrier({group.name})", group_ranks(group))


def mp_barrier() -> None:
    """``barrier(MP_GROUP)``."""
    barrier(CommGroup.MP_GROUP)


def dp_barrier() -> None:
    """``barrier(DP_GROUP)``."""
    barrier(CommGroup.DP_GROUP)


def allgather(obj: Any, group: CommGroup = CommGroup.WORLD) -> list[Any]:
    """Every rank's ``obj`` of ``group``, in rank order, on every rank of it."""
    return gather_objects(f"allgather({group.name})", obj, group_ranks(group))


def _global_rank(rank: int, rank_type: RankType) -> int:
    if rank_type is RankType.WORLD_RANK:
        return rank
    ranks = group_ranks(CommGroup.MP_GROUP if rank_type is RankType.MP_RANK else CommGroup.DP_GROUP)
    if not 0 <= rank < len(ranks):
        raise V1Error(f"there is no {rank_type.name} {rank}: the group has ranks 0..{len(ranks) - 1}")
    return ranks[rank]


def send(obj: Any, dest_rank: int, rank_type: RankType = RankType.WORLD_RANK) -> None:
    """Send a picklable object to one rank, which receives it with ``recv_from``."""
    st = current()
    dst = _global_rank(dest_rank, rank_type)
    if dst == st.topology.rank:
        raise V1Error(f"send(): rank {dst} is this rank")
    dist.send_object_list([obj], dst=dst, group=_torch_group(st, group_ranks(CommGroup.WORLD, st)))


def broadcast(obj: Any, group: CommGroup = CommGroup.WORLD) -> None:
    """Send ``obj`` to every other rank of ``group``; each receives it with ``recv_from`` (v1's pairing)."""
    me = current().topology.rank
    for r in group_ranks(group):
        if r != me:
            send(obj, r)


def recv_from(src_rank: int, rank_type: RankType = RankType.WORLD_RANK) -> Any:
    """Receive what rank ``src_rank`` sent with ``send`` or ``broadcast``."""
    st = current()
    src = _global_rank(src_rank, rank_type)
    if src == st.topology.rank:
        raise V1Error(f"recv_from(): rank {src} is this rank")
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=_torch_group(st, group_ranks(CommGroup.WORLD, st)))
    return box[0]
