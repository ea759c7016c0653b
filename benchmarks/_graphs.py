"""The graphs the planner benchmarks plan: synthetic suites, and zoo models profiled as planner.py does."""

from __future__ import annotations

from partitioner import synthetic
from partitioner.graph import OpGraph
from partitioner.profile import profile
from smp.models import build


def zoo_graph(spec: str) -> OpGraph:
    """A zoo model at its real size on the meta device, priced analytically for H100 bf16."""
    bundle = build(spec, meta=True)
    return profile(bundle.model, bundle.example_args, bundle.example_kwargs,
                   timing="analytic", device_profile="h100-sxm", dtype="bf16")


def graph_for(spec: str) -> OpGraph:
    """``kind:ops`` a synthetic suite's graph (seed 0), anything else a zoo spec (:func:`zoo_graph`)."""
    kind, _, ops = spec.partition(":")
    if kind in synthetic.SUITES and ops.isdigit():
        return synthetic.generate(kind, int(ops), seed=0)
    return zoo_graph(spec)
