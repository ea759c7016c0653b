"""GPU checks on one CUDA device: per-op timing against the analytic profile, all stages in one process, memory, bf16.

    python benchmarks/gpu.py --out DIR [--write docs/benchmarks.md]   (on a machine with a GPU; DIR/gpu.json, gpu.md)
    python benchmarks/gpu.py --quick --device cpu  (the same code on small models, to check the script)

1. Calibration: ``smp calibrate`` on the device (matrix-product FLOP/s per dtype, copy
   bandwidth) beside the ``h100-sxm`` profile that the planner's benchmarks price on.
2. Per-op timing: each zoo model built in bf16 on the device and profiled op by op with CUDA
   events (in context), and built on the meta device and priced analytically in bf16, on
   ``h100-sxm`` and on the calibrated profile. Each sum over the ops is divided by the
   whole model's forward and backward, timed (synchronised). "per-op gap" is
   Σ |analytic - measured| / Σ measured over every op's forward and backward: how far the
   analytic profile the planner uses without a GPU is from this GPU, op by op.
3. Runtime: a GPT planned (measured on the device) for 4 stages, 1F1B, 8 microbatches,
   bf16 autocast with fp32 weights, every stage in this one process on the device through
   the engine real ranks run. The first step's loss and gradients against the unpartitioned
   model under the same autocast; after two AdamW steps each rank's exact holdings
   (``memory_stats``) against the plan's rank memory, and ``torch.cuda.max_memory_allocated``
   from the first optimizer step on (once the reference's gradients are freed) against the sum
   of the plan's rank memory (every rank in one process).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._markdown import write_section  # noqa: E402
from benchmarks.profile_accuracy import per_op_gap, whole_model_cells  # noqa: E402
from partitioner import profile  # noqa: E402
from partitioner.devices import load_profile  # noqa: E402
from partitioner.profile_measured import time_whole_model  # noqa: E402
from smp.models import build  # noqa: E402

SECTION = "## On a GPU: per-op timing, the runtime in one process, memory, bf16"
MODELS = ["gpt:size=base,batch=8", "bert:size=base,batch=16", "t5:size=small,batch=16", "resnet:size=base,batch=32",
          "unet:size=small,batch=16"]
QUICK_MODELS = ["gpt:size=tiny,batch=4", "resnet:size=tiny,batch=4"]
RUNTIME = "gpt:layers=8,d_model=1024,heads=16,seq_len=1024,vocab=32000,batch=16"
QUICK_RUNTIME = "gpt:layers=4,d_model=64,heads=4,seq_len=32,vocab=256,batch=8"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing_row(spec: str, device: torch.device, calibrated: dict) -> dict[str, Any]:
    real = build(spec, device=device, dtype=torch.bfloat16)
    meta = build(spec, meta=True)
    t0 = time.perf_counter()
    measured = profile(real.model, real.example_args, real.example_kwargs, device=device)
    seconds = time.perf_counter() - t0
    fwd, bwd = time_whole_model(real.model, real.example_args, real.example_kwargs)
    row: dict[str, Any] = {"model": spec, "ops": len(measured), "whole_fwd": fwd, "whole_bwd": bwd,
                           "profile_seconds": seconds}
    meta_bf16 = build(spec, meta=True, dtype=torch.bfloat16)
    graphs = {"measured": measured,  # and one op at a time from the meta device, as a model larger than the GPU is
              "one_at_a_time": profile(meta_bf16.model, meta_bf16.example_args, meta_bf16.example_kwargs,
                                       device=device)}
    row["gap_one_at_a_time"] = per_op_gap(graphs["one_at_a_time"], measured)
    for name, prof in (("h100-sxm", "h100-sxm"), ("calibrated", calibrated)):
        graphs[name] = profile(meta.model, meta.example_args, meta.example_kwargs, timing="analytic",
                               device_profile=prof, dtype="bf16")
        row[f"gap_{name}"] = per_op_gap(graphs[name], measured)
    for name, graph in graphs.items():
        row[name] = {"fwd": graph.total_fwd, "bwd": graph.total_bwd}
    del real
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return row


def runtime_row(spec: str, device: torch.device, stages: int, microbatches: int) -> dict[str, Any]:
    import smp

    b = build(spec, device=device, seed=0)
    model = b.model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    with autocast:  # the reference: the whole model, whole batch (the mean of equal microbatches' mean losses)
        ref_loss = b.loss_fn(model(*b.example_args, **b.example_kwargs), b.target)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    pipe = smp.partition(model, stages=stages, microbatches=microbatches, schedule="1f1b", loss_fn=b.loss_fn,
                         device=device, precision="bf16")
    pipe.prepare(*b.example_args, **b.example_kwargs)
    plan = pipe.plan
    ranks = range(plan.pipeline_ranks)
    opts = [torch.optim.AdamW(pipe.parameters(rank=r), lr=1e-5, foreach=True) for r in ranks]
    from runtime.memory import OptimizerStepMeter

    meters = [OptimizerStepMeter(opt) for opt in opts]
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    step_times, losses, grad_err = [], [], None
    for i in range(3):
        sync(device)
        t0 = time.perf_counter()
        loss = pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
        sync(device)
        step_times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if i == 0:
            num = den = 0.0
            for n, p in model.named_parameters():
                if n in ref_grads and p.grad is not None:
                    num += float((p.grad.float() - ref_grads[n].float()).norm()) ** 2
                    den += float(ref_grads[n].float().norm()) ** 2
            grad_err = (num ** 0.5) / (den ** 0.5)
            del ref_grads
            if device.type == "cuda":  # the peak from here on, without the reference's gradients
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
        for opt in opts:
            opt.step()
        if i < 2:
            for opt in opts:
                opt.zero_grad(set_to_none=False)  # keep gradients allocated, as the plan counts them
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    per_rank = []
    for r in ranks:
        got = pipe.memory_stats(opts[r], step_meter=meters[r])[r]
        per_rank.append({"rank": r, "predicted": plan.rank_memory[r], "measured": got["total"],
                         "ratio": got["total"] / plan.rank_memory[r],
                         "activations_predicted": plan.simulated.peak_activation_bytes_per_rank[r],
                         "activations_measured": got["activations_peak"]})
    return {"model": spec, "stages": stages, "microbatches": microbatches, "params": sum(
            p.numel() for p in model.parameters()), "ref_loss": float(ref_loss.detach()), "first_loss": losses[0],
            "losses": losses, "grad_rel_err": grad_err, "step_seconds": step_times,
            "predicted_step": plan.step_time, "ranks": per_rank, "cuda_peak": peak, "cuda_base": base,
            "predicted_total": sum(plan.rank_memory)}


def markdown(env: dict, calib: dict, h100: dict, rows: list[dict], rt: dict, command: str) -> str:
    mib = 2 ** 20
    lines = [f"Run: `{command}` on {env['device']} (torch {env['torch']}, CUDA {env['cuda']}), {env['when']}.", "",
             "Calibrated (`smp calibrate` on this device) against the `h100-sxm` profile the planner's "
             "benchmarks price on:", "",
             "| | this device | h100-sxm | ratio |", "|---|---:|---:|---:|"]
    def achieved(prof: dict, key: str) -> float | None:  # what analytic pricing uses: peak x efficiency
        peak = prof["device"]["peak_flops"].get(key)
        return peak * prof["device"].get("efficiency", 1.0) if peak else None

    for key in ("bf16", "tf32", "fp32"):
        a, b = achieved(calib, key), achieved(h100, key)
        if a and b:
            lines.append(f"| {key} matmul TFLOP/s (peak x efficiency) | {a / 1e12:.0f} | {b / 1e12:.0f} | {a / b:.2f} |")
    a, b = calib["device"]["memory_bandwidth"], h100["device"]["memory_bandwidth"]
    lines += [f"| copy bandwidth GB/s | {a / 1e9:.0f} | {b / 1e9:.0f} | {a / b:.2f} |", "",
              "Per-op timing in bf16: each sum over the ops divided by the whole model timed (CUDA events; "
              "\"one op at a time\": the model built on meta, each op timed with only its own weights on the GPU); "
              "per-op gap = Σ|estimate − measured| / Σ measured, forward and backward.", "",
              "| model | ops | whole fwd ms | Σ measured | Σ one op at a time | Σ analytic h100-sxm | Σ analytic "
              "calibrated | whole bwd ms | Σ measured | Σ one op at a time | Σ analytic h100-sxm | Σ analytic calibrated "
              "| gap one at a time | gap h100-sxm | gap calibrated |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = whole_model_cells(r, ("measured", "one_at_a_time", "h100-sxm", "calibrated"))
        cells += [f"{r[f'gap_{n}']:.0%}" for n in ("one_at_a_time", "h100-sxm", "calibrated")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Runtime, every stage in one process on the device: `{rt['model']}` ({rt['params'] / 1e6:.0f}M "
              f"parameters), {rt['stages']} stages, 1F1B, {rt['microbatches']} microbatches, bf16 autocast, fp32 "
              "weights, AdamW.", "",
              f"- first step's loss {rt['first_loss']:.5f} against the unpartitioned model's {rt['ref_loss']:.5f} "
              f"(difference {abs(rt['first_loss'] - rt['ref_loss']):.2e}); gradients' relative error "
              f"‖g_pipe − g_ref‖ / ‖g_ref‖ = {rt['grad_rel_err']:.2e}; losses over three steps "
              + ", ".join(f"{x:.4f}" for x in rt["losses"]),
              "- step time (all stages one after another in one process): "
              + ", ".join(f"{s * 1e3:.1f} ms" for s in rt["step_seconds"]),
              ]
    if rt["cuda_peak"] is not None:
        lines.append(f"- `torch.cuda.max_memory_allocated` over the steps {rt['cuda_peak'] / mib:.0f} MiB against "
                     f"the sum of the plan's rank memory {rt['predicted_total'] / mib:.0f} MiB: ratio "
                     f"{rt['cuda_peak'] / rt['predicted_total']:.3f} (from the first optimizer step on, "
                     f"the reference's gradients freed; {rt['cuda_base'] / mib:.0f} MiB allocated before the steps)")
    lines += ["", "| rank | predicted | measured (memory_stats) | ratio | activations predicted | measured |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in rt["ranks"]:
        lines.append(f"| {r['rank']} | {r['predicted'] / mib:.1f} MiB | {r['measured'] / mib:.1f} MiB | "
                     f"{r['ratio']:.3f} | {r['activations_predicted'] / mib:.1f} MiB | "
                     f"{r['activations_measured'] / mib:.1f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for gpu.json and gpu.md")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small models: check the script, not the device")
    ap.add_argument("--write", type=Path, help="also replace this benchmark's section of a markdown file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py: torch sees no GPU here; pass --device cpu --quick to check the script")
    from smp.calibrate import calibrate

    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(env, flush=True)
    calib = calibrate(name="gpu-check", quick=args.quick, device=str(device), link=False, log=print)
    h100 = load_profile("h100-sxm")
    rows = []
    for spec in QUICK_MODELS if args.quick else MODELS:
        rows.append(timing_row(spec, device, calib))
        print(json.dumps(rows[-1]), flush=True)
    rt = runtime_row(QUICK_RUNTIME if args.quick else RUNTIME, device, stages=4, microbatches=8)
    print(json.dumps(rt), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/gpu.py" + (" --quick" if args.quick else "")
    (args.out / "gpu.json").write_text(json.dumps({"env": env, "calibrated": calib, "timing": rows, "runtime": rt},
                                                  indent=1))
    text = markdown(env, calib, h100, rows, rt, command)
    (args.out / "gpu.md").write_text(f"{SECTION}\n\n{text}\n")
    if args.write:
        write_section(args.write, SECTION, text)
    print(text)


if __name__ == "__main__":
    main()
