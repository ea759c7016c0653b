"""Timelines of pipeline steps (predicted or measured) and their picture: render_timeline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TimelineEvent", "Timeline", "render_timeline", "KIND_COLORS", "COLLECTIVE_COLORS"]

#: Bar colours by action kind (others, e.g. measured "wait"/"SEND_F", are grey).
KIND_COLORS: dict[str, str] = {
    "F": "#4C72B0",  # blue
    "B": "#DD8452",  # orange (full backward, or input gradient when split)
    "W": "#55A868",  # green (weight gradient)
    "R": "#C44E52",  # red (forward recomputed at the start of a B: activation recomputation)
}
#: Collectives a rank runs beside its compute (drawn as thin bars under the rank's row).
COLLECTIVE_COLORS: dict[str, str] = {
    "AR": "#8172B3",  # purple: gradient all-reduce over replicas
    "RS": "#937860",  # brown: gradient reduce-scatter (sharded)
    "AG": "#DA8BC3",  # pink: parameter all-gather (sharded)
}
_OTHER_COLOR = "#9E9E9E"


@dataclass(frozen=True)
class TimelineEvent:
    """One action on one rank: ``kind`` is 'F', 'B', 'W', 'R' (the recomputation that opens a B), or
    anything a runtime records."""

    rank: int
    stage: int
    kind: str
    mb: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "stage": self.stage, "kind": self.kind, "mb": self.mb,
                "start": self.start, "end": self.end}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> TimelineEvent:
        return TimelineEvent(int(d["rank"]), int(d["stage"]), str(d["kind"]), int(d["mb"]),
                             float(d["start"]), float(d["end"]))


@dataclass
class Timeline:
    """What ran where and when during one training step (seconds).

    ``step_time`` is the step's length (end of the last action when predicted; the
    measured wall time when measured). ``label`` names the panel ("predicted",
    "measured", a schedule name). ``num_ranks`` defaults to 1 + the largest rank seen.
    """

    events: list[TimelineEvent]
    step_time: float
    label: str = ""
    num_ranks: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_ranks is None:
            self.num_ranks = 1 + max((e.rank for e in self.events), default=0)

    def busy_time(self, rank: int) -> float:
        """Sum of compute (F/B/W/R) time on ``rank``."""
        return sum(e.duration for e in self.events if e.rank == rank and e.kind in KIND_COLORS)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of ranks x step_time (only F/B/W/R count as busy)."""
        total = (self.num_ranks or 1) * self.step_time
        if total <= 0:
            return 0.0
        busy = sum(e.duration for e in self.events if e.kind in KIND_COLORS)
        return max(0.0, 1.0 - busy / total)

    def normalized(self) -> Timeline:
        """The same timeline with its earliest start at t = 0 (for measured clocks)."""
        t0 = min((e.start for e in self.events), default=0.0)
        ev = [TimelineEvent(e.rank, e.stage, e.kind, e.mb, e.start - t0, e.end - t0) for e in self.events]
        return Timeline(ev, self.step_time, self.label, self.num_ranks, dict(self.meta))

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "step_time": self.step_time, "num_ranks": self.num_ranks,
                "events": [e.to_dict() for e in self.events], "meta": dict(self.meta)}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Timeline:
        return Timeline([TimelineEvent.from_dict(e) for e in d["events"]], float(d["step_time"]),
                        str(d.get("label", "")), d.get("num_ranks"), dict(d.get("meta", {})))


