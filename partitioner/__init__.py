"""smp's compiler half: trace, profile, partition and schedule a model as a pipeline."""

from partitioner import synthetic
from partitioner.cluster import Cluster, Device, Link
from partitioner.cost import Partition, StageStats, Transfer, evaluate
from partitioner.devices import DeviceSpec, list_profiles, load_profile
from partitioner.errors import (
    ClusterError,
    ColocationError,
    InvalidAssignmentError,
    MemoryLimitError,
    PlanningError,
    ProfileError,
    StageCountError,
)
from partitioner.graph import OpGraph
from partitioner.microbatch import MicrobatchError, split_microbatches
from partitioner.problem import DEFAULT_STATE_FACTOR
from partitioner.profile import profile
from partitioner.profile_measured import time_whole_model
from partitioner.program import fingerprint, flatten_inputs, op_nodes
from partitioner.schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    Edge,
    Schedule,
    ScheduleError,
    ScheduleKind,
    StageGraph,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    peak_in_flight,
    stage_graph_from_transfers,
    zb_h1,
)
from partitioner.simulate import SimResult, StageCosts, comm_from_transfers, simulate, stage_costs_from
from partitioner.solve import METHODS, solve
from partitioner.timeline import Timeline, TimelineEvent, render_timeline
from partitioner.trace import TraceError, TraceInfo, trace
from partitioner.walk import Walk, format_program, format_table, validate, walk
from partitioner.plan import ModelInfo, Plan, PlanError  # noqa: E402 - after the pieces it is made of
from partitioner.compile import plan_from_graph  # noqa: E402

__all__ = [
    "Action", "ActionKind", "Cluster", "ClusterError", "ColocationError", "DEFAULT_STATE_FACTOR",
    "Device", "DeviceSpec", "Edge", "InvalidAssignmentError", "Link", "METHODS", "MemoryLimitError",
    "MicrobatchError", "ModelInfo", "OpGraph", "Partition", "Plan", "PlanError", "PlanningError", "ProfileError",
    "SCHEDULES", "Schedule", "ScheduleError", "ScheduleKind", "Walk", "SimResult", "StageCosts", "StageCountError", "StageGraph", "StageStats", "Timeline",
    "TimelineEvent", "TraceError", "TraceInfo", "Transfer", "comm_from_transfers", "evaluate",
    "fingerprint", "flatten_inputs", "format_program", "format_table", "gpipe", "interleaved_1f1b",
    "list_profiles", "load_profile", "make_schedule", "one_f_one_b", "op_nodes", "peak_in_flight",
    "plan_from_graph", "profile", "render_timeline", "walk",
    "simulate", "solve", "split_microbatches", "stage_costs_from", "stage_graph_from_transfers", "synthetic",
    "time_whole_model", "trace", "validate", "zb_h1",
]
