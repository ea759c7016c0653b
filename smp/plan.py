"""smp.plan and smp.Plan: the compiler's entry points, re-exported from the partitioner (which owns them)."""

from partitioner.compile import Candidate, MicrobatchSearch, plan, plan_from_graph, plan_microbatches
from partitioner.plan import PLAN_SCHEMA_VERSION, ModelInfo, Plan, PlanError

__all__ = ["Plan", "PlanError", "ModelInfo", "plan", "plan_from_graph", "plan_microbatches", "Candidate",
           "MicrobatchSearch", "PLAN_SCHEMA_VERSION"]
