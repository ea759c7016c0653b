"""SageMaker model parallel v1 scripts on smp: replace ``import smdistributed.modelparallel.torch as smp`` by
``import smp.v1 as smp`` (docs/smp-v1.md: what each v1 call does here, and what is refused and why)."""

from smp.deferred import delay_param_initialization
from smp.v1 import amp
from smp.v1.checkpoint import load, resume_from_checkpoint, save, save_checkpoint
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
    get_pp_process_group,
    get_rdp_process_group,
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
from smp.v1.model import DistributedModel, set_activation_checkpointing
from smp.v1.optimizer import DistributedOptimizer
from smp.v1.refused import (
    get_tp_process_group,
    model_creation,
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register_with_module,
)
from smp.v1.state import init, is_initialized
from smp.v1.step import StepOutput, step

__all__ = [
    "allgather", "amp", "barrier", "broadcast", "CommGroup", "delay_param_initialization", "DistributedModel",
    "DistributedOptimizer", "dp_barrier", "DP_GROUP", "dp_rank", "dp_size", "get_dp_group", "get_dp_process_group",
    "get_mp_group", "get_mp_process_group", "get_pp_process_group", "get_rdp_process_group", "get_tp_process_group",
    "get_world_process_group", "init", "is_initialized", "is_tracing", "load", "local_rank", "local_size",
    "model_creation", "mp_barrier", "MP_GROUP", "mp_rank", "mp_size", "partition", "PP_GROUP", "pp_rank", "pp_size",
    "rank", "RankType", "rdp_rank", "rdp_size", "recv_from", "resume_from_checkpoint", "save", "save_checkpoint",
    "send", "set_activation_checkpointing", "set_tensor_parallelism", "size", "step", "StepOutput",
    "tensor_parallelism", "tp_rank", "tp_register_with_module", "tp_size", "V1Error", "WORLD",
]


def is_tracing() -> bool:
    """v1 answered whether its tracing step was running; smp traces inside its planner, never in the script's
    code, so this is always False."""
    return False
