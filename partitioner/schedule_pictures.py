"""Pictures of every schedule for the docs: ``python -m partitioner.schedule_pictures --demo``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from partitioner.schedule import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from partitioner.simulate import StageCosts, simulate
from partitioner.timeline import render_timeline

__all__ = ["draw_every_schedule", "main"]


def draw_every_schedule(out_dir: Path, p: int = 4, m: int = 8) -> list[Path]:
    """Pictures of every schedule for p stages x m microbatches (F=1, B=2, W=1 units, free comm)."""

    def costs(S: int, split: bool, scale: float = 1.0) -> StageCosts:
        f = 1e-3 * scale  # 1 ms forward, 2 ms backward (W: half of it) per rank
        return StageCosts([f] * S, [2 * f] * S, [f if split else 0.0] * S)

    runs = [gpipe(p, m), one_f_one_b(p, m), interleaved_1f1b(2 * p, m, p), zb_h1(p, m)]
    paths = []
    tls = []
    for sch in runs:
        c = costs(sch.num_stages, sch.split_backward, p / sch.num_stages)
        tl = simulate(sch, c).timeline
        name = tl.label = sch.name
        tls.append(tl)
        # file names older than the ScheduleKind table, which docs/schedules.md links to
        file = {"interleaved": "interleaved_1f1b", "zb-h1": "zb_h1"}.get(name, name)
        paths.append(render_timeline(tl, out_dir / f"schedule_{file}.png",
                                     title=f"{name}: {p} ranks x {m} microbatches, F = 1 ms, B = 2 ms per rank"
                                     + (" (B 1 ms + W 1 ms)" if sch.split_backward else "")))
    paths.append(render_timeline(tls, out_dir / "schedule_all.png",
                                 title=f"All schedules, {p} ranks x {m} microbatches, same total work"))
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m partitioner.schedule_pictures", description=__doc__)
    ap.add_argument("--demo", action="store_true", help="draw every schedule for 4 stages x 8 microbatches")
    ap.add_argument("--out", default="docs/img", help="output folder (default docs/img)")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args(argv)
    if not args.demo:
        ap.error("nothing to do: pass --demo")
    for p in draw_every_schedule(Path(args.out), args.stages, args.microbatches):
        print(p)


if __name__ == "__main__":
    main()
