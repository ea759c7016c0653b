"""Planner benchmark: every method on synthetic suites and zoo models; prints a markdown table.

Run: ``.venv/bin/python benchmarks/planner.py [--quick] [--no-zoo] [--time-limit S]``.
Columns: bottleneck (ms per microbatch), its ratio to the proven lower bound (the best bound
any method proved for that row group, valid for plans within memory), its ratio to the best
plan that fits in memory, solve time, and whether optimality is proven ("over memory": a
baseline plan that exceeds device memory, shown for comparison only).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partitioner import synthetic  # noqa: E402
from partitioner.cluster import Cluster  # noqa: E402
from partitioner.errors import PlanningError  # noqa: E402
from partitioner.solve import solve  # noqa: E402
from partitioner.profile import profile  # noqa: E402
from smp.models import build  # noqa: E402

METHODS = ("uniform", "params", "blocks", "dp", "auto")
#: A DGX-H100-like fallback when profiles/h100-sxm.json is absent: 8 GPUs per node.
_H100 = {"kind": "smp.profile", "schema": 1, "name": "h100-sxm (built-in)",
         "device": {"name": "H100", "memory_bytes": 85899345920},
         "topology": {"nodes": 8, "devices_per_node": 8},
         "links": {"intra_node": {"name": "NVLink 4", "bandwidth": 4.5e11, "latency": 3e-6},
                   "inter_node": {"name": "IB NDR400", "bandwidth": 5.0e10, "latency": 5e-6}}}


def cluster_for(stages: int) -> Cluster:
    try:
        return Cluster.load("h100-sxm", devices=stages)
    except PlanningError:
        return Cluster.from_profile(_H100, devices=stages)


def run_group(label: str, graph, stages: int, time_limit: float, microbatches: int) -> list[str]:
    cluster = cluster_for(stages)
    results = {}
    for method in METHODS:
        t = time.perf_counter()
        try:
            part = solve(graph, stages, cluster=cluster, microbatches=microbatches, method=method,
                         time_limit=time_limit)
        except PlanningError as err:
            results[method] = (None, str(err).split(";")[0], time.perf_counter() - t)
            continue
        results[method] = (part, "", time.perf_counter() - t)
    # Baselines ignore memory: a plan over the limit is shown but never counts as the best.
    ok = [p for p, _, _ in results.values() if p is not None and p.memory_ok]
    best = min((p.bottleneck for p in ok), default=float("nan"))
    lb = max(p.lower_bound for p, _, _ in results.values() if p is not None)
    rows = []
    for method, (part, err, secs) in results.items():
        if part is None:
            rows.append(f"| {label} | {len(graph)} | {stages} | {method} | – | – | – | {secs:.2f} | {err} |")
            continue
        rows.append(f"| {label} | {len(graph)} | {stages} | {method} | {part.bottleneck * 1e3:.3f} | "
                    f"{part.bottleneck / lb:.3f} | {part.bottleneck / best:.3f} | {secs:.2f} | "
                    f"{'over memory' if not part.memory_ok else 'yes' if part.optimal else ''} |")
    return rows


def synthetic_rows(quick: bool, time_limit: float) -> list[str]:
    sizes = [(100, [2, 8]), (1000, [8, 64])] if quick else [(100, [2, 8]), (1000, [2, 8, 64]),
                                                           (10000, [8, 64])]
    rows = []
    for kind in synthetic.SUITES:
        for ops, stage_list in sizes:
            graph = synthetic.generate(kind, ops, seed=0)
            for stages in stage_list:
                rows += run_group(kind, graph, stages, time_limit, microbatches=4 * stages)
                print(rows[-1], file=sys.stderr, flush=True)
    return rows


#: Real sizes, built on the meta device and priced for H100 bf16: the tiny presets' ops take
#: microseconds, where link latency swamps every difference between methods.
ZOO = ("gpt:size=base", "bert:size=base", "t5:size=small", "unet:size=small", "resnet:size=base")


def zoo_rows(time_limit: float) -> list[str]:
    rows = []
    for spec in ZOO:
        bundle = build(spec, meta=True)
        graph = profile(bundle.model, bundle.example_args, bundle.example_kwargs,
                        timing="analytic", device_profile="h100-sxm", dtype="bf16")
        for stages in (4, 8):
            rows += run_group(spec, graph, stages, time_limit, microbatches=4 * stages)
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="sizes up to 1,000 ops only")
    ap.add_argument("--no-zoo", action="store_true", help="skip the zoo models")
    ap.add_argument("--zoo-only", action="store_true", help="only the zoo models")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per auto/cpsat solve")
    args = ap.parse_args()
    header = ["| graph | ops | stages | method | bottleneck ms | / lower bound | / best | solve s | optimal |",
              "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    rows = [] if args.zoo_only else synthetic_rows(args.quick, args.time_limit)
    if not args.no_zoo:
        rows += zoo_rows(args.time_limit)
    print("\n".join(header + rows))


if __name__ == "__main__":
    main()
