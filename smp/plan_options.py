"""Planning options given to ``smp.partition`` beside a made plan: which were given, and whether the plan agrees."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from partitioner.ir import ScheduleKind
from partitioner.plan import Plan
from partitioner.request import PlanRequest
from runtime.errors import RuntimeConfigError

__all__ = ["plan_facts", "given_options", "check_agrees", "check_precision"]


def plan_facts(plan: Plan) -> dict[str, Any]:
    """What a made plan fixes, by the planning option that would have chosen it."""
    return {"stages": plan.pipeline_ranks, "microbatches": plan.microbatches, "schedule": plan.schedule_name,
            "active_microbatches": plan.active_microbatches, "data_parallel": plan.data_parallel,
            "virtual_stages": plan.virtual_stages, "recompute": tuple(plan.recompute), "sharding": plan.sharding,
            "compile": plan.model.compiled, "tensor_parallel": plan.tensor_parallel,
            "sequence_parallel": plan.sequence_parallel}


def given_options(request: PlanRequest | None, planning: Mapping[str, Any]) -> dict[str, Any]:
    """The planning options the caller chose: the keywords, and the fields of ``request`` off their defaults."""
    chosen = {name: value for name, value in planning.items() if value is not None}  # None: left to the default
    if request is not None:
        default = PlanRequest()
        chosen.update({f.name: getattr(request, f.name) for f in dataclasses.fields(PlanRequest)
                       if f.name not in chosen and getattr(request, f.name) != getattr(default, f.name)})
    return chosen


def check_agrees(plan: Plan, request: PlanRequest, given: Mapping[str, Any]) -> None:
    """A plan is already made: every planning option given with it must say what the plan says."""
    facts = plan_facts(plan)
    moot = sorted(set(given) - set(facts) - {"placement"})  # the replicas' layout stays the runtime's choice
    if moot:
        raise RuntimeConfigError(f"{', '.join(moot)} only shape a new plan, and plan= is already made: drop "
                                 f"{'them' if len(moot) > 1 else 'it'}, or re-plan with smp.plan(..., "
                                 f"{moot[0]}=...)")
    for name in facts.keys() & given.keys():
        value, fixed = request.profiling.compile if name == "compile" else getattr(request, name), facts[name]
        if name == "recompute":
            agrees = value == "auto" or all(c == value for c in fixed)
        elif name in ("sharding", "sequence_parallel"):
            agrees = value in ("auto", fixed)
        elif name == "virtual_stages":
            agrees = not ScheduleKind.parse(plan.schedule_name).interleaved or value == fixed
        else:
            agrees = value == fixed
        if not agrees:
            raise RuntimeConfigError(f"{name}={given[name]!r} disagrees with the plan's {fixed!r}: a plan fixes "
                                     f"its {name}; re-plan with smp.plan(..., {name}=...)")


def check_precision(plan: Plan, precision: str) -> None:
    """A plan priced for a mixed-precision run counts half-width activations: running it in another precision would
    hold up to twice what it planned. (A plan priced in full precision runs in any: it counted more.)"""
    priced = plan.graph.meta.get("autocast")
    if priced is not None and priced != precision:
        raise RuntimeConfigError(
            f"this plan was priced for a {priced} mixed-precision run (its activations at {priced} width), but the "
            f"pipeline runs precision={precision!r}: pass precision={priced!r} to smp.partition, or make the plan for "
            f"this precision (dtype={precision!r}, --dtype {precision})")
