"""The shape the planner picks (replicas x stages x microbatches) against the usual rules, on H100 clusters.

Run:  .venv/bin/python benchmarks/shapes.py [--write docs/benchmarks.md]
      .venv/bin/python benchmarks/shapes.py --sharding [--from-results] [--write docs/benchmarks.md]
      .venv/bin/python benchmarks/shapes.py --tensor-parallel [--models "GPT 13B"] [--devices 64] [--write ...]

Each model is a zoo GPT at real size built on the meta device and profiled analytically
on the ``h100-sxm`` profile in bf16 (8 GPUs per node on NVLink, nodes on InfiniBand; fp32
master weights and Adam state counted by the plan's state factor), once, at one sequence
per sample; every search scales that graph. For N = 8, 16 and 64 GPUs and a global batch of
256 sequences of 2048 tokens, ``smp.plan_shapes`` weighs every D x P = N and microbatch
count and keeps the fastest simulated step that fits in 80 GB. It is set against the best
plan (over the same microbatch counts) of three rules people use: pure data parallelism
(P = 1; often it does not fit), pure pipeline (P = N) and "pipeline within a node"
(P = 8, D = N / 8). Ratios are predicted samples per second, chosen over the rule (above 1:
the planner's shape is faster). A rule's best is read from the shapes the search weighed:
where the search pruned some of the rule's shapes that might beat the rule's best it found
(a lower bound below that step, or pruned by its screened partition's critical path, which
bounds that partition, not the shape), the rule is searched on its own (``stages=P``, as a
user fixing P would) and its best plan is the rule's. The planning time is the profile plus
the search for N (not the rules' own searches).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._markdown import write_section  # noqa: E402

MODELS = {
    "GPT 1.3B": "gpt:layers=24,d_model=2048,heads=16,vocab=50304,seq_len=2048",
    "GPT 6.7B": "gpt:layers=32,d_model=4096,heads=32,vocab=50304,seq_len=2048",
    "GPT 13B": "gpt:layers=40,d_model=5120,heads=40,vocab=50304,seq_len=2048",
}
DEVICES = (8, 16, 64)
GLOBAL_BATCH = 256
NODE = 8  # GPUs per node in the h100-sxm profile
SECTION = "## Choosing replicas x stages x microbatches on H100 clusters"


def run(name: str, spec: str, done: dict[tuple[str, int], dict[str, Any]],
        devices: tuple[int, ...] = DEVICES) -> list[dict[str, Any]]:
    from partitioner.cluster import Cluster
    from partitioner.compile import plan_from_graph, profile_model
    from partitioner.request import PlanRequest
    from partitioner.shapes import search_shapes
    from smp.models import build

    if all((name, n) in done for n in devices):
        return [done[name, n] for n in devices]
    built = build(spec + ",batch=1", seed=0, meta=True)
    t0 = time.perf_counter()
    graph, info = profile_model(built.model, built.example_args, None,
                                PlanRequest.build(device_profile="h100-sxm", dtype="bf16"), microbatches=1)
    profile_s = time.perf_counter() - t0
    rows = []
    for n in devices:
        if (name, n) in done:
            rows.append(done[name, n])
            continue
        cluster = Cluster.load("h100-sxm", devices=n)

        t0 = time.perf_counter()
        chosen = search_shapes(graph, PlanRequest(devices=n, global_batch=GLOBAL_BATCH, cluster=cluster),
                               profiled_batch=1, solve_plan=plan_from_graph, model_info=info)
        search_s = time.perf_counter() - t0

        def rule_search(stages: int) -> Any:
            return search_shapes(graph, PlanRequest(devices=n, global_batch=GLOBAL_BATCH, cluster=cluster,
                                                    stages=stages),
                                 profiled_batch=1, solve_plan=plan_from_graph, model_info=info)

        weighed = {rule: _rule_best(chosen, stages, rule_search)
                   for rule, stages in (("data parallel", 1), ("pipeline", n), ("pipeline in a node", min(NODE, n)))}
        best = chosen.candidates[0]
        row: dict[str, Any] = {
            "model": name, "spec": spec, "params": info.num_params, "devices": n,
            "chosen": {"data_parallel": best.shape.data_parallel, "stages": best.shape.stages,
                       "microbatches": best.shape.microbatches, "placement": best.plan.placement,
                       "samples_per_second": best.samples_per_second, "memory_bytes": best.memory,
                       "recompute": sorted(set(best.recompute))},
            "planning_s": profile_s + search_s, "profile_s": profile_s, "search_s": search_s,
            "weighed": len(chosen.candidates), "pruned": sum(c.pruned for c in chosen.candidates),
        }
        for rule, top in weighed.items():
            row[rule] = top
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _rule_best(chosen: Any, stages: int, rule_search: Callable[[int], Any]) -> dict[str, Any] | None:
    """The rule's fastest shape (``stages`` per pipeline), or None when none fits (``not_weighed`` with the reason
    when the search weighed none of them: more stages than a folded graph's blocks).

    Read from the shapes the search weighed, unless it pruned some of the rule's shapes that might beat the rule's
    best it found (a compute bound below that step, or pruned by a screened partition's critical path, which
    bounds that partition, not the shape): then the rule is searched on its own (``rule_search(stages)``, every
    shape of ``stages`` pipeline ranks, as a user fixing P would), and its best plan is the rule's."""
    mine = [c for c in chosen.candidates if c.shape.stages == stages]
    fitting = [c for c in mine if c.plan is not None]
    top = min(fitting, key=lambda c: c.step_time) if fitting else None
    open_ = [c for c in mine if c.pruned and (top is None or c.lower_bound < top.step_time)]
    if open_:
        own = [c for c in rule_search(stages).candidates if c.plan is not None]
        top = min(own, key=lambda c: c.step_time) if own else None
    if top is None:
        if mine and all(c.reason.startswith("not weighed") for c in mine):  # finer than a folded graph's blocks
            return {"not_weighed": mine[0].reason}
        return None
    return {"shape": f"{top.shape.data_parallel}x{top.shape.stages} m={top.shape.microbatches}",
            "samples_per_second": chosen.global_batch / top.step_time, "searched_alone": bool(open_)}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | GPUs | chosen D x P, m (placement) | samples/s | vs data parallel | vs pipeline (P = N) | "
            "vs pipeline in a node (P = 8) | planning time (profile + search) |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["chosen"]

        def vs(rule: str) -> str:
            if rule not in r:
                return "not run"
            other = r[rule]
            if other is None:
                return "does not fit"
            if "not_weighed" in other:
                return f"not weighed ({other['not_weighed'].split(': ', 1)[-1].split(' (')[0]})"
            return f"{c['samples_per_second'] / other['samples_per_second']:.2f}x ({other['shape']})"

        lines.append(f"| {r['model']} | {r['devices']} | {c['data_parallel']} x {c['stages']}, m={c['microbatches']} "
                     f"({c['placement']}) | {c['samples_per_second']:.1f} | {vs('data parallel')} | {vs('pipeline')} | "
                     f"{vs('pipeline in a node')} | {r['planning_s']:.0f} s ({r['profile_s']:.0f} + "
                     f"{r['search_s']:.0f}) |")
    return "\n".join(lines)


