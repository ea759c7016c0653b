"""Every plan the planner returns runs: outputs made on any stage, user models, eval-mode modules, the walker's order."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import smp
from partitioner.graph import OUTPUT_OP
from partitioner.ir import Action, Schedule, ScheduleError
from partitioner.microbatch import split_microbatches
from partitioner.simulate import simulate
from partitioner.walk import validate
from runtime.errors import RuntimeConfigError

from _user_models import RandomDag, TwoTowers, dict_mean_loss, two_towers_loss

METHODS = ("dp", "cpsat", "auto", "uniform", "params", "blocks")


def _reference(model: torch.nn.Module, args: tuple, target, loss_fn, m: int) -> tuple[torch.Tensor, dict]:
    """Loss and gradients of the unpartitioned model, microbatch by microbatch (loss / m each)."""
    model.zero_grad()
    targets = [t[0][0] for t in split_microbatches((target,), None, m)] if target is not None else [None] * m
    losses = []
    for (a, k), t in zip(split_microbatches(args, {}, m), targets):
        loss = loss_fn(model(*a, **k), t)
        (loss / m).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return torch.stack(losses).mean(), grads


def _check_runs(model: torch.nn.Module, args: tuple, target, loss_fn, plan: smp.Plan) -> None:
    reference = copy.deepcopy(model)
    want_loss, want_grads = _reference(reference, args, target, loss_fn, plan.microbatches)
    pipe = smp.partition(model, plan=plan, loss_fn=loss_fn)
    loss = pipe.step(*args, target=target)
    assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-6), (loss, want_loss)
    got = {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
    assert got.keys() >= want_grads.keys()
    for name, g in got.items():
        # a dead branch that crosses stages gets its (zero) gradient sent back; autograd leaves it None
        want = want_grads.get(name, torch.zeros_like(g))
        assert torch.allclose(g, want, rtol=1e-5, atol=1e-6), name
    with torch.no_grad():
        out, expected = pipe(*args), reference(*args)
    assert out.keys() == expected.keys()
    for key in out:
        assert torch.allclose(out[key], expected[key], rtol=1e-5, atol=1e-6), key


def _two_towers(batch: int = 8) -> tuple[TwoTowers, tuple, torch.Tensor]:
    torch.manual_seed(0)
    return TwoTowers(), (torch.randn(batch, 16), torch.randn(batch, 16)), torch.randn(batch)


@pytest.mark.parametrize("method", METHODS)
def test_an_output_made_on_the_first_stage_reaches_the_output_stage(method: str) -> None:
    model, args, target = _two_towers()
    plan = smp.plan(model, args, stages=3, microbatches=2, timing="analytic", method=method)
    part = plan.partition
    out_stage = part.stage_of["output"]
    assert out_stage == plan.num_stages - 1
    # emb_a is made by the first op; wherever it lands, the plan moves it to the output stage and prices it
    src = part.stage_of["embed_a"]
    if src != out_stage:
        moved = [t for t in part.transfers if t.node == "embed_a" and t.dst_stage == out_stage]
        assert moved and moved[0].seconds >= 0 and part.stages[src].comm_out_bytes >= moved[0].bytes
        assert any(e.key == (src, out_stage, "embed_a") for e in plan.schedule.graph.edges)
    _check_runs(model, args, target, two_towers_loss, plan)


def test_the_output_never_makes_a_stage_of_its_own() -> None:
    model, args, _ = _two_towers()
    for method in METHODS:
        plan = smp.plan(model, args, stages=6, microbatches=2, timing="analytic", method=method)
        out_stage = plan.partition.stage_of["output"]
        ops_there = [n for n, s in plan.partition.stage_of.items() if s == out_stage and plan.graph[n]["op"] != OUTPUT_OP]
        assert ops_there, method


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), stages=st.integers(2, 3), method=st.sampled_from(METHODS))
def test_every_plan_of_a_random_dag_with_several_outputs_runs(seed: int, stages: int, method: str) -> None:
    torch.manual_seed(seed)
    model = RandomDag(seed, nodes=9)
    x = torch.randn(4, model.width)
    plan = smp.plan(model, (x,), stages=stages, microbatches=2, timing="analytic", method=method)
    _check_runs(model, (x,), None, dict_mean_loss, plan)


def test_a_module_in_eval_mode_is_planned_for_training() -> None:
    model, args, target = _two_towers()
    model.eval()
    pipe = smp.partition(model, stages=2, microbatches=2, loss_fn=two_towers_loss,
                         timing="analytic")
    pipe.step(*args, target=target)
    plan = pipe.plan
    assert plan.partition.training and plan.model.training
    assert all(s.bwd > 0 for s in plan.partition.stages)  # an inference plan prices no backward
    assert not model.training  # planning left the module as the user set it


def test_the_loss_is_float32_for_a_bf16_model() -> None:
    model, args, target = _two_towers()
    model = model.to(torch.bfloat16)
    args = tuple(a.to(torch.bfloat16) for a in args)
    pipe = smp.partition(model, stages=2, microbatches=2, loss_fn=two_towers_loss,
                         timing="analytic")
    assert pipe.step(*args, target=target.to(torch.bfloat16)).dtype == torch.float32


# ---------------------------------------------------------------------- one walker


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_the_runtime_executes_exactly_the_simulated_order(schedule: str) -> None:
    model, args, target = _two_towers()
    plan = smp.plan(model, args, stages=2, microbatches=4, timing="analytic", schedule=schedule)
    pipe = smp.partition(model, plan=plan, loss_fn=two_towers_loss)
    pipe.step(*args, target=target)
    executed = pipe._engine.executed
    predicted = simulate(plan.schedule, _unit_costs(plan)).timeline
    for r in range(plan.pipeline_ranks):
        # every action of the rank's list, transfers included, in the list's order
        assert executed[r] == list(plan.schedule.actions[r])
        # and the simulator times the same compute actions in the same order
        sim_order = [(e.kind, e.stage, e.mb) for e in sorted(predicted.events, key=lambda e: e.start)
                     if e.rank == r]
        run_order = [(a.kind.value, a.stage, a.mb) for a in executed[r] if a.is_compute]
        assert sim_order == run_order


def _unit_costs(plan: smp.Plan):
    from partitioner.simulate import StageCosts

    n = plan.num_stages
    split = plan.schedule.split_backward
    return StageCosts([1.0] * n, [2.0] * n, [1.0 if split else 0.0] * n)


def test_a_broken_action_list_is_refused_by_validator_and_runtime_alike() -> None:
    model, args, target = _two_towers()
    plan = smp.plan(model, args, stages=2, microbatches=2, timing="analytic")
    actions = [list(p) for p in plan.schedule.actions]
    # rank 1 computes its first forward before receiving its input
    recv = next(i for i, a in enumerate(actions[1]) if a.kind.value == "RECV_F")
    f = next(i for i, a in enumerate(actions[1]) if a.kind.value == "F")
    actions[1][recv], actions[1][f] = actions[1][f], actions[1][recv]
    broken = Schedule(plan.schedule.name, plan.schedule.graph, plan.microbatches, plan.schedule.stage_to_rank,
                      tuple(tuple(p) for p in actions), plan.schedule.split_backward)
    with pytest.raises(ScheduleError) as refused:
        validate(broken)
    plan.schedule = broken
    pipe = smp.partition(model, plan=plan, loss_fn=two_towers_loss)
    with pytest.raises(RuntimeConfigError) as runtime:
        pipe.step(*args, target=target)
    assert str(refused.value) in str(runtime.value)
    assert "before it is available" in str(refused.value)
    assert isinstance(actions[1][recv], Action)
