"""How well per-op profiles add up: Σ fwd and Σ bwd of the OpGraph against the whole model, timed.

    .venv/bin/python benchmarks/profile_accuracy.py [--threads 1] [--write docs/benchmarks.md]

Three profiles of each model, in the same run: measured in context (the real model, every op
timed in sweeps over the whole program), measured one op at a time (the same model built on the
meta device, each op timed with only its own weights materialized: how a model larger than the
device is profiled on it) and analytic (FLOPs and bytes priced on the `cpu` device profile).
Each sum is divided by a timed whole forward and backward of the real model. "per-op gap" is
Σ |one op at a time - in context| / Σ in context over the ops, forward and backward together:
how far the two measured profiles disagree op by op, which is what the partitioner sees.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._markdown import write_section  # noqa: E402
from partitioner import OpGraph, profile  # noqa: E402
from partitioner.profile_measured import time_whole_model  # noqa: E402
from smp.models import build  # noqa: E402

SECTION = "## Profiling accuracy: in context, one op at a time (meta), analytic"
RESULTS = Path(__file__).resolve().parent / "results" / "profile_accuracy.json"
SPECS = [
    "gpt:layers=2,d_model=256,heads=4,seq_len=128,batch=4,vocab=2048",
    "gpt:layers=4,d_model=512,heads=8,seq_len=256,batch=4,vocab=8192",
    "bert:layers=4,d_model=256,heads=4,seq_len=128,batch=8,vocab=8192",
    "t5:layers=2,dec_layers=2,d_model=256,heads=4,seq_len=64,dec_seq_len=64,batch=8,vocab=8192",
    "resnet:size=small,image=64,batch=8",
    "unet:levels=3,base=16,image=64,batch=4",
    "mlp:layers=8,hidden=1024,batch=64",
    "mlp:layers=8,d_in=768,hidden=768,d_out=768,batch=32",  # weights larger than L2: one microbatch of the runtime benchmark
]
HF_SPECS = [  # traced by torch.export: parameters fetched by get_attr, many small ops
    "hf-llama:layers=4,d_model=256,heads=4,kv_heads=2,vocab=8192,seq_len=128,batch=4",
    "hf-gpt2:layers=4,d_model=256,heads=4,seq_len=128,batch=8,vocab=8192",
]


def per_op_gap(alone: OpGraph, in_context: OpGraph) -> float:
    """Σ |alone - in context| / Σ in context over every op's forward and backward."""
    diff = total = 0.0
    for name, ctx in in_context.nx.nodes(data=True):
        one = alone.nx.nodes[name]
        for key in ("fwd", "bwd"):
            diff += abs(one[key] - ctx[key])
            total += ctx[key]
    return diff / total


def measure(spec: str, repeats: int) -> dict:
    real = build(spec)
    meta = build(spec, meta=True)
    # threads=None: the profiles run on the threads main() set, as the whole model's timing does
    in_context = profile(real.model, real.example_args, real.example_kwargs, repeats=repeats, threads=None)
    alone = profile(meta.model, meta.example_args, meta.example_kwargs, repeats=repeats, threads=None)
    analytic = profile(meta.model, meta.example_args, meta.example_kwargs, timing="analytic", device_profile="cpu")
    fwd, bwd = time_whole_model(real.model, real.example_args, real.example_kwargs)
    row = {"model": spec, "ops": len(in_context), "whole_fwd": fwd, "whole_bwd": bwd,
           "per_op_gap": per_op_gap(alone, in_context)}
    for name, graph in (("in_context", in_context), ("one_at_a_time", alone), ("analytic", analytic)):
        row[name] = {"fwd": graph.total_fwd, "bwd": graph.total_bwd}
    return row


def whole_model_cells(row: dict, names: tuple[str, ...]) -> list[str]:
    """The model, its op count, and per pass the whole model's ms then each named per-op sum / the whole."""
    cells = [f"`{row['model']}`", str(row["ops"])]
    for key, whole in (("fwd", row["whole_fwd"]), ("bwd", row["whole_bwd"])):
        cells.append(f"{whole * 1e3:.2f}")
        cells += [f"{row[name][key] / whole:.2f}" for name in names]
    return cells


def table(rows: list[dict]) -> str:
    lines = ["| model | ops | whole fwd ms | fwd: in context | one op at a time | analytic | whole bwd ms | "
             "bwd: in context | one op at a time | analytic | per-op gap |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = whole_model_cells(r, ("in_context", "one_at_a_time", "analytic"))
        cells.append(f"{r['per_op_gap']:.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", type=Path, help="replace this section of a markdown file (docs/benchmarks.md)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    specs = SPECS + (HF_SPECS if importlib.util.find_spec("transformers") else [])
    rows = []
    for spec in specs:
        rows.append(measure(spec, opts.repeats))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    header = f"{torch.get_num_threads()} thread(s), profile repeats={opts.repeats}; each figure is Σ / whole."
    text = table(rows)
    print(f"\n{header}\n\n{text}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    if opts.write:
        write_section(opts.write, SECTION,
                      f"`.venv/bin/python benchmarks/profile_accuracy.py --write docs/benchmarks.md` (written by the "
                      f"script; raw rows in `benchmarks/results/profile_accuracy.json`).\n"
                      f"{__doc__.split(chr(10) * 2, 2)[2].strip()}\n\n{header}\n\n{text}")


if __name__ == "__main__":
    main()