SHARDING_MODELS = {
    "GPT 13B": MODELS["GPT 13B"],
    # Llama-3-70B's width, depth, heads and vocabulary as a zoo GPT (4d MLP and full attention where Llama has a
    # 3.5d SwiGLU and 8 KV heads): 66.6B parameters against Llama's 70.6B.
    "Llama-3-70B-shaped": "gpt:layers=80,d_model=8192,heads=64,vocab=128256,seq_len=2048",
}
SHARDING_DEVICES = 64
SHARDING_BATCH = 512
SHARDING_SECTION = "## Sharded data parallelism inside the pipeline on 64 H100s"
SHARDING_DOC = f"""Each model is built on the meta device and profiled analytically on ``h100-sxm`` in bf16, as above;
``smp.plan_shapes`` weighs every D x P = {SHARDING_DEVICES} and microbatch count for a global batch of
{SHARDING_BATCH} sequences of 2048 tokens twice: with ``sharding="none"`` (every replica holds its stage's
whole state) and with ``sharding="auto"`` (each shape weighs none, shard_grad_op and full_shard,
docs/sharding.md). Predicted samples per second of each search's fastest plan that fits in 80 GB,
its shape, how many of its stages recompute activations, and the sharding chosen; the search's wall seconds
(on the 2-core development machine, shared with other jobs during the recorded run)."""


