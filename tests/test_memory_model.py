"""The optimizer step's workspace in the memory model: measured, counted by the plan, enforced by the solvers."""

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smp
from partitioner.cost import evaluate
from partitioner.errors import MemoryLimitError
from partitioner.problem import DEFAULT_STATE_FACTOR, DEFAULT_WORKSPACE_FACTOR
from partitioner.solve import solve
from partitioner.synthetic import brute_force
from runtime.memory import AllocationMeter, OptimizerStepMeter
from smp.models import build


class _Wide(nn.Module):
    """Parameters far larger than one small batch's activations: the optimizer step is the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _steady_step(optimizer: torch.optim.Optimizer, model: nn.Module, meter: OptimizerStepMeter) -> None:
    for _ in range(2):  # the first step creates the state; the second shows the workspace alone
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
    assert meter.steps == 2


def test_adamw_foreach_allocates_one_copy_of_the_parameters_per_step() -> None:
    """DEFAULT_WORKSPACE_FACTOR is what AdamW's foreach step (torch's default on GPUs) is measured to need."""
    torch.manual_seed(0)
    model = _Wide()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    meter = OptimizerStepMeter(optimizer)
    _steady_step(optimizer, model, meter)
    meter.close()
    # One step-count scalar per parameter is all the step makes besides the workspace.
    scalars = 64 * len(list(model.parameters()))
    assert DEFAULT_WORKSPACE_FACTOR * _param_bytes(model) <= meter.peak <= DEFAULT_WORKSPACE_FACTOR * _param_bytes(model) + scalars


def test_the_per_parameter_loop_needs_two_copies_of_the_largest_parameter() -> None:
    """What docs/runtime.md says of torch's CPU default (foreach=False): the plan's factor covers it only when
    no single tensor holds more than half a stage's parameters."""
    torch.manual_seed(0)
    model = _Wide()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    meter = OptimizerStepMeter(optimizer)
    _steady_step(optimizer, model, meter)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert meter.peak == pytest.approx(2 * largest, rel=0.01)


def test_allocation_meter_counts_new_storage_not_views_or_in_place_results() -> None:
    x = torch.zeros(1000)
    with AllocationMeter() as meter:
        x.add_(1)  # in place
        view = x.view(10, 100)  # a view
        kept = view * 2  # 4000 new bytes, alive
        del view
        for _ in range(3):
            tmp = x + 1  # 4000 bytes, freed on the next assignment
        del tmp
    assert meter.peak == 4000 * 3 and meter.live == 4000
    del kept


def _heavy_then_light() -> nx.DiGraph:
    """a holds 100 bytes of parameters and keeps 10 bytes of activations per microbatch; b is light."""
    g = nx.DiGraph()
    g.add_node("a", fwd=1.0, bwd=2.0, params=100, out_bytes=10)
    g.add_node("b", fwd=1.0, bwd=2.0, params=1, out_bytes=10)
    g.add_edge("a", "b")
    return g


def test_a_stage_peaks_at_its_state_plus_the_larger_of_activations_and_workspace() -> None:
    part = evaluate(_heavy_then_light(), {"a": 0, "b": 1}, microbatches=4)
    a, b = part.stages
    assert a.workspace == DEFAULT_WORKSPACE_FACTOR * 100 and b.workspace == DEFAULT_WORKSPACE_FACTOR * 1
    # a: 1f1b holds 2 microbatches of 10 bytes, fewer than the step's 100 bytes of workspace.
    assert a.memory == DEFAULT_STATE_FACTOR * 100 + max(2 * 10, DEFAULT_WORKSPACE_FACTOR * 100)
    # b: one microbatch of its own 10 bytes, more than its 1 byte of workspace.
    assert b.memory == DEFAULT_STATE_FACTOR * 1 + 1 * 10
    assert a.state == DEFAULT_STATE_FACTOR * 100 and b.activation_peak == 10
    inference = evaluate(_heavy_then_light(), {"a": 0, "b": 1}, microbatches=4, training=False)
    assert [s.workspace for s in inference.stages] == [0.0, 0.0]


