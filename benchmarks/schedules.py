"""Simulated step time and bubble of every schedule on a GPT-like pipeline, against the textbook formulas.

Run:  .venv/bin/python benchmarks/schedules.py [--write docs/benchmarks.md]   (prints, or replaces, its section)

Stage costs are exactly equal (an analytic GPT-like parameterisation, 24 layers split evenly):
the case the textbook formulas describe. benchmarks/zoo_schedules.py runs the schedules on real
plans.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._markdown import write_section  # noqa: E402
from partitioner.schedule import Schedule, StageGraph, gpipe, interleaved_1f1b, one_f_one_b, zb_h1  # noqa: E402
from partitioner.simulate import StageCosts, simulate  # noqa: E402

SECTION = "## Pipeline schedules (simulated): against the textbook, equal stages"


@dataclass(frozen=True)
class GPTLike:
    """A GPT-like stack: ``layers`` identical transformer blocks, bf16, one sequence per microbatch."""

    layers: int = 24
    hidden: int = 2048
    heads: int = 16
    seq: int = 1024
    flops_per_s: float = 100e12  # sustained bf16 FLOP/s of one device
    link_bytes_per_s: float = 50e9  # point-to-point bandwidth between neighbouring ranks
    link_latency_s: float = 10e-6

    @property
    def layer_fwd_s(self) -> float:
        # 24 s h^2 (QKV, projection, MLP) + 4 s^2 h (attention scores and mix), x2 per multiply-add
        flops = 24 * self.seq * self.hidden**2 + 4 * self.seq**2 * self.hidden
        return flops / self.flops_per_s

    @property
    def boundary_bytes(self) -> int:
        return 2 * self.seq * self.hidden  # one bf16 hidden state per microbatch

    @property
    def layer_act_bytes(self) -> float:
        # activations a block stashes for backward (Korthikanti et al. 2022, no recomputation)
        return self.seq * self.hidden * (34 + 5 * self.heads * self.seq / self.hidden)

    def stages(self, num_stages: int) -> tuple[StageGraph, StageCosts]:
        """Equal stages of layers / num_stages blocks: f per layer, b = 2f, W = b / 2."""
        per = self.layers / num_stages
        f = self.layer_fwd_s * per
        comm_s = self.boundary_bytes / self.link_bytes_per_s + self.link_latency_s
        graph = StageGraph.chain(num_stages, self.boundary_bytes)
        costs = StageCosts(
            fwd=[f] * num_stages, bwd=[2 * f] * num_stages, bwd_w=[f] * num_stages,
            comm={e.key: comm_s for e in graph.edges},
            act_bytes=[self.layer_act_bytes * per] * num_stages,
        )
        return graph, costs


def theory(name: str, p: int, m: int, v: int, F: float, B: float, W: float) -> float:
    """Textbook bubble fraction (idle share of ranks x step time) with free communication."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zb_h1":  # Qi et al. 2024: bubble (p - 1)(F + B - W)
        bub = (p - 1) * (F + B - W)
        return bub / (m * (F + B + W) + bub)
    raise ValueError(name)


def schedules_for(model: GPTLike, p: int, m: int) -> list[tuple[str, int, Schedule, StageCosts]]:
    out = []
    g, c = model.stages(p)
    out.append(("gpipe", 1, gpipe(g, m), c))
    out.append(("1f1b", 1, one_f_one_b(g, m), c))
    for v in (2, 3):
        gv, cv = model.stages(p * v)
        out.append(("interleaved_1f1b", v, interleaved_1f1b(gv, m, p), cv))
    out.append(("zb_h1", 1, zb_h1(g, m), c))
    return out


def table(model: GPTLike, configs: Sequence[tuple[int, int]]) -> str:
    rows = [
        "| stages p | microbatches m | schedule | v | step, free comm (ms) | bubble (sim) | bubble (theory) "
        "| step with comm (ms) | peak activations, worst rank (GiB) | sim time (ms) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, m in configs:
        for name, v, sch, costs in schedules_for(model, p, m):
            free = StageCosts(costs.fwd, costs.bwd, costs.bwd_w, {}, costs.act_bytes)
            simulate(sch, free, timeline=False)  # compile (cached on the schedule)
            dt = float("inf")
            for _ in range(5):  # best of 5: the machine is shared
                t0 = time.perf_counter()
                r0 = simulate(sch, free, timeline=False)
                dt = min(dt, (time.perf_counter() - t0) * 1e3)
            r1 = simulate(sch, costs, timeline=False)
            S = sch.num_stages
            f = costs.fwd[0]
            th = theory(name, p, m, v, f, costs.bwd[0] - costs.bwd_w[0], costs.bwd_w[0])  # type: ignore[index]
            mem = max(r1.peak_activation_bytes_per_rank or [0.0]) / 2**30
            rows.append(
                f"| {p} | {m} | {name} | {v} | {r0.step_time * 1e3:.1f} | {r0.bubble_fraction:.3f} | {th:.3f} "
                f"| {r1.step_time * 1e3:.1f} | {mem:.1f} | {dt:.2f} |"
            )
            assert S == p * v
    return "\n".join(rows)


def report(model: GPTLike | None = None) -> str:
    model = model or GPTLike()
    configs = [(4, 8), (4, 32), (8, 16), (8, 32)]
    head = f"""`.venv/bin/python benchmarks/schedules.py --write docs/benchmarks.md` (written by the script).

A GPT-like pipeline with exactly equal stages, where the textbook formulas hold: {model.layers} equal transformer
blocks (hidden {model.hidden}, {model.heads} heads, sequence {model.seq}, one sequence per
microbatch, bf16) split evenly over the stages; per block f = {model.layer_fwd_s * 1e3:.2f} ms
forward at {model.flops_per_s / 1e12:.0f} TFLOP/s, b = 2f backward of which W = b/2 is the weight
gradient (so F = B = W for ZB-H1). Each cut sends {model.boundary_bytes / 2**20:.0f} MiB per
microbatch over a {model.link_bytes_per_s / 1e9:.0f} GB/s link ({model.link_latency_s * 1e6:.0f} µs latency).
Interleaved runs v virtual stages per rank (v·p stages of {model.layers}/(v·p) blocks).

- *bubble (sim)*: idle share of ranks × step time with free communication; *bubble (theory)*:
  (p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(v·m+p−1) for interleaved (Megatron's
  (p−1)/(v·m) of the ideal time, as a share of the step), (p−1)(F+B−W) / step for ZB-H1
  (about a third of 1F1B's bubble time when F = B = W).
- *step with comm*: the same schedule with the link times (asynchronous transfers, see
  docs/schedules.md).
- *peak activations*: the most activation memory any rank stashes (microbatches in flight ×
  {model.layer_act_bytes / 2**20:.0f} MiB per block, Korthikanti et al. 2022, no recomputation).
- *sim time*: wall time of one `simulate` call (timeline off, best of 5) on a shared 2-core CPU.
"""
    return head + "\n" + table(model, configs) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", type=Path, help="also replace this benchmark's section of a markdown file")
    args = ap.parse_args(argv)
    text = report()
    print(f"{SECTION}\n\n{text}")
    if args.write:
        write_section(args.write, SECTION, text)


if __name__ == "__main__":
    main()
