"""The models that need a partitioner most, planned as a user would: the chosen plan against two others, side by side.

Run:  .venv/bin/python benchmarks/models.py [--models NAME ...] [--write docs/benchmarks.md]

Each model is a Hugging Face ``LlamaForCausalLM`` at Llama 3's published shape (smp's ``hf-llama``
presets: grouped key/value heads, SwiGLU, torch's fused attention), built on the meta device and
priced analytically on the ``h100-sxm`` profile in bf16 (8 GPUs per node on NVLink, nodes on
InfiniBand, 80 GB each). For N GPUs and a global batch of sequences of 4,096 tokens,
``smp.plan_shapes`` weighs D x P x T x m x schedule (T in 1, 2, 4, 8 within a node), sharding and
recomputation, and keeps the fastest simulated step that fits. Side by side, priced by the same
cost model: (a) the best plan without tensor parallelism (``tensor_parallel=1``, the search before
it), (b) Megatron-LM's style of configuration (Narayanan et al., SC 2021): T = 8 within the node and
the interleaved 1F1B schedule, its P, D, m, sharding (Megatron's distributed optimizer is
``shard_grad_op``'s optimizer-state part) and recomputation (selective among them) the best the
search finds in that family: the row says which it chose. Predicted MFU is
6 x parameters x tokens per step / step time / (N x the profile's bf16 peak). Each plan's proven
lower bound (no plan of its shape is faster, whatever its cut: its busiest rank's share of the
compute) and the gap to it come from the search. Planning time is what a user waits for ``smp plan`` of the chosen plan:
the model built on meta, traced, profiled and searched, on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._markdown import write_section  # noqa: E402

#: name -> (model spec, GPUs, global batch in sequences)
MODELS = {
    "Llama-3-70B-shaped": ("hf-llama:size=70b", 64, 512),
    "Llama-3-405B-shaped": ("hf-llama:size=405b", 512, 1024),
}
PROFILE = "h100-sxm"
SECTION = "## The largest models: data x pipeline x tensor parallelism, planned"
RESULTS = ROOT / "benchmarks/results/models.json"


def summary(search: Any, params: int, tokens: int, peak: float) -> dict[str, Any] | None:
    """The fastest plan of a search as a row: shape, speed, predicted MFU, its bound and gap, the search's."""
    best = search.candidates[0]
    if best.plan is None:
        return None
    step = best.step_time
    return {"data_parallel": best.shape.data_parallel, "stages": best.shape.stages,
            "tensor_parallel": best.shape.tensor_parallel, "microbatches": best.shape.microbatches,
            "schedule": best.shape.schedule, "sharding": best.plan.sharding,
            "recomputing_stages": sum(r != "none" for r in best.recompute), "all_stages": len(best.recompute),
            "step_s": step,
            "samples_per_second": best.samples_per_second, "memory_bytes": best.memory,
            "mfu": 6 * params * tokens / step / (search.devices * peak),
            "lower_bound_s": best.compute_bound, "gap": best.gap, "space_lower_bound_s": search.lower_bound,
            "space_gap": search.gap, "candidates": len(search.candidates),
            "pruned": sum(c.pruned for c in search.candidates)}


