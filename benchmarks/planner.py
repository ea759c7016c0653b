"""Planner benchmark: every method on synthetic suites and zoo models; writes its table into docs/benchmarks.md.

Run: ``.venv/bin/python benchmarks/planner.py [--quick] [--no-zoo] [--zoo-only] [--time-limit S]``.
``--time-limit`` is each solve's ``time_limit`` in deterministic seconds (default 30: ``cpsat`` spends it,
``auto`` at most twice it over its CP-SAT searches). The raw figures go to
``benchmarks/results/planner.json`` and the markdown table, with what it shows computed from it, replaces
the block between the ``planner-table`` markers in docs/benchmarks.md (``--no-write`` prints it only;
``--from-results`` writes the block again from planner.json without solving).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partitioner import synthetic  # noqa: E402
from partitioner.cluster import Cluster  # noqa: E402
from partitioner.errors import PlanningError  # noqa: E402
from partitioner.graph import OpGraph  # noqa: E402
from partitioner.profile import profile  # noqa: E402
from partitioner.solve import solve  # noqa: E402
from smp.models import build  # noqa: E402

METHODS = ("uniform", "params", "blocks", "dp", "auto")
RESULTS = ROOT / "benchmarks" / "results" / "planner.json"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- planner-table:begin -->", "<!-- planner-table:end -->"
#: Real sizes, built on the meta device and priced for H100 bf16: the tiny presets' ops take
#: microseconds, where link latency swamps every difference between methods.
ZOO = ("gpt:size=base", "bert:size=base", "t5:size=small", "resnet:size=base", "unet:size=small")


def zoo_graph(spec: str) -> OpGraph:
    """A zoo model at its real size on the meta device, priced analytically for H100 bf16."""
    bundle = build(spec, meta=True)
    return profile(bundle.model, bundle.example_args, bundle.example_kwargs,
                   timing="analytic", device_profile="h100-sxm", dtype="bf16")


def run_group(label: str, graph, stages: int, time_limit: float) -> dict:
    """Every method on one graph and stage count: bottleneck, bound, proof, seconds."""
    cluster = Cluster.load("h100-sxm", devices=stages)
    rows = {}
    for method in METHODS:
        t = time.perf_counter()
        try:
            part = solve(graph, stages, cluster=cluster, microbatches=4 * stages, method=method,
                         time_limit=time_limit)
        except PlanningError as err:
            rows[method] = {"error": str(err).split(";")[0], "seconds": time.perf_counter() - t}
            continue
        rows[method] = {"bottleneck": part.bottleneck, "lower_bound": part.lower_bound, "bound_by": part.bound_by,
                        "optimal": part.optimal, "memory_ok": part.memory_ok, "solver": part.method,
                        "seconds": time.perf_counter() - t, "notes": part.notes}
    return {"graph": label, "ops": len(graph), "stages": stages, "methods": rows}


def best_fitting(res: dict) -> float:
    """The shortest bottleneck among the methods' plans that fit in memory: what ``/ best`` divides by."""
    return min((r["bottleneck"] for r in res.values() if "error" not in r and r["memory_ok"]), default=float("nan"))