def run_sharding(name: str, spec: str) -> dict[str, Any]:
    """The fastest plan with sharding weighed and the fastest without, for ``spec`` on 64 H100s."""
    from partitioner.cluster import Cluster
    from partitioner.compile import plan_from_graph, profile_model
    from partitioner.request import PlanRequest
    from partitioner.shapes import search_shapes
    from smp.models import build

    built = build(spec + ",batch=1", seed=0, meta=True)
    graph, info = profile_model(built.model, built.example_args, None,
                                PlanRequest.build(device_profile="h100-sxm", dtype="bf16"), microbatches=1)
    cluster = Cluster.load("h100-sxm", devices=SHARDING_DEVICES)
    row: dict[str, Any] = {"model": name, "spec": spec, "params": info.num_params, "devices": SHARDING_DEVICES,
                           "global_batch": SHARDING_BATCH}
    for sharding in ("none", "auto"):
        t0 = time.perf_counter()
        search = search_shapes(graph, PlanRequest(devices=SHARDING_DEVICES, global_batch=SHARDING_BATCH,
                                                  cluster=cluster, sharding=sharding),
                               profiled_batch=1, solve_plan=plan_from_graph, model_info=info)
        best = search.candidates[0]
        plan = best.plan
        row[sharding] = None if plan is None else {
            "data_parallel": best.shape.data_parallel, "stages": best.shape.stages,
            "microbatches": best.shape.microbatches, "schedule": best.shape.schedule, "sharding": plan.sharding,
            "samples_per_second": best.samples_per_second, "memory_bytes": best.memory,
            "recomputing_stages": sum(r != "none" for r in plan.recompute), "search_s": time.perf_counter() - t0}
    print(json.dumps(row), flush=True)
    return row


def sharding_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | without sharding: D x P, m (recomputing stages) | samples/s | with sharding weighed: "
             "D x P, m, mode (recomputing stages) | samples/s | ratio | search s (without / with) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        off, on = r["none"], r["auto"]

        def shape(c: dict[str, Any], mode: bool) -> str:
            return (f"{c['data_parallel']} x {c['stages']}, m={c['microbatches']}"
                    + (f", {c['sharding']}" if mode else "") + f" ({c['recomputing_stages']} of {c['stages']})")

        lines.append(f"| {r['model']} | {shape(off, False) if off else 'does not fit'} | "
                     f"{off['samples_per_second']:.1f} | " if off else f"| {r['model']} | does not fit | - | ")
        lines[-1] += (f"{shape(on, True)} | {on['samples_per_second']:.1f} | "
                      + (f"{on['samples_per_second'] / off['samples_per_second']:.2f}x |" if off else "- |")
                      if on else "does not fit | - | - |")
        lines[-1] += " " + " / ".join("-" if c is None else f"{c['search_s']:.0f}" for c in (off, on)) + " |"
    return "\n".join(lines)


TP_DEVICES = 64
TP_SECTION = "## Tensor parallelism inside the pipeline on H100 clusters"
TP_DOC = f"""Each model is built on the meta device and profiled analytically on ``h100-sxm`` in bf16, as above, once;
``smp.plan_shapes`` then weighs every shape of N GPUs for a global batch of {GLOBAL_BATCH} sequences of 2048 tokens
twice: with ``tensor_parallel=1`` (D x P = N, today's search) and with ``tensor_parallel="auto"`` (D x P x T = N,
T in 1, 2, 4, 8 within a node, priced as in docs/cost-model.md#tensor-parallelism). Predicted samples per second of
each search's fastest plan that fits in 80 GB, its shape, and the search's time."""


def run_tensor_parallel(name: str, spec: str, devices: int) -> dict[str, Any]:
    """The fastest plan with tensor parallelism weighed and the fastest without, for ``spec`` on ``devices`` H100s."""
    from partitioner.compile import plan_shapes, profile_model
    from partitioner.request import PlanRequest
    from smp.models import build

    built = build(spec + ",batch=1", seed=0, meta=True)
    request = PlanRequest.build(device_profile="h100-sxm", dtype="bf16", cluster="h100-sxm", devices=devices,
                                global_batch=GLOBAL_BATCH)
    t0 = time.perf_counter()
    graph, info = profile_model(built.model, built.example_args, None, request, microbatches=1)
    row: dict[str, Any] = {"model": name, "spec": spec, "params": info.num_params, "devices": devices,
                           "global_batch": GLOBAL_BATCH, "profile_s": time.perf_counter() - t0}
    for label, tp in (("without", 1), ("with", "auto")):
        t0 = time.perf_counter()
        search = plan_shapes(built.model, built.example_args, request=request.with_(tensor_parallel=tp), graph=graph)
        best = search.candidates[0]
        row[label] = None if best.plan is None else {
            "data_parallel": best.shape.data_parallel, "stages": best.shape.stages,
            "tensor_parallel": best.shape.tensor_parallel, "microbatches": best.shape.microbatches,
            "schedule": best.shape.schedule, "samples_per_second": best.samples_per_second,
            "memory_bytes": best.memory, "skipped": {str(t): why for t, why in search.skipped.items()},
            "search_s": time.perf_counter() - t0}
    print(json.dumps(row), flush=True)
    return row