@pytest.mark.parametrize("method", ["dp", "cpsat", "auto"])
def test_solvers_keep_the_optimizer_step_within_the_limit(method: str) -> None:
    """a alone needs 400 bytes of state and 20 of activations, but 500 at the step: a 450-byte limit fits no plan
    (before the workspace was counted the solvers returned one that overflows at the step)."""
    g = _heavy_then_light()
    with pytest.raises(MemoryLimitError) as err:
        solve(g, 2, microbatches=4, memory_limit=450, method=method, recompute="none")
    assert err.value.needed is not None and err.value.needed >= 500
    part = solve(g, 2, microbatches=4, memory_limit=500, method=method, recompute="none")
    assert part.memory_ok and max(s.memory for s in part.stages) == 500


def test_brute_force_and_the_solvers_agree_when_the_step_decides() -> None:
    """Three ops, one heavy: which stage may hold it is decided by the step's memory, not the activations."""
    g = nx.DiGraph()
    g.add_node("x", fwd=3.0, bwd=6.0, params=1, out_bytes=40)
    g.add_node("w", fwd=1.0, bwd=2.0, params=60, out_bytes=40)
    g.add_node("y", fwd=1.0, bwd=2.0, params=1, out_bytes=40)
    g.add_edges_from([("x", "w"), ("w", "y")])
    limit = 330.0  # w's state 240 + its step 60 = 300 fits; beside x (state 4, step 1) it does not
    oracle = brute_force(g, 2, microbatches=2, memory_limit=limit, recompute="none")
    for method in ("dp", "cpsat"):
        part = solve(g, 2, microbatches=2, memory_limit=limit, method=method, recompute="none")
        assert part.bottleneck == pytest.approx(oracle.bottleneck, rel=1e-9) and part.memory_ok


def test_a_pipeline_step_holds_what_the_plan_predicts_at_the_optimizer_step() -> None:
    """One process, two stages: the metered AdamW step allocates the workspace the plan counts."""
    torch.manual_seed(0)
    model, x, y = _Wide(), torch.randn(4, 64), torch.randn(4, 8)
    plan = smp.plan(model, (x,), stages=2, microbatches=2, timing="analytic")
    pipe = smp.partition(model, plan=plan, loss_fn=F.mse_loss)
    optimizer = torch.optim.AdamW(pipe.parameters(), foreach=True)
    meter = OptimizerStepMeter(optimizer)
    for _ in range(2):
        pipe.step(x, target=y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    predicted = sum(s.workspace for s in plan.partition.stages)
    scalars = 64 * len(list(pipe.parameters()))
    assert predicted <= meter.peak <= predicted + scalars
    stats = pipe.memory_stats(optimizer, step_meter=meter)
    for rank, held in stats.items():
        assert held["optimizer_step_peak"] == meter.peak  # one optimizer over every rank in this process
        state = held["params"] + held["grads"] + held["optimizer"] + held["buffers"]
        assert held["total"] == state + max(held["activations_peak"], meter.peak)


@pytest.mark.xfail(strict=True, reason="known gap (2026-11-28): with the per-op dispatch pricing the planner cuts this GPT "
                   "between block 1's q/k/v views and its attention, and the last rank then holds 16,388 bytes (one "
                   "bf16 q/k/v tensor of a microbatch, and the loss's scalar) more than the plan counts")
def test_a_bf16_pipeline_holds_the_activations_the_plan_predicts_on_every_rank() -> None:
    """Under bf16 autocast the loss keeps the logits in fp32; the plan counted them at the bf16 width the model
    returns them in, one bf16 copy of the logits short on the last rank (+10% there for a 32k-vocabulary GPT
    on an H200, benchmarks/results/gpu-h200-1.log)."""
    b = build("gpt:layers=2,d_model=64,heads=4,seq_len=64,vocab=4096,batch=8", seed=0)
    pipe = smp.partition(b.model, stages=2, microbatches=4, loss_fn=b.loss_fn, precision="bf16",
                         timing="analytic")
    pipe.step(*b.example_args, target=b.target)
    predicted = pipe.plan.simulated.peak_activation_bytes_per_rank
    for rank, held in pipe.memory_stats().items():
        # a few bytes apart at most: the loss's scalar, which the plan does not count
        assert abs(held["activations_peak"] - predicted[rank]) <= 16, (rank, held["activations_peak"], predicted[rank])
