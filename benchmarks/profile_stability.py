"""How steady measured profiles are on a busy machine: one small model profiled 3 times while other processes load the CPU.

    .venv/bin/python benchmarks/profile_stability.py [--runs 3] [--load N] [--write docs/benchmarks.md]

Each profile runs while `--load` busy-loop processes (default: one per core, each stopped by
its own deadline) compete for the cores. "before" profiles as smp did before it controlled its
threads: torch's threads as they are (`profile(..., threads=None)`: one per core) and no
re-measuring of unstable sweeps; "after" with the profiler's defaults (`threads=1`, unstable
sets of sweeps measured again). For each: the sums of the per-op forward and backward times
of every run, their max / min, and the spread each profile recorded (`graph.meta["timing_spread"]`:
(max - min) / median of its sweeps' totals).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._markdown import write_section  # noqa: E402
import partitioner.profile_measured as measured  # noqa: E402
from partitioner import profile  # noqa: E402
from smp.models import build  # noqa: E402

SECTION = "## Profiling on a busy machine: threads and the spread of repeated profiles"
RESULTS = Path(__file__).resolve().parent / "results" / "profile_stability.json"
SPEC = "mlp:size=tiny"
#: How long a busy loop may run at most, whatever happens to this script.
LOAD_SECONDS = 240
BUSY_LOOP = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def busy_processes(count: int) -> list[subprocess.Popen]:
    """``count`` processes spinning on a core each, each ending by itself after LOAD_SECONDS."""
    code = BUSY_LOOP.format(seconds=LOAD_SECONDS)
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


@contextlib.contextmanager
def never_unstable():
    """No set of sweeps counts as unstable (none re-measured, no warning): the profiler as it was."""
    threshold = measured.UNSTABLE_SPREAD
    measured.UNSTABLE_SPREAD = math.inf
    try:
        yield
    finally:
        measured.UNSTABLE_SPREAD = threshold


def profiles(spec: str, runs: int, *, controlled: bool) -> dict:
    """``runs`` profiles of ``spec``: their forward and backward sums and recorded spreads."""
    bundle = build(spec)
    threads = measured.PROFILE_THREADS if controlled else None
    rows = []
    for _ in range(runs):
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.nullcontext() if controlled else never_unstable():
            warnings.simplefilter("always")
            start = time.perf_counter()
            graph = profile(bundle.model, bundle.example_args, bundle.example_kwargs, threads=threads)
        rows.append({"fwd": graph.total_fwd, "bwd": graph.total_bwd, "spread": graph.meta["timing_spread"],
                     "threads": graph.meta["threads"], "seconds": time.perf_counter() - start,
                     "warned": any("unstable" in str(w.message) for w in caught)})
    fwd, bwd = [r["fwd"] for r in rows], [r["bwd"] for r in rows]
    return {"runs": rows, "fwd_ratio": max(fwd) / min(fwd), "bwd_ratio": max(bwd) / min(bwd)}


def table(results: dict[str, dict]) -> str:
    lines = ["| threads | Σ fwd per run | Σ bwd per run | fwd max/min | bwd max/min | recorded spread | warned |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        runs = r["runs"]

        def each(key: str, fmt: str, runs: list = runs) -> str:
            return ", ".join(fmt.format(x[key]) for x in runs)

        lines.append(f"| {name} ({runs[0]['threads']}) | {each('fwd', '{:.2e} s')} | {each('bwd', '{:.2e} s')} "
                     f"| {r['fwd_ratio']:.2f} | {r['bwd_ratio']:.2f} | {each('spread', '{:.0%}')} "
                     f"| {sum(x['warned'] for x in runs)} of {len(runs)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy-loop processes")
    parser.add_argument("--spec", default=SPEC)
    parser.add_argument("--write", type=Path, help="replace this section of a markdown file (docs/benchmarks.md)")
    opts = parser.parse_args()
    load = busy_processes(opts.load)
    try:
        time.sleep(1.0)  # the loops running before the first profile
        results = {"before": profiles(opts.spec, opts.runs, controlled=False),
                   "after": profiles(opts.spec, opts.runs, controlled=True)}
    finally:
        for process in load:
            process.kill()
            process.wait()
    header = (f"`{opts.spec}`, {opts.runs} profiles each (repeats=5, warmup=2), {opts.load} busy-loop processes on "
              f"{os.cpu_count()} cores; before: torch's {torch.get_num_threads()} threads.")
    text = table(results)
    print(f"{header}\n\n{text}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"spec": opts.spec, "load": opts.load, "cores": os.cpu_count(), **results},
                                  indent=1))
    if opts.write:
        write_section(opts.write, SECTION,
                      f"`.venv/bin/python benchmarks/profile_stability.py --write docs/benchmarks.md` (written by the "
                      f"script; raw rows in `benchmarks/results/profile_stability.json`).\n"
                      f"{__doc__.split(chr(10) * 2, 2)[2].strip()}\n\n{header}\n\n{text}")


if __name__ == "__main__":
    main()
