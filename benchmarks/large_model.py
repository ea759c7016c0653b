"""A model built without weights, on P gloo ranks: resident memory and checkpoint bytes read per rank.

    .venv/bin/python benchmarks/large_model.py [--ranks 4] [--write docs/benchmarks.md]

Four runs: as is (glibc's malloc, AdamW's foreach implementation, torch's defaults); with
glibc's mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_=65536` in the environment: by default the
threshold rises to 32 MiB after the first large free, and freed activation memory then stays in
the heap, resident); with that and AdamW's per-parameter loop (the foreach step makes
temporaries of one more copy of the rank's parameters, which the plan counts as the step's
workspace, the loop two copies of its largest parameter, which it does not); and the same
program on one rank holding every stage. Each rank is a new interpreter (tests/_launch.py, fresh=True). It
notes its resident memory once
torch and smp are imported and a tiny model has taken one AdamW step (the process baseline:
torch's thread pools and kernels, about 75 MiB, start with the first ops), builds the model under
`smp.delay_param_initialization()`, lets `smp.partition(..., checkpoint=DIR)` load its stages from
a Hugging Face-style sharded safetensors directory, and trains `--steps` AdamW steps. Figures per
rank: the stage memory it holds (parameters, gradients, AdamW state, buffers, and the larger of
the peak stashed activations and the optimizer step's workspace, counted exactly by
`memory_stats` with an `OptimizerStepMeter`) and the plan's prediction of it, and the step's
workspace measured against the plan's; its peak resident
memory (VmHWM) above the baseline, as a multiple of that stage memory (target: at most 1.2); the
bytes it read from storage while loading (`/proc/self/io` read_bytes, the checkpoint's pages
dropped from the page cache first, so page faults on the memory-mapped shards count) against its
stage's share of the checkpoint; the seconds partitioning and loading took; and the last training step's seconds (pipeline and
optimizer: what the fixed mmap threshold costs, every large allocation then being a fresh mapping). Then the planning row: a model larger than this machine's memory, built on meta and
planned analytically for H100s, with its planning time and the planning process's peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))  # tests/_launch.py: the N-rank launcher, not shipped with the packages

from benchmarks._markdown import write_section  # noqa: E402

SECTION = "## Models larger than one device: memory and checkpoint reads per rank"
RESULTS = Path(__file__).resolve().parent / "results" / "large_model.json"
SPEC = "gpt:layers=8,d_model=1024,heads=16,vocab=32000,seq_len=128,batch=8"  # 134M parameters, 537 MB fp32
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}
RUNS = [("as is", {}, True, None), ("mmap threshold fixed", FIXED_MMAP, True, None),  # None: --ranks
        ("mmap threshold fixed, AdamW per parameter", FIXED_MMAP, False, None),
        ("one rank, every stage (mmap threshold fixed)", FIXED_MMAP, True, 1)]
PLAN_SPEC = "gpt:layers=80,d_model=8192,heads=64,vocab=32000,seq_len=2048,batch=16"  # 65B parameters, 260 GB fp32


def _status(key: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise KeyError("read_bytes")


def drop_from_page_cache(directory: Path) -> None:
    """Evict the files' clean pages, so that reading them again is a real read (no root needed)."""
    os.sync()
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm_up(foreach: bool) -> None:
    """What every torch training process pays once, whatever its model: a small forward, backward and
    AdamW step start torch's thread pools and kernels (about 75 MiB resident here), part of the baseline."""
    layer = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(layer.parameters(), foreach=foreach)
    layer(torch.randn(8, 64)).sum().backward()
    optimizer.step()


