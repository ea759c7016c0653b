"""SageMaker model parallel v1 scripts on smp: replace ``import smdistributed.modelparallel.torch as smp`` by
``import smp.v1 as smp`` (docs/smp-v1.md: what each v1 call does here, and what is refused and why)."""

from smp.deferred import delay_param_initialization
from smp.v1 import amp
from smp.v1.checkpoint import load, save
from smp.v1.comm import (
    DP_GROUP,
    MP_GROUP,
    PP_GROUP,
    WORLD,
    CommGroup,
    RankType,
    allgather,
    barrier,
    broadcast,
    dp_barrier,
    mp_barrier,
    recv_from,
    send,
)
from smp.v1.errors import V1Error
from smp.v1.info import (
    dp_rank,
    dp_size,
    get_dp_group,
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_world_process_group,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    size,
    tp_rank,
    tp_size,
)
from smp.v1.manual import partition
from smp.v1.model import DistributedModel
from smp.v1.optimizer import DistributedOptimizer
from smp.v1.state import init, is_initialized
from smp.v1.step import StepOutput, step

__all__ = [
    "CommGroup", "DP_GROUP", "DistributedModel", "DistributedOptimizer", "MP_GROUP", "PP_GROUP", "RankType",
    "StepOutput", "V1Error", "WORLD", "allgather", "amp", "barrier", "broadcast", "delay_param_initialization",
    "dp_barrier", "dp_rank", "dp_size", "get_dp_group", "get_dp_process_group", "get_mp_group",
    "get_mp_process_group", "get_world_process_group", "init", "is_initialized", "is_tracing", "load", "local_rank",
    "local_size", "mp_barrier", "mp_rank", "mp_size", "partition", "pp_rank", "pp_size", "rank", "rdp_rank",
    "rdp_size", "recv_from", "save", "send", "size", "step", "tp_rank", "tp_size",
]


def is_tracing() -> bool:
    """v1 answered whether its tracing step was running; smp traces inside its planner, never in the script's
    code, so this is always False."""
    return False
