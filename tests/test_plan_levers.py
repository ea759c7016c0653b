"""The memory and precision levers through the public API and the CLI: recomputation, microbatches and schedule."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import smp
from partitioner.errors import MemoryLimitError
from smp.cli import app
from smp.models import build_step
from smp.plan import plan_from_graph

runner = CliRunner()
GPT = "gpt:layers=4,d_model=1024,heads=16,vocab=1024,seq_len=512"  # big enough that splitting pays on H100
OPTS = dict(cluster="h100-sxm", device_profile="h100-sxm", timing="analytic", method="dp", objective="bottleneck")


@pytest.fixture(scope="module")
def gpt():
    b = build_step(GPT, microbatches=1, batch_size=8, meta=True)
    return b.model, b.example_args, b.example_kwargs


def ok(*args):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, f"smp {' '.join(map(str, args))} failed:\n{res.output}\n{res.exception!r}"
    return res


def test_smp_plan_recompute_forced_and_auto(gpt):
    model, args, kwargs = gpt
    free = smp.plan(model, args, kwargs, stages=2, microbatches=4, **OPTS)
    assert free.recompute == ["none", "none"]
    full = smp.plan(model, args, kwargs, stages=2, microbatches=4, recompute="full", **OPTS)
    assert full.recompute == ["full", "full"]
    for a, b in zip(free.partition.stages, full.partition.stages):  # the same stages would keep less and run longer
        assert b.recompute_time > 0 and b.activations < a.activations
    assert max(full.stage_memory) < max(free.stage_memory)
    # a limit just above full recomputation's: auto recomputes where it must and fits; none is refused,
    # with the least memory that works without it, and that figure works
    limit = max(full.stage_memory) * 1.02
    auto = smp.plan(model, args, kwargs, stages=2, microbatches=4, memory_limit=limit, **OPTS)
    assert auto.partition.memory_ok and any(c != "none" for c in auto.recompute)
    assert max(auto.stage_memory) <= limit
    with pytest.raises(MemoryLimitError) as err:
        smp.plan(model, args, kwargs, stages=2, microbatches=4, memory_limit=limit, recompute="none", **OPTS)
    assert err.value.recompute_fits and err.value.works > limit
    assert "with recomputation it fits" in str(err.value)
    at_least = smp.plan(model, args, kwargs, stages=2, microbatches=4, memory_limit=err.value.works,
                        recompute="none", **OPTS)
    assert at_least.partition.memory_ok and at_least.recompute == ["none", "none"]


def test_microbatches_auto_returns_the_fastest_candidate_that_fits(gpt):
    model, args, kwargs = gpt
    base = smp.plan(model, args, kwargs, stages=2, microbatches=8, schedule="1f1b", recompute="none", **OPTS)
    gpipe8 = smp.plan(model, args, kwargs, stages=2, microbatches=8, schedule="gpipe", recompute="none", **OPTS)
    assert max(gpipe8.stage_memory) > max(base.stage_memory)  # gpipe keeps all 8 microbatches in flight
    limit = max(base.stage_memory) * 1.01
    search = smp.plan_shapes(model, args, kwargs, devices=2, stages=2, microbatches="auto",
                             schedule=["gpipe", "1f1b"], memory_limit=limit, recompute="none", **OPTS)
    got = {(c.shape.microbatches, c.shape.schedule) for c in search.candidates}
    assert got == {(m, s) for m in (2, 4, 8) for s in ("gpipe", "1f1b")}  # from stages up, dividing 8
    by_key = {(c.shape.microbatches, c.shape.schedule): c for c in search.candidates}
    assert not by_key[8, "gpipe"].fits and by_key[8, "gpipe"].plan is None
    assert by_key[8, "gpipe"].memory > limit  # what it would need
    fitting = [c for c in search.candidates if c.fits]
    best = search.candidates[0]
    assert best.fits and best.step_time == min(c.step_time for c in fitting)
    assert search.candidates[:len(fitting)] == sorted(fitting, key=lambda c: c.step_time)
    # each candidate is the plan of its shape on the sample batch's graph scaled to its microbatch
    graph = smp.plan(model, args, kwargs, stages=2, microbatches=1, recompute="none", **OPTS).graph
    again = plan_from_graph(graph.scaled(1 / best.shape.microbatches), stages=2,
                                microbatches=best.shape.microbatches, schedule=best.shape.schedule,
                                cluster="h100-sxm", memory_limit=limit, recompute="none", method="dp",
                                objective="bottleneck")
    assert search.best.step_time == pytest.approx(again.step_time) == pytest.approx(best.step_time)
    assert (search.best.microbatches, search.best.schedule_name) == (best.shape.microbatches, best.shape.schedule)
    one = smp.plan(model, args, kwargs, stages=2, microbatches="auto", schedule=["gpipe", "1f1b"],
                   memory_limit=limit, recompute="none", **OPTS)
    assert one.step_time == pytest.approx(best.step_time)


def test_cli_recompute_column_and_report(tmp_path):
    res = ok("plan", GPT, "--meta", "--stages", 2, "-m", 4, "-b", 8, "--cluster", "h100-sxm", "--method", "dp",
             "--recompute", "full", "-o", tmp_path / "p.json")
    assert "recompute" in res.stdout and "full +" in res.stdout
    assert "recompute            full: stage 0 full" in res.stdout
    data = json.loads(ok("inspect", tmp_path / "p.json", "--json").stdout)
    assert data["recompute"] == ["full", "full"] and data["recompute_mode"] == "full"
    assert all(s["recompute"] == "full" and s["recompute_s"] > 0 for s in data["stages"])
    bad = runner.invoke(app, ["plan", GPT, "--stages", "2", "--recompute", "sometimes"])
    assert bad.exit_code == 2 and "--recompute" in bad.output


def test_cli_microbatches_auto_prints_the_candidates():
    res = ok("plan", GPT, "--meta", "--stages", 2, "-b", 8, "--cluster", "h100-sxm", "--method", "dp",
             "--microbatches", "auto", "--schedule", "auto")
    out = res.stdout
    assert "candidates weighed (12, best first" in out  # 2, 4, 8 microbatches x 4 schedules
    for head in ("microbatches", "schedule", "step time", "samples/s", "bubble", "peak memory", "fits", "proven"):
        assert head in out
    data = json.loads(ok("plan", GPT, "--meta", "--stages", 2, "-b", 8, "--cluster", "h100-sxm", "--method", "dp",
                         "--microbatches", "auto", "--json").stdout)
    cands = data["candidates"]
    assert [c["microbatches"] for c in cands if c["fits"]] and {c["schedule"] for c in cands} == {"1f1b"}
    assert sorted(c["microbatches"] for c in cands) == [2, 4, 8]
    steps = [c["step_time"] for c in cands if c["fits"]]
    assert steps == sorted(steps) and data["microbatches"] == cands[0]["microbatches"]
    assert data["step_time_s"] == pytest.approx(cands[0]["step_time"])
    graph_file = runner.invoke(app, ["plan", "graph.json", "--stages", "2", "--microbatches", "auto"])
    assert graph_file.exit_code == 2 and "need a model spec" in graph_file.output


def test_active_microbatches_prices_the_capped_schedule_and_travels_with_the_plan(gpt, tmp_path):
    """The cap is priced (each stage keeps cap x its activations, the simulator walks the capped programs),
    saved and loaded, kept by resimulate where the schedule takes it, and refused where it does not."""
    model, args, kwargs = gpt
    free = smp.plan(model, args, kwargs, stages=2, microbatches=8, schedule="gpipe", **OPTS)
    capped = free.resimulate(active_microbatches=2)
    assert capped.active_microbatches == 2 and free.active_microbatches is None
    assert [s.in_flight for s in capped.partition.stages] == [2, 1]  # one fewer on each later stage
    for a, b in zip(free.partition.stages, capped.partition.stages):  # the same stages, fewer held
        assert a.in_flight == 8 and a.memory - b.memory == pytest.approx((8 - b.in_flight) * a.activations, rel=1e-9)
    # at most the stage count, capped gpipe is 1f1b's program, and the simulator walks it as such
    assert capped.step_time == pytest.approx(free.resimulate(schedule="1f1b").step_time, rel=1e-12)
    assert free.resimulate(active_microbatches=1).step_time > free.step_time  # one at a time: a longer step
    again = smp.Plan.load(capped.save(tmp_path / "capped.json"))
    assert again.active_microbatches == 2 and again.partition.active_microbatches == 2
    assert again.resimulate(schedule="1f1b").active_microbatches == 2
    assert again.resimulate(schedule="zb-h1").active_microbatches is None  # zb-h1 has its own warm-up
    solved = smp.plan(model, args, kwargs, stages=2, microbatches=8, schedule="gpipe", active_microbatches=2, **OPTS)
    assert solved.active_microbatches == 2 and [s.in_flight for s in solved.partition.stages] == [2, 1]
    with pytest.raises(smp.PlanError, match="zb-h1 fixes its own"):
        smp.plan(model, args, kwargs, stages=2, microbatches=8, schedule="zb-h1", active_microbatches=2, **OPTS)
    cli = ["plan", GPT, "--meta", "--stages", 2, "--microbatches", 8, "--schedule", "gpipe", "--cluster", "h100-sxm"]
    assert "gpipe (at most 2 in flight)" in ok(*cli, "--active-microbatches", 2).stdout
    held = [[s["memory_bytes"] for s in json.loads(ok(*cli, *cap, "--json").stdout)["stages"]]
            for cap in ([], ["--active-microbatches", 2])]
    assert all(c < f for f, c in zip(*held))
