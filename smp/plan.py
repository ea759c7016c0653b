"""smp.plan and smp.Plan: the compiler's entry points, re-exported from the partitioner (which owns them)."""

from partitioner.compile import plan, plan_from_graph, plan_shapes
from partitioner.plan import PLAN_SCHEMA_VERSION, ModelInfo, Plan, PlanError
from partitioner.request import PlanRequest, Profiling, default_microbatches

__all__ = ["Plan", "PlanError", "PlanRequest", "Profiling", "default_microbatches", "ModelInfo", "plan", "plan_from_graph",
           "plan_shapes", "PLAN_SCHEMA_VERSION"]
