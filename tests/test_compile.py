"""Compiled stages (compile=True): priced without per-op dispatch, run through torch.compile, gradients as eager.

The mechanics run on the "aot_eager" backend (AOTAutograd's forward and backward graphs run by
eager kernels: seconds to compile, no C++ compiler); one slow test compiles with inductor.
Losses, gradients and parameters are compared with the unpartitioned eager model within fp32
rounding (rtol 1e-5, atol 1e-6: tests/_runtime_common.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import smp
from partitioner.devices import DeviceSpec
from partitioner.errors import PlanError
from partitioner.ir import ScheduleKind
from partitioner.request import PlanRequest
from runtime.errors import RuntimeConfigError
from smp.models import build

from _launch import launch
from _runtime_common import (ATOL, RTOL, check_against_reference, make_plan, pipeline_run, reference_run)

GPT = "gpt:size=tiny,batch=4"
MECHANICS = "aot_eager"
HERE = Path(__file__).resolve().parent


def _graph(plan: smp.Plan) -> dict[str, tuple[float, float]]:
    return {n: (d["fwd"], d["bwd"]) for n, d in plan.graph.nx.nodes(data=True)}


def test_a_compiled_plan_prices_each_op_without_the_dispatch() -> None:
    eager = make_plan(GPT, 2, 4, "1f1b")
    compiled = make_plan(GPT, 2, 4, "1f1b", compile=True)
    spec = DeviceSpec.from_profile("cpu")
    assert spec.dispatch_fwd > 0 and spec.dispatch_bwd > 0
    assert (spec.compiled().dispatch_fwd, spec.compiled().dispatch_bwd) == (0.0, 0.0)
    assert compiled.model.compiled and not eager.model.compiled
    assert compiled.graph.meta["compiled"] is True
    # a CPU runs kernels synchronously: an eager op costs its kernels plus the dispatch, a compiled one its kernels
    priced = 0
    for name, (fwd, bwd) in _graph(eager).items():
        cfwd, cbwd = _graph(compiled)[name]
        if fwd == 0:  # not an op that runs (the graph's output)
            assert cfwd == 0, name
            continue
        if name.startswith(("size", "getitem")):  # a shape read or a tuple's item dispatches no aten op
            assert (fwd, bwd) == (cfwd, cbwd), name
            continue
        priced += 1
        assert fwd == pytest.approx(cfwd + spec.dispatch_fwd, rel=1e-9) or fwd == cfwd, name  # fwd == cfwd: a buffer read
        if bwd > 0:
            assert bwd == pytest.approx(cbwd + spec.dispatch_bwd, rel=1e-9), name
    assert priced > 10
    assert compiled.step_time < eager.step_time
    # the plan says so, and a plan loaded back still runs compiled
    assert smp.Plan.from_dict(compiled.to_dict()).model.compiled


def test_what_compiled_stages_cannot_run_is_refused_before_any_work() -> None:
    with pytest.raises(PlanError, match="selective recomputation replays"):
        PlanRequest.build(compile=True, recompute="selective")
    with pytest.raises(PlanError, match="compile=True runs unsharded stages"):
        PlanRequest.build(compile=True, sharding="shard_grad_op")
    with pytest.raises(PlanError, match="cannot be split into B and W: schedule 'zb-h1'"):
        PlanRequest.build(compile=True, schedule="zb-h1")
    with pytest.raises(PlanError, match="compile takes True or False"):
        PlanRequest.build(compile="yes")
    # a schedule search weighs only the kinds a compiled stage runs
    search = PlanRequest.build(compile=True, schedule="auto", stages=2)
    assert search.schedules and not any(ScheduleKind.parse(k).split_backward for k in search.schedules)
    assert "zb-h1" in PlanRequest.build(schedule="auto", stages=2).schedules


def test_a_made_plan_decides_whether_the_stages_compile() -> None:
    b = build(GPT, seed=0)
    eager = make_plan(GPT, 2, 4, "1f1b")
    with pytest.raises(RuntimeConfigError, match="compile=True disagrees with the plan's False"):
        smp.partition(b.model, plan=eager, compile=True)
    # a compiled plan under a schedule that splits the backward is refused when the engine is built
    compiled = make_plan(GPT, 2, 4, "1f1b", compile=True)
    pipe = smp.partition(b.model, plan=compiled.resimulate(schedule="zb-h1"), loss_fn=b.loss_fn,
                         compile_backend=MECHANICS)
    with pytest.raises(RuntimeConfigError, match="cannot be split into B and W"):
        pipe.step(*b.example_args, target=b.target, **b.example_kwargs)


@pytest.mark.slow
def test_compiled_stages_in_one_process_train_as_the_eager_model() -> None:
    plan = make_plan(GPT, 2, 4, "1f1b", compile=True)
    b = build(GPT, seed=0)
    pipe = smp.partition(b.model, plan=plan, loss_fn=b.loss_fn, compile_backend=MECHANICS)  # compile: the plan's
    got = pipeline_run(pipe, GPT, 2)
    assert set(pipe._engine.compiled) == {0, 1}  # every stage ran compiled
    check_against_reference([got], reference_run(GPT, plan.microbatches, 2), "compiled gpt 1f1b")
    with torch.no_grad():  # the forward-only engine compiles its own stages
        out = pipe(*b.example_args, **b.example_kwargs)
    ref = build(GPT, seed=0).model
    ref.load_state_dict(pipe.state_dict())
    torch.testing.assert_close(out, ref(*b.example_args, **b.example_kwargs), rtol=RTOL, atol=ATOL)
    assert pipe._engine.compiled


@pytest.mark.slow
def test_a_full_rerun_of_a_compiled_stage_draws_its_forward_masks_and_a_selective_stage_runs_eagerly() -> None:
    """Dropout in a compiled graph draws other numbers than eager dropout (AOTAutograd decomposes it), so the
    rerun is checked against the compiled stage without recomputation: same masks, same gradients."""
    spec = "gpt:size=tiny,batch=4,dropout=0.1"
    plan = make_plan(spec, 2, 2, "1f1b", recompute="none", compile=True)
    grads = {}
    for first in ("none", "full"):
        b = build(spec, seed=0)
        torch.manual_seed(7)
        pipe = smp.partition(b.model, plan=plan.resimulate(recompute=[first, "selective"]), loss_fn=b.loss_fn,
                             compile_backend=MECHANICS)
        grads[first] = pipeline_run(pipe, spec, 1)["grads"]
        assert set(pipe._engine.compiled) == {0}  # the selective stage 1 ran eagerly
    assert "R" in {e.kind for e in pipe.timeline().events if e.stage == 0}
    assert grads["full"].keys() == grads["none"].keys()
    for name, g in grads["none"].items():
        assert torch.allclose(grads["full"][name], g, rtol=RTOL, atol=ATOL), name


@pytest.mark.slow
def test_an_export_traced_model_planned_lazily_runs_compiled() -> None:
    b = build(GPT, seed=0)
    pipe = smp.partition(b.model, stages=2, microbatches=2, loss_fn=b.loss_fn, frontend="export",
                         timing="analytic", compile=True, compile_backend=MECHANICS)
    got = pipeline_run(pipe, GPT, 2)
    assert pipe.plan.model.compiled and pipe.plan.model.frontend == "export" and pipe._engine.compiled
    check_against_reference([got], reference_run(GPT, 2, 2), "compiled export gpt")


@pytest.mark.slow
def test_compiled_stages_on_two_gloo_ranks_train_as_the_eager_model(tmp_path: Path) -> None:
    plan = make_plan(GPT, 2, 4, "1f1b", compile=True)
    results = launch(f"{HERE / '_runtime_common.py'}:train_worker", 2,
                     {"spec": GPT, "plans": {"compiled": plan.to_dict()}, "out": str(tmp_path), "steps": 3,
                      "options": {"compile_backend": MECHANICS}}, timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.stderr[-4000:]}"
    ranks = [torch.load(tmp_path / f"compiled-{r}.pt", weights_only=False) for r in range(2)]
    check_against_reference(ranks, reference_run(GPT, plan.microbatches, 3), "compiled gpt x2")


@pytest.mark.slow
def test_inductor_compiled_stages_train_as_the_eager_model() -> None:
    """Inductor fuses and reorders float arithmetic: equal within fp32 rounding (rtol 1e-5), not bit for bit."""
    plan = make_plan(GPT, 2, 2, "1f1b", compile=True)
    b = build(GPT, seed=0)
    pipe = smp.partition(b.model, plan=plan, loss_fn=b.loss_fn)  # the default backend: inductor
    got = pipeline_run(pipe, GPT, 2)
    assert set(pipe._engine.compiled) == {0, 1}
    check_against_reference([got], reference_run(GPT, plan.microbatches, 2), "inductor gpt 1f1b")