def _unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1.0:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _lighten(hex_color: str, amount: float) -> tuple[float, float, float]:
    h = hex_color.lstrip("#")
    rgb = [int(h[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    return tuple(c + (1 - c) * amount for c in rgb)  # type: ignore[return-value]


def render_timeline(timelines: Timeline | Sequence[Timeline], path: str | Path, *,
                    title: str | None = None, show_mb: bool = True, width: float = 12.0) -> Path:
    """Draw one or more timelines to ``path`` (.png or .svg, by suffix) and return it.

    One row per rank (rank 0 on top), bars coloured by kind (F blue, B orange, W
    green, R red: the forward recomputed before a B, anything else grey), microbatch numbers on the bars, idle time left blank
    (the bubbles). With virtual stages (several stages per rank) later chunks are
    drawn lighter and labelled ``stage.mb``. Several timelines are stacked as
    panels sharing the time axis, e.g. predicted above measured; each panel's title
    gives its label and step time.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # duck-typed, so that Timelines from `python -m partitioner.timeline` (a second copy
    # of this module, __main__) are accepted too
    tls = [timelines] if hasattr(timelines, "events") else list(timelines)  # type: ignore[list-item]
    if not tls:
        raise ValueError("render_timeline needs at least one Timeline")
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"render_timeline writes .png or .svg, got {path.name!r}")
    t_max = max(max([tl.step_time] + [e.end for e in tl.events]) for tl in tls)
    scale, unit = _unit(t_max if t_max > 0 else 1.0)
    heights = [max(1, tl.num_ranks or 1) for tl in tls]
    fig_h = sum(0.45 * h + 0.8 for h in heights) + 0.8 + (0.3 if title else 0)
    fig, axes = plt.subplots(len(tls), 1, sharex=True, figsize=(width, fig_h),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    kinds_seen: set[str] = set()
    for ax, tl in zip(axes[:, 0], tls):
        R = tl.num_ranks or 1
        stages_per_rank: dict[int, set[int]] = {}
        for e in tl.events:
            stages_per_rank.setdefault(e.rank, set()).add(e.stage)
        multi = any(len(v) > 1 for v in stages_per_rank.values())
        min_w = t_max * scale / 90  # narrower bars get no text
        for e in tl.events:
            kinds_seen.add(e.kind)
            if e.kind in COLLECTIVE_COLORS:  # beside the compute, not on it: a thin bar under the row
                ax.broken_barh([(e.start * scale, (e.end - e.start) * scale)], (e.rank + 0.3, 0.15),
                               facecolors=COLLECTIVE_COLORS[e.kind], edgecolors="none")
                continue
            base = KIND_COLORS.get(e.kind, _OTHER_COLOR)
            chunk = sorted(stages_per_rank[e.rank]).index(e.stage) if multi else 0
            color = _lighten(base, min(0.6, 0.35 * chunk))
            x0, w = e.start * scale, (e.end - e.start) * scale
            ax.broken_barh([(x0, w)], (e.rank - 0.4, 0.8), facecolors=color, edgecolors="white",
                           linewidth=0.6)
            if show_mb and w >= min_w:
                text = f"{e.stage}.{e.mb}" if multi else str(e.mb)
                ax.text(x0 + w / 2, e.rank, text, ha="center", va="center", fontsize=7 if not multi else 6,
                        color="white" if chunk == 0 else "black", clip_on=True)
        ax.set_ylim(R - 0.5, -0.5)
        ax.set_yticks(range(R))
        ax.set_yticklabels([f"rank {r}" for r in range(R)])
        ax.axvline(tl.step_time * scale, color="black", linestyle="--", linewidth=0.8)
        head = f"{tl.label}: " if tl.label else ""
        bub = tl.bubble_fraction
        ax.set_title(f"{head}step time {tl.step_time * scale:.4g} {unit}, bubble {bub:.1%}", fontsize=10)
        ax.set_xlim(0, t_max * scale * 1.01)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    order = [k for k in ("F", "R", "B", "W", "AR", "AG", "RS") if k in kinds_seen] + sorted(
        kinds_seen - set(KIND_COLORS) - set(COLLECTIVE_COLORS))
    names = {"F": "F forward", "R": "R recomputed forward", "B": "B backward (input grad when W is split off)",
             "W": "W weight grad", "AR": "gradient all-reduce (over replicas, beside compute)",
             "AG": "parameter all-gather (sharded)", "RS": "gradient reduce-scatter (sharded)"}
    colors = {**KIND_COLORS, **COLLECTIVE_COLORS}
    handles = [Patch(color=colors.get(k, _OTHER_COLOR), label=names.get(k, k)) for k in order]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0.35 / fig_h, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
