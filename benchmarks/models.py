"""The models that need a partitioner most, planned as a user would: the chosen plan against two others, side by side.

Run:  .venv/bin/python benchmarks/models.py [--models NAME ...] [--write docs/benchmarks.md]

Each model is a Hugging Face ``LlamaForCausalLM`` at Llama 3's published shape (smp's ``hf-llama``
presets: grouped key/value heads, SwiGLU, torch's fused attention), built on the meta device and
priced analytically on the ``h100-sxm`` profile as a bf16 mixed-precision run (activations, cut
tensors and op times as ``torch.autocast`` makes them; fp32 master weights; 8 GPUs per node on
NVLink, nodes on InfiniBand, 80 GB each). For N GPUs and a global batch of sequences of 4,096 tokens,
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


def nearest_to_fitting(search: Any) -> dict[str, Any]:
    """When no shape fits: the one needing least memory (its shape, bytes and reason), else the first refused."""
    needing = [c for c in search.candidates if c.needs is not None]
    c = min(needing, key=lambda c: c.needs) if needing else search.candidates[0]
    return {"nearest_shape": str(c.shape), "needs_bytes": c.needs, "reason": c.reason}


def layer_prices(spec: str) -> dict[str, dict[str, float]]:
    """One layer's seconds per sample (forward, backward, and of them the tensor-parallel collectives) whole and at
    T = 2, 4, 8 without and with sequence parallelism ("8+sp"): the middle layer of the model's profiled graph,
    priced per tp rank on a node's link as the search prices it."""
    from partitioner.cluster import Cluster
    from partitioner.compile import profile_model, trace_model
    from partitioner.program import flatten_inputs
    from partitioner.request import PlanRequest
    from partitioner.tensor_parallel import global_shapes, price_tensor_parallel, tensor_parallel_split, tp_link
    from smp.models import build

    built = build(spec + ",batch=1", seed=0, meta=True)
    request = PlanRequest.build(device_profile=PROFILE, dtype="bf16")
    gm = trace_model(built.model, built.example_args, None, request, microbatches=1)
    graph, _ = profile_model(built.model, built.example_args, None, request, microbatches=1, traced=gm)
    flat = flatten_inputs(gm, built.example_args, {})
    shapes = global_shapes(gm, flat)
    node = Cluster.load(PROFILE, devices=8)
    middle = f"model.layers.{built.model.config.num_hidden_layers // 2}"
    layer = [v for v in graph.nx if graph[v]["module"] == middle or graph[v]["module"].startswith(middle + ".")]

    def costs(priced: Any) -> dict[str, float]:
        return {key: sum(priced[v].get(key, 0.0) for v in layer) for key in ("fwd", "bwd", "tp_fwd_comm",
                                                                            "tp_bwd_comm")}

    out = {"1": costs(graph)}
    for t in (2, 4, 8):
        for sequence in (False, True):
            split = tensor_parallel_split(built.model, gm, flat, t, shapes=shapes, sequence_parallel=sequence)
            out[f"{t}+sp" if sequence else str(t)] = costs(price_tensor_parallel(graph, split, tp_link(node, t)))
    return out


def layer_table(rows: list[dict[str, Any]]) -> str:
    """What T buys one layer of each model, without and with sequence parallelism (from :func:`layer_prices`)."""
    lines = ["| model | T | one layer, forward + backward, per rank (without SP) | of it collectives | speed-up | "
             "with sequence parallelism | of it collectives | speed-up |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        prices = r.get("layer_seconds", {})
        if "1" not in prices:
            continue
        whole = prices["1"]["fwd"] + prices["1"]["bwd"]
        lines.append(f"| {r['model']} | 1 | {whole * 1e3:.1f} ms | | | | | |")
        for t in ("2", "4", "8"):
            cells = []
            for key in (t, f"{t}+sp"):
                c = prices.get(key)
                if c is None:
                    cells += ["", "", ""]
                    continue
                step = c["fwd"] + c["bwd"]
                cells += [f"{step * 1e3:.1f} ms", f"{(c['tp_fwd_comm'] + c['tp_bwd_comm']) * 1e3:.1f} ms",
                          f"{whole / step:.1f}x"]
            lines.append(f"| {r['model']} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
        if row[label] is not None:
            row[label]["planning_s"] = seconds
        else:
            row[label] = {"planning_s": seconds, **nearest_to_fitting(search)}
        print(json.dumps({label: row[label]}), flush=True)
    row["layer_seconds"] = layer_prices(spec)
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
                nearest = f"nearest: {c['nearest_shape']}, " if c.get("nearest_shape") else ""
                lines.append(f"| {r['model']} | {r['devices']} | {title} | none fits ({nearest}{c['reason'][:80]}) "
                             f"| | | | | | {c['planning_s']:.0f} s | |")
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
    text = table(rows) + "\n\nOne layer of each model on a 4,096-token sample, priced per tp rank (the middle layer; " \
        "`layer_seconds` in the results):\n\n" + layer_table(rows)
    print(text)
    if a.write is not None:
        write_section(a.write, SECTION, "`.venv/bin/python benchmarks/models.py --write docs/benchmarks.md` (written "
                      f"by the script; raw rows in `benchmarks/results/{RESULTS.name}`; \"vs this\": the plan's step "
                      "over smp's choice).\n" + __doc__.split("\n", 2)[2].strip() + "\n\n" + text)


if __name__ == "__main__":
    main()
