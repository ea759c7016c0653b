"""Tests for the Timeline type and render_timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner.schedule import interleaved_1f1b, zb_h1
from partitioner.simulate import StageCosts, simulate
from partitioner.schedule_pictures import main
from partitioner.timeline import Timeline, TimelineEvent, render_timeline


def predicted() -> Timeline:
    return simulate(zb_h1(3, 4), StageCosts([1e-3] * 3, [2e-3] * 3, [1e-3] * 3)).timeline  # type: ignore[return-value]


def test_timeline_roundtrip_and_bubble() -> None:
    ev = [TimelineEvent(0, 0, "F", 0, 0.0, 1.0), TimelineEvent(1, 1, "F", 0, 1.0, 2.0),
          TimelineEvent(1, 1, "wait", 0, 0.0, 1.0)]
    tl = Timeline(ev, 2.0, "measured")
    assert tl.num_ranks == 2
    assert tl.bubble_fraction == pytest.approx(0.5)  # "wait" is not compute
    assert tl.busy_time(1) == pytest.approx(1.0)
    back = Timeline.from_dict(json.loads(json.dumps(tl.to_dict())))
    assert back.events == tl.events and back.label == "measured" and back.step_time == 2.0
    shifted = Timeline([TimelineEvent(0, 0, "F", 0, 10.0, 11.0)], 1.0).normalized()
    assert shifted.events[0].start == 0.0


def test_render_png_single(tmp_path: Path) -> None:
    out = render_timeline(predicted(), tmp_path / "zb.png", title="ZB-H1")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_svg_side_by_side(tmp_path: Path) -> None:
    pred = predicted()
    # a "measured" timeline: slower, offset clock, with extra kinds the runtime may record
    meas_events = [TimelineEvent(e.rank, e.stage, e.kind, e.mb, 5 + e.start * 1.2, 5 + e.end * 1.2)
                   for e in pred.events]
    meas_events.append(TimelineEvent(0, 0, "RECV_B", 0, 5.0, 5.001))
    meas = Timeline(meas_events, pred.step_time * 1.2, "measured").normalized()
    out = render_timeline([pred, meas], tmp_path / "cmp.svg")
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text


def test_render_interleaved_labels(tmp_path: Path) -> None:
    tl = simulate(interleaved_1f1b(4, 4, 2), StageCosts([1.0] * 4, [2.0] * 4)).timeline
    render_timeline(tl, tmp_path / "i.png")  # type: ignore[arg-type]
    assert (tmp_path / "i.png").stat().st_size > 1000


def test_render_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=".png or .svg"):
        render_timeline(predicted(), tmp_path / "x.jpg")
    with pytest.raises(ValueError, match="at least one"):
        render_timeline([], tmp_path / "x.png")


def test_demo_command(tmp_path: Path) -> None:
    main(["--demo", "--out", str(tmp_path), "--stages", "2", "--microbatches", "2"])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["schedule_1f1b.png", "schedule_all.png", "schedule_gpipe.png",
                     "schedule_interleaved_1f1b.png", "schedule_zb_h1.png"]
