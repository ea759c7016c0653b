"""The files the commands read: op graphs from ``smp profile`` and plans from ``smp plan``."""

from __future__ import annotations

import json
from pathlib import Path

from smp.cli.errors import CLIUsageError

__all__ = ["is_graph_file", "load_graph", "load_plan"]


def is_graph_file(model: str) -> bool:
    return model.endswith(".json")


def load_graph(path: str):
    from partitioner.graph import OpGraph

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no op graph file at {p}; write one with `smp profile MODEL -o {p}`")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{p} is not a valid op graph file (bad JSON: {err}); re-create it with "
                         "`smp profile MODEL -o graph.json`") from None
    if isinstance(data, dict) and data.get("kind") == "smp.Plan":
        raise CLIUsageError(f"{p} is a plan, not an op graph: use `smp inspect {p}` or `smp simulate {p}`")
    try:
        return OpGraph.from_dict(data)
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{p} is a damaged op graph file ({type(err).__name__}: {err}); re-create it with "
                         "`smp profile`") from None


def load_plan(path: Path):
    from smp.plan import Plan, PlanError

    if path.is_dir():
        raise PlanError(f"{path} is a directory, not a plan file")
    return Plan.load(path)