def layer_costs(search: Any) -> dict[str, dict[str, float]]:
    """One layer's seconds per sample (forward, backward, and of them the tensor-parallel collectives) at each T
    the search has a plan for, read off that plan's folded graph (the middle layer of the repeated blocks)."""
    out: dict[str, dict[str, float]] = {}
    for c in search.candidates:
        t = str(c.shape.tensor_parallel)
        if c.plan is None or t in out or not c.plan.graph.meta.get("blocks"):
            continue
        graph = c.plan.graph
        layers = [v for v in graph.topological_order() if graph[v]["module"].startswith(graph.meta["blocks"] + ".")]
        node = graph[layers[len(layers) // 2]]
        per_sample = search.global_batch // (c.shape.data_parallel * c.shape.microbatches)
        out[t] = {key: node.get(key, 0.0) / per_sample for key in ("fwd", "bwd", "tp_fwd_comm", "tp_bwd_comm")}
    return out


def run(name: str) -> dict[str, Any]:
    """Plan ``name`` three ways (chosen, without T, Megatron-style) and time the chosen one's planning."""
    from partitioner.compile import plan_shapes
    from partitioner.devices import DeviceSpec
    from partitioner.request import PlanRequest
    from smp.models import build

    spec, devices, batch = MODELS[name]
    peak = DeviceSpec.from_profile(PROFILE).peak_flops["bf16"]
    request = PlanRequest.build(device_profile=PROFILE, dtype="bf16", cluster=PROFILE, devices=devices,
                                global_batch=batch)
    row: dict[str, Any] = {"model": name, "spec": spec, "devices": devices, "global_batch": batch}
    for label, changes in (("chosen", {"tensor_parallel": "auto"}), ("without_tp", {"tensor_parallel": 1}),
                           ("megatron_style", {"tensor_parallel": 8, "schedule": "interleaved"})):
        t0 = time.perf_counter()
        built = build(spec + ",batch=1", seed=0, meta=True)
        search = plan_shapes(built.model, built.example_args, request=request.with_(**changes))
        seconds = time.perf_counter() - t0
        params = sum(p.numel() for p in built.model.parameters())
        tokens = batch * built.example_args[0].shape[1]
        row["params"], row["tokens"] = params, tokens
        row[label] = summary(search, params, tokens, peak)
        row.setdefault("layer_seconds", {}).update(layer_costs(search))
        if row[label] is not None:
            row[label]["planning_s"] = seconds
        else:
            row[label] = {"planning_s": seconds, "reason": search.candidates[0].reason}
        print(json.dumps({label: row[label]}), flush=True)
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | GPUs | plan | D x P x T, m, schedule | sharding | recomputing stages | step | MFU | "
             "bound (gap) | planning | vs this |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        chosen = r["chosen"]
        for label, title in (("chosen", "smp's choice"), ("without_tp", "(a) best without T"),
                             ("megatron_style", "(b) Megatron-style")):
            c = r[label]
            if "step_s" not in c:
                lines.append(f"| {r['model']} | {r['devices']} | {title} | none fits ({c['reason'][:80]}) | | | | | | "
                             f"{c['planning_s']:.0f} s | |")
                continue
            ratio = "" if label == "chosen" or "step_s" not in chosen else f"{c['step_s'] / chosen['step_s']:.2f}x"
            lines.append(
                f"| {r['model']} | {r['devices']} | {title} | {c['data_parallel']} x {c['stages']} x "
                f"{c['tensor_parallel']}, m={c['microbatches']}, {c['schedule']} | {c['sharding']} | "
                f"{c['recomputing_stages']} of {c['all_stages']} | {c['step_s']:.2f} s | {c['mfu']:.1%} | "
                f"{c['lower_bound_s']:.2f} s ({c['gap']:.1%}) | {c['planning_s']:.0f} s | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/models.py", description=__doc__)
    ap.add_argument("--models", nargs="*", choices=list(MODELS), help="default: every model")
    ap.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    ap.add_argument("--from-results", action="store_true", help=f"the table again from {RESULTS.name}, nothing run")
    a = ap.parse_args(argv)
    if a.from_results:
        rows = json.loads(RESULTS.read_text())
    else:
        fresh = {name: run(name) for name in (a.models or list(MODELS))}
        kept = {r["model"]: r for r in json.loads(RESULTS.read_text())} if RESULTS.exists() else {}
        rows = [fresh.get(name) or kept[name] for name in MODELS if name in fresh or name in kept]  # others kept
        RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    text = table(rows)
    print(text)
    if a.write is not None:
        write_section(a.write, SECTION, "`.venv/bin/python benchmarks/models.py --write docs/benchmarks.md` (written "
                      f"by the script; raw rows in `benchmarks/results/{RESULTS.name}`; \"vs this\": the plan's step "
                      "over smp's choice).\n" + __doc__.split("\n", 2)[2].strip() + "\n\n" + text)


if __name__ == "__main__":
    main()
