"""GPU time of one op's kernels alone, without the CPU's time to launch them.

Timing a small op with CUDA events around its call on an idle GPU measures the launch as
well: the start event fires at once, the GPU then waits for the CPU to dispatch the op
(Python, the dispatcher, autograd: 10-50 µs) and only then runs its kernels. In a step the
CPU runs ahead and the GPU finds the kernels queued, so that wait is not part of it.
Measured that way on an H200, the per-op sums of GPT-2 base came to 2.0x (forward) and 2.7x
(backward) the whole model's time (benchmarks/results/gpu-h200-1.log).

So a GPU-side busy wait (``torch.cuda._sleep``) is queued before the start event, long
enough for the CPU to queue the op's kernels and the end event behind it; the events then
bracket the kernels back to back. What this does not see: where dispatching a run of small
ops takes the CPU longer than their kernels take the GPU, a step runs at the CPU's pace
(docs/benchmarks.md, "On a GPU").

Each call site's wait grows when its launch takes more than half of it; the profiler's
warm-up sweeps, whose times it drops, size it for the timed sweeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["GpuTimer"]

#: The GPU-side wait queued before a call site's first timed call (seconds).
FIRST_COVER = 100e-6
#: The longest wait. A call that launches for longer, or that waits for the GPU itself (a ``.item()``,
#: a data-dependent shape), is timed behind this wait and may count some of its launch.
MAX_COVER = 0.005


class GpuTimer:
    """Times callables by their kernels' GPU time on ``device``'s current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cover: dict[Hashable, float] = {}  # per call site: seconds of GPU wait queued before it
        self._hz: float | None = None

    def _cycles_per_second(self) -> float:
        """The rate ``torch.cuda._sleep`` counts at, measured once (it spins on the SM clock)."""
        if self._hz is None:
            with torch.cuda.device(self.device):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                best = float("inf")
                for _ in range(3):  # the first wakes the clocks up
                    start.record()
                    torch.cuda._sleep(1_000_000)
                    end.record()
                    end.synchronize()
                    best = min(best, start.elapsed_time(end) / 1e3)
            self._hz = 1_000_000 / best
        return self._hz

    def __call__(self, fn: Callable[[], Any], key: Hashable = None) -> float:
        """Seconds from fn's first kernel starting to its last finishing, its launch hidden behind a GPU wait.

        ``fn`` runs once (a backward can run only once). ``key`` names the call site: a launch
        longer than half its wait makes the wait four times that launch for the site's next
        calls (the profiler's warm-up sweeps, whose times it drops, size it for the timed
        ones), up to ``MAX_COVER``. One wait for every site would grow to the slowest
        site's and made profiling GPT-2 base 12x slower (55 s, against 4.5 s per site).
        """
        hz = self._cycles_per_second()
        cover = self.cover.get(key, FIRST_COVER)
        with torch.cuda.device(self.device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(cover * hz))
            begin = time.perf_counter()
            start.record()
            fn()
            end.record()
            launch = time.perf_counter() - begin
            end.synchronize()
        if 2 * launch > cover:
            self.cover[key] = min(4 * launch, MAX_COVER)
        return start.elapsed_time(end) / 1e3