def rank_worker(rank: int, world: int, *, spec: str, checkpoint: str, out: str, steps: int,
                microbatches: int, foreach: bool) -> None:
    """One rank: build on meta, partition and load its stages from ``checkpoint``, train ``steps`` steps."""
    import smp
    from runtime.memory import OptimizerStepMeter
    from smp.models import build

    _warm_up(foreach)
    baseline = _status("VmRSS")
    with smp.delay_param_initialization():
        bundle = build(spec, seed=0)
    read_before, started = _read_bytes(), time.perf_counter()
    pipe = smp.partition(bundle.model, stages=world, microbatches=microbatches, loss_fn=bundle.loss_fn,
                         checkpoint=checkpoint, timeout=300,
                         timing="analytic", device_profile="cpu")
    x, y = bundle.example_args[0], bundle.target
    pipe.prepare(x)
    loaded_s, read = time.perf_counter() - started, _read_bytes() - read_before
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4, foreach=foreach)
    meter = OptimizerStepMeter(optimizer)
    for _ in range(steps):
        step_started = time.perf_counter()
        pipe.step(x, target=y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated, as the plan counts them
        step_s = time.perf_counter() - step_started  # the last step's: the allocator then holds what it keeps
    held = pipe.memory_stats(optimizer, step_meter=meter)[rank]
    plan = pipe.plan
    local = [p for p in bundle.model.parameters() if not p.is_meta]
    result = {"rank": rank, "baseline": baseline, "peak": _status("VmHWM"), "held": held,
              "predicted": plan.rank_memory[rank], "read": read,
              "predicted_workspace": sum(plan.partition.stages[s].workspace for s in plan.schedule.stages_of(rank)),
              "loaded_s": loaded_s, "step_s": step_s,
              "stage_param_bytes": sum(p.numel() * p.element_size() for p in local)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def plan_row(spec: str, stages: str) -> dict:
    """Plan a model larger than this machine's memory on meta (run in a subprocess): seconds and peak memory."""
    import smp
    from smp.models import build

    baseline = _status("VmRSS")
    started = time.perf_counter()
    bundle = build(spec, meta=True)
    plan = smp.plan(bundle.model, bundle.example_args, stages=int(stages), microbatches=2 * int(stages),
                    device_profile="h100-sxm", dtype="bf16")
    seconds = time.perf_counter() - started
    params = sum(p.numel() for p in bundle.model.parameters())
    return {"spec": spec, "params": params, "fp32_bytes": 4 * params, "stages": int(stages), "seconds": seconds,
            "baseline": baseline, "peak": _status("VmHWM"), "machine": os.sysconf("SC_PAGE_SIZE")
            * os.sysconf("SC_PHYS_PAGES"), "bottleneck_s": plan.partition.bottleneck}


def _in_subprocess(function: str, *args: str) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); "
            f"from benchmarks.large_model import {function}; print(json.dumps({function}(*sys.argv[1:])))")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def tables(runs: dict[str, list[dict]], total_bytes: int, planned: dict, spec: str) -> str:
    lines = [f"Model `{spec}`: {mib(total_bytes)} of weights in the checkpoint.", "",
             "| run | rank | stage memory held | predicted | held / predicted | peak RSS above baseline | "
             "RSS / held | step workspace / predicted | read from storage | its weights | read / its weights | "
             "partition + load s | last step s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run, ranks in runs.items():
        for r in ranks:
            held = r["held"]["total"]
            grown = r["peak"] - r["baseline"]
            lines.append(f"| {run} | {r['rank']} | {mib(held)} | {mib(r['predicted'])} | "
                         f"{held / r['predicted']:.3f} | {mib(grown)} | {grown / held:.2f} | "
                         f"{r['held']['optimizer_step_peak'] / r['predicted_workspace']:.2f} | {mib(r['read'])} | "
                         f"{mib(r['stage_param_bytes'])} | {r['read'] / r['stage_param_bytes']:.2f} | "
                         f"{r['loaded_s']:.1f} | {r['step_s']:.2f} |")
    first = next(iter(runs.values()))
    lines += ["", f"Read from storage, summed over the ranks of the first run: {mib(sum(r['read'] for r in first))}; "
              f"the most any rank read: {max(r['read'] for r in first) / total_bytes:.2f} of the checkpoint.", "",
              f"Planning a model larger than this machine: `{planned['spec']}` ({planned['params'] / 1e9:.1f}B "
              f"parameters, {planned['fp32_bytes'] / 2**30:,.0f} GiB in fp32; this machine has "
              f"{planned['machine'] / 2**30:.0f} GiB) built on meta and planned for {planned['stages']} H100s "
              f"(analytic, bf16) in {planned['seconds']:.1f} s; the planning process peaked at "
              f"{mib(planned['peak'])} resident ({mib(planned['peak'] - planned['baseline'])} above its baseline)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--spec", default=SPEC)
    parser.add_argument("--plan-spec", default=PLAN_SPEC)
    parser.add_argument("--write", type=Path, help="replace this section of a markdown file (docs/benchmarks.md)")
    opts = parser.parse_args()

    from runtime.checkpoint import save_sharded
    from _launch import launch
    from smp.models import build

    with tempfile.TemporaryDirectory(prefix="smp-large-") as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        model = build(opts.spec, seed=0).model
        save_sharded(model.state_dict(), checkpoint, shard_bytes=128 << 20)
        total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        del model
        runs: dict[str, list[dict]] = {}
        for run, malloc_env, foreach, world in RUNS:
            drop_from_page_cache(checkpoint)
            os.environ.update(malloc_env)  # a new interpreter's malloc reads it when it starts
            try:
                results = launch(f"{Path(__file__).resolve()}:rank_worker", world or opts.ranks,
                                 {"spec": opts.spec, "checkpoint": str(checkpoint), "out": tmp, "steps": opts.steps,
                                  "microbatches": opts.ranks, "foreach": foreach}, timeout=1800, pg_timeout=600,
                                 fresh=True)
            finally:
                for key in malloc_env:
                    os.environ.pop(key, None)
            for r in results:
                if r.returncode != 0:
                    raise SystemExit(f"rank {r.rank} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
            runs[run] = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world or opts.ranks)]
    planned = _in_subprocess("plan_row", opts.plan_spec, "8")
    text = tables(runs, total_bytes, planned, opts.spec)
    print(text)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"runs": runs, "plan": planned,
                                   "max_rss_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}, indent=1))
    if opts.write:
        write_section(opts.write, SECTION,
                      f"`.venv/bin/python benchmarks/large_model.py --write docs/benchmarks.md` (written by the "
                      f"script; raw figures in `benchmarks/results/large_model.json`).\n"
                      f"{__doc__.split(chr(10) * 2, 2)[2].strip()}\n\n{text}")


if __name__ == "__main__":
    main()