def tensor_parallel_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | GPUs | without T: D x P, m | samples/s | search | with T weighed: D x P x T, m | samples/s | "
             "search | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        off, on = r["without"], r["with"]

        def cells(c: dict[str, Any] | None, tp: bool) -> str:
            if c is None:
                return "does not fit | - | -"
            shape = f"{c['data_parallel']} x {c['stages']}" + (f" x {c['tensor_parallel']}" if tp else "")
            return f"{shape}, m={c['microbatches']} | {c['samples_per_second']:.1f} | {c['search_s']:.0f} s"

        ratio = f"{on['samples_per_second'] / off['samples_per_second']:.2f}x" if on and off else "-"
        lines.append(f"| {r['model']} | {r['devices']} | {cells(off, False)} | {cells(on, True)} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/shapes.py", description=__doc__)
    ap.add_argument("--models", nargs="*", choices=list(MODELS),
                    help="default: every model (--tensor-parallel: GPT 13B)")
    ap.add_argument("--devices", nargs="*", type=int,
                    help=f"cluster sizes (GPUs); default: {', '.join(map(str, DEVICES))} (--tensor-parallel: "
                         f"{TP_DEVICES})")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/shapes.json")
    ap.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    ap.add_argument("--resume", type=Path, help="the output of an interrupted run: its rows (the JSON lines this "
                                                "script prints) are kept, the others computed")
    ap.add_argument("--from-results", action="store_true", help="with --sharding: the table again from "
                                                                 "benchmarks/results/sharding.json, nothing solved")
    ap.add_argument("--sharding", action="store_true", help=f"instead: {SHARDING_SECTION[3:]} (the plan with "
                                                             "sharding weighed against the best without)")
    ap.add_argument("--tensor-parallel", action="store_true", help=f"instead: {TP_SECTION[3:]} (the plan with "
                                                                    "T weighed against the best without)")
    a = ap.parse_args(argv)
    if a.tensor_parallel:
        rows = [run_tensor_parallel(name, MODELS[name], n) for name in (a.models or ["GPT 13B"])
                for n in (a.devices or [TP_DEVICES])]
        text = tensor_parallel_table(rows)
        print(text)
        out = ROOT / "benchmarks/results/tensor_parallel.json"
        out.write_text(json.dumps(rows, indent=1) + "\n")
        if a.write is not None:
            write_section(a.write, TP_SECTION, "`.venv/bin/python benchmarks/shapes.py --tensor-parallel --write "
                          "docs/benchmarks.md` (written by the script; raw rows in "
                          f"`benchmarks/results/tensor_parallel.json`).\n{TP_DOC}\n\n{text}")
        return
    a.models = a.models or list(MODELS)
    a.devices = a.devices or list(DEVICES)
    if a.sharding:
        out = ROOT / "benchmarks/results/sharding.json"
        if a.from_results:
            rows = json.loads(out.read_text())
        else:
            rows = [run_sharding(name, spec) for name, spec in SHARDING_MODELS.items()]
            out.write_text(json.dumps(rows, indent=1) + "\n")
        text = sharding_table(rows)
        print(text)
        if a.write is not None:
            write_section(a.write, SHARDING_SECTION, "`.venv/bin/python benchmarks/shapes.py --sharding --write "
                          "docs/benchmarks.md` (written by the script; raw rows in `benchmarks/results/sharding.json`)."
                          f"\n{SHARDING_DOC}\n\n{text}")
        return
    done = {}
    if a.resume is not None:
        for line in a.resume.read_text().splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                done[row["model"], row["devices"]] = row
    rows = [row for name in a.models for row in run(name, MODELS[name], done, tuple(a.devices))]
    text = table(rows)
    print(text)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rows, indent=1) + "\n")
    if a.write is not None:
        write_section(a.write, SECTION, f"`.venv/bin/python benchmarks/shapes.py --write docs/benchmarks.md` "
                                        f"(written by the script; raw rows in `benchmarks/results/shapes.json`).\n"
                                        f"{__doc__.split(chr(10), 2)[2].strip()}\n\n{text}")
        print(f"wrote {a.write}")


if __name__ == "__main__":
    main()