def table(groups: list[dict]) -> list[str]:
    head = ["| graph | ops | stages | auto / bound | proven | bound by | auto s | dp s | dp / best | uniform / best "
            "| params / best | blocks / best |",
            "| --- | ---: | ---: | ---: | :---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows = []
    for grp in groups:
        res = grp["methods"]
        best = best_fitting(res)
        bound = max((r["lower_bound"] for r in res.values() if "error" not in r), default=0.0)

        def vs_best(method: str) -> str:
            r = res[method]
            if "error" in r:
                return "–"
            return f"{r['bottleneck'] / best:.3f}" + ("" if r["memory_ok"] else " (over mem)")

        auto = res["auto"]
        if "error" in auto:
            rows.append(f"| {grp['graph']} | {grp['ops']} | {grp['stages']} | {auto['error']} | | | "
                        f"{auto['seconds']:.2f} | | | | | |")
            continue
        rows.append(f"| {grp['graph']} | {grp['ops']} | {grp['stages']} | {auto['bottleneck'] / bound:.3f} | "
                    f"{'yes' if auto['optimal'] else ''} | {auto['bound_by']} | {auto['seconds']:.2f} | "
                    f"{res['dp'].get('seconds', float('nan')):.2f} | {vs_best('dp')} | {vs_best('uniform')} | "
                    f"{vs_best('params')} | {vs_best('blocks')} |")
    return head + rows


def synthetic_groups(quick: bool, time_limit: float) -> list[dict]:
    sizes = [(1000, [8, 64])] if quick else [(100, [8]), (1000, [8, 64]), (10000, [64])]
    out = []
    for kind in synthetic.SUITES:
        for ops, stage_list in sizes:
            graph = synthetic.generate(kind, ops, seed=0)
            for stages in stage_list:
                out.append(run_group(kind, graph, stages, time_limit))
                print(table([out[-1]])[-1], file=sys.stderr, flush=True)
    return out


def zoo_groups(time_limit: float) -> list[dict]:
    out = []
    for spec in ZOO:
        graph = zoo_graph(spec)
        for stages in (4, 8, 16):
            out.append(run_group(spec, graph, stages, time_limit))
            print(table([out[-1]])[-1], file=sys.stderr, flush=True)
    return out


def summary(groups: list[dict], seconds: float) -> list[str]:
    """What the table shows, computed from the same rows: proofs, gaps, the largest graphs' times, peers."""
    solved = [g for g in groups if "error" not in g["methods"]["auto"]]

    def gap(g: dict) -> float:
        res = g["methods"]
        return res["auto"]["bottleneck"] / max(r["lower_bound"] for r in res.values() if "error" not in r)

    def name(g: dict) -> str:
        return f"{g['graph']}, {g['ops']} ops, {g['stages']} stages"

    proven = [g for g in solved if g["methods"]["auto"]["optimal"]]
    loose = [g for g in solved if gap(g) > 1.01]
    largest = [g["methods"]["auto"]["seconds"] for g in solved if g["ops"] >= 9000]
    lines = [f"- **Proven optimal**: {len(proven)} of {len(groups)} rows; within 1% of the bound: "
             f"{len(solved) - len(loose)}."]
    if loose:
        lines.append("- **Not within 1%** (`auto / bound`): " + "; ".join(f"{name(g)} {gap(g):.3f}" for g in loose)
                     + ".")
    if largest:
        lines.append(f"- **{min(g['ops'] for g in solved if g['ops'] >= 9000):,}-{max(g['ops'] for g in solved):,} "
                     f"ops x 64 stages**: `auto` in {min(largest):.1f}-{max(largest):.1f} s.")
    zoo = [g for g in solved if g["graph"] in ZOO]
    wins = []
    for method, who in (("uniform", ""), ("params", ", DeepSpeed's default"), ("blocks", ", torchgpipe")):
        ratios = [(g["methods"][method]["bottleneck"] / best_fitting(g["methods"]), g) for g in zoo
                  if "error" not in g["methods"][method] and g["methods"][method]["memory_ok"]]
        if ratios:
            ratio, g = max(ratios, key=lambda rg: rg[0])
            wins.append(f"{ratio:.2f}x over `{method}`{who} ({name(g)})")
    if wins:
        lines.append("- **Wins over peers** on the zoo models at real sizes (`/ best` above, the baseline's plan "
                     "that fits against the best): up to " + "; ".join(wins) + ".")
    over = [f"`{m}` on {name(g)}" for g in solved for m, r in g["methods"].items()
            if m != "auto" and "error" not in r and not r["memory_ok"]]
    if over:
        lines.append("- **Baseline plans over device memory** (never counted as best; `auto`'s fits): "
                     + "; ".join(over) + ".")
    lines.append(f"- The whole run: {seconds:.0f} s (raw figures, every solver's notes: "
                 f"`benchmarks/results/planner.json`).")
    return lines


def write_doc(lines: list[str], command: str) -> None:
    """Replace the block between the planner-table markers of docs/benchmarks.md with the table and summary."""
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(head + "\n".join([BEGIN, f"Generated by `{command}`:", "", *lines, END]) + tail)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1,000-op synthetic graphs only")
    ap.add_argument("--no-zoo", action="store_true", help="skip the zoo models")
    ap.add_argument("--zoo-only", action="store_true", help="only the zoo models")
    ap.add_argument("--time-limit", type=float, default=30.0, help="each solve's time_limit, deterministic seconds")
    ap.add_argument("--no-write", action="store_true", help="print the table; leave docs/ and results/ alone")
    ap.add_argument("--from-results", action="store_true",
                    help="solve nothing: write the docs block again from benchmarks/results/planner.json")
    args = ap.parse_args()
    if args.from_results:
        saved = json.loads(RESULTS.read_text())
        write_doc([*table(saved["groups"]), "", *summary(saved["groups"], saved["seconds"])], saved["command"])
        return
    t0 = time.perf_counter()
    groups = [] if args.zoo_only else synthetic_groups(args.quick, args.time_limit)
    if not args.no_zoo:
        groups += zoo_groups(args.time_limit)
    seconds = time.perf_counter() - t0
    lines = [*table(groups), "", *summary(groups, seconds)]
    print("\n".join(lines))
    if args.no_write:
        return
    command = ("python benchmarks/planner.py " + " ".join(sys.argv[1:])).strip()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"command": command, "machine": platform.platform(),
                                   "cpus": os.cpu_count(), "seconds": seconds, "groups": groups}, indent=1) + "\n")
    write_doc(lines, command)


if __name__ == "__main__":
    main()
