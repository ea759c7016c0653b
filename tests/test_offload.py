"""Activation offloading as a fourth memory lever: priced on the host link as computed by hand, chosen by auto where it
is the fastest that fits, and run exactly (the stash is copied to host memory and back, not changed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

import smp
from partitioner import synthetic
from partitioner.cluster import Cluster, Device, Link
from partitioner.cost import evaluate
from partitioner.errors import MemoryLimitError
from partitioner.plan import Plan
from partitioner.problem import graph_order
from partitioner.recompute import CHOICES
from partitioner.solve import solve
from runtime.offload import offloading
from smp.cli.options import RECOMPUTE_CHOICES
from smp.models import build

from _launch import launch
from _runtime_common import make_plan, pipeline_run
from test_recompute import CUT, ONE_STAGE, OPTS, TWO_STAGES, four_ops, saved_graphs

HERE = Path(__file__).resolve().parent
SPEC = "gpt:size=tiny,batch=4,dropout=0.1"


def host_cluster(stages: int, bandwidth: float, latency: float) -> Cluster:
    """Free links between the stages; each device copies to its host at ``bandwidth`` bytes/s."""
    host = Link("host", bandwidth, latency)
    return Cluster(tuple(Device(f"d{i}", host_link=host) for i in range(stages)),
                   tuple(Link("free") for _ in range(stages - 1)))


# four_ops (test_recompute) on a host link of 1000 B/s and 1 ms: offload keeps what full keeps (the stash leaves
# the device; the copies coming back during one backward are at most none's stash) and costs, per op that saves,
# 2 x (saved / 1000 + 0.001) s, both directions charged to the backward:
#   one stage: saves 100 + 100 + 30 + 20 = 250 bytes in 4 ops -> 2 x (0.25 + 0.004) = 0.508 s;
#              memory 330 (full's), time 8.1 + 0.508 = 8.608
#   {a, b}: saves 200 in 2 ops -> 0.404 s, memory 640, time 4.5 + 0.404 = 4.904
#   {c, d}: saves 50 in 2 ops -> 0.104 s, memory 490, time 3.6 + 0.104 = 3.704
HOST = dict(bandwidth=1000.0, latency=1e-3)
OFFLOAD_ONE = (ONE_STAGE["full"][0], 8.608, 0.508)
OFFLOAD_TWO = ((TWO_STAGES["full"][0][0], 4.904), (TWO_STAGES["full"][1][0], 3.704))


def test_offload_is_priced_on_the_host_link_as_computed_by_hand() -> None:
    one = evaluate(four_ops(), dict.fromkeys("abcd", 0), recompute="offload", cluster=host_cluster(1, **HOST), **OPTS)
    st0 = one.stages[0]
    assert (st0.memory, st0.time, st0.recompute_time) == pytest.approx(OFFLOAD_ONE)
    assert st0.recompute == "offload"
    two = evaluate(four_ops(), CUT, recompute="offload", cluster=host_cluster(2, **HOST), **OPTS)
    for stage, (memory, time) in zip(two.stages, OFFLOAD_TWO):
        assert (stage.memory, stage.time) == pytest.approx((memory, time))
    # the copies are added to each B on the simulated timeline (as a recomputation's R bar)
    assert two.recompute == ["offload", "offload"]


def test_without_a_host_link_offload_stays_in_device_memory_at_no_cost_and_auto_never_takes_it() -> None:
    # the cpu profile and plain clusters have no host link: a CPU's memory is host memory already
    assert Cluster.load("cpu", devices=2).devices[0].host_link is None
    none = evaluate(four_ops(), CUT, recompute="none", **OPTS)
    off = evaluate(four_ops(), CUT, recompute="offload", **OPTS)
    assert [(s.memory, s.time) for s in off.stages] == [(s.memory, s.time) for s in none.stages]
    assert off.recompute == ["offload", "offload"]
    for limit in (700, 900, 100):
        assert "offload" not in evaluate(four_ops(), CUT, recompute="auto", memory_limit=limit, **OPTS).recompute
    for limit in (700, 900):
        assert "offload" not in solve(four_ops(), 2, memory_limit=limit, **OPTS).recompute


def test_auto_takes_offload_where_it_fits_and_beats_recomputing() -> None:
    fast = host_cluster(2, **HOST)
    # 700 bytes: stage 0 fits only under full (640, 6.0 s) or offload (640, 4.904 s): offload; stage 1 fits as none
    auto = evaluate(four_ops(), CUT, recompute="auto", memory_limit=700, cluster=fast, **OPTS)
    assert auto.recompute == ["offload", "none"] and auto.memory_ok
    assert auto.bottleneck == pytest.approx(4.904)
    # a host link slower than recomputing (100 B/s: 4.02 s of copies against full's 1.5 s): full again
    slow = evaluate(four_ops(), CUT, recompute="auto", memory_limit=700, cluster=host_cluster(2, 100.0, 1e-3), **OPTS)
    assert slow.recompute == ["full", "none"]
    # where memory does not bind, nothing is offloaded
    assert evaluate(four_ops(), CUT, recompute="auto", memory_limit=900, cluster=fast, **OPTS).recompute == \
        ["none", "none"]
    # the solvers choose the same, with the partition
    for method in ("dp", "cpsat", "auto"):
        part = solve(four_ops(), 2, memory_limit=700, cluster=fast, method=method, **OPTS)
        best = synthetic.brute_force(four_ops(), 2, memory_limit=700, cluster=fast, **OPTS)
        assert "offload" in part.recompute and part.memory_ok, method
        assert part.bottleneck == pytest.approx(best.bottleneck), method


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(saved_graphs())
def test_solvers_weigh_offload_as_the_oracle(case) -> None:
    """dp, cpsat and auto against brute force over every assignment and every combination of the four choices."""
    graph, p, opts = case
    opts = {**opts, "cluster": host_cluster(p, 2e5, 1e-3)}
    if opts["recompute"] != "auto":
        opts["recompute"] = "offload"
    try:
        best = synthetic.brute_force(graph, p, **opts)
    except MemoryLimitError:
        best = None
    try:
        best_in_order = synthetic.brute_force(graph, p, order=graph_order(graph)[1], **opts)
    except MemoryLimitError:
        best_in_order = None
    for method in ("dp", "cpsat", "auto"):
        try:
            part = solve(graph, p, method=method, **opts)
        except MemoryLimitError:
            assert (best_in_order if method == "dp" else best) is None, method
            continue
        synthetic.assert_valid(graph, part)
        assert part.lower_bound <= best.bottleneck * (1 + 1e-6)
        want = best_in_order if method == "dp" else best
        assert part.bottleneck == pytest.approx(want.bottleneck, rel=1e-6), method


def _wide_mlp() -> tuple[nn.Module, torch.Tensor]:
    """Eight fp32 8192-wide Linear + ReLU blocks on the meta device, 16384 rows a microbatch: on an H100 a block's
    forward (2 x 16384 x 8192^2 FLOPs, about 43 ms) costs more than copying what it saves (512 MiB) out and back
    over PCIe (about 21 ms)."""
    with torch.device("meta"):
        layers = [m for _ in range(8) for m in (nn.Linear(8192, 8192), nn.ReLU())]
        return nn.Sequential(*layers), torch.randn(65536, 8192)


def test_planner_offloads_on_an_h100_profile_where_it_is_cheaper_than_recomputing() -> None:
    model, x = _wide_mlp()
    opts = dict(stages=2, microbatches=4, schedule="1f1b", timing="analytic", device_profile="h100-sxm",
                cluster="h100-sxm")
    free = smp.plan(model, (x,), recompute="none", **opts)
    assert free.recompute == ["none", "none"]
    limit = 0.9 * max(s.memory for s in free.partition.stages)  # the first stage (two microbatches in flight) binds
    plan = smp.plan(model, (x,), memory_limit=limit, **opts)
    assert plan.recompute == ["offload", "none"] and plan.partition.memory_ok, plan.recompute
    by_choice = {c: plan.resimulate(recompute=c).partition.stages[0] for c in ("none", "selective", "full")}
    stage = plan.partition.stages[0]
    assert by_choice["none"].memory > limit and by_choice["selective"].memory > limit  # neither fits
    assert by_choice["full"].memory == pytest.approx(stage.memory)  # full fits in the same bytes ...
    assert stage.recompute_time < 0.6 * by_choice["full"].recompute_time  # ... but recomputing costs more
    assert stage.time < by_choice["full"].time
    # priced on the profile's host link: 2 x saved / 50 GB/s (+ 10 us per copy)
    link = Cluster.load("h100-sxm").devices[0].host_link
    assert (link.bandwidth, link.latency) == (5.0e10, 1e-5)
    assert Plan.from_dict(plan.to_dict()).recompute == plan.recompute  # the plan's JSON carries the choice


def test_offloading_hooks_copy_the_stash_to_host_memory_and_leave_kept_storages() -> None:
    weight = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    counted: list[torch.Tensor] = []
    with offloading(torch.device("cpu"), {x.untyped_storage().data_ptr()}.__contains__, counted.append):
        h = torch.tanh(x @ weight)  # mm saves x and the weight (kept), tanh saves its output (copied)
        y = (h * h).sum()  # mul saves h twice: two copies
    saved = h.grad_fn._saved_result  # unpacked: the host copy, a tensor of its own with the same values
    assert saved.untyped_storage().data_ptr() != h.untyped_storage().data_ptr() and torch.equal(saved, h)
    assert any(t is weight for t in counted) and any(t is x for t in counted)
    assert len(counted) == 2 + 3  # the two kept, and on a CPU device the three copies as the device's memory
    y.backward()
    ref_x, ref_w = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    (torch.tanh(ref_x @ ref_w) ** 2).sum().backward()
    assert torch.equal(x.grad, ref_x.grad) and torch.equal(weight.grad, ref_w.grad)


def test_offload_is_a_recompute_mode_everywhere() -> None:
    assert "offload" in CHOICES and "offload" in RECOMPUTE_CHOICES
    plan = make_plan(SPEC, 2, 2, "1f1b", recompute="offload")
    assert plan.recompute == ["offload", "offload"]
    again = Plan.from_dict(plan.to_dict())
    assert again.recompute == ["offload", "offload"]
    assert plan.resimulate(recompute=["offload", "none"]).recompute == ["offload", "none"]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_offloading_stages_train_exactly_as_without_in_one_process(schedule: str) -> None:
    base = make_plan(SPEC, 2, 2, schedule, recompute="none")
    runs = {}
    for choice in ("none", "offload"):
        b = build(SPEC, seed=0)
        torch.manual_seed(7)
        pipe = smp.partition(b.model, plan=base.resimulate(recompute=choice), loss_fn=b.loss_fn)
        runs[choice] = pipeline_run(pipe, SPEC, 2)
    assert all(torch.equal(a, b) for a, b in zip(runs["none"]["losses"], runs["offload"]["losses"]))
    for key in ("grads", "params"):
        assert runs["offload"][key].keys() == runs["none"][key].keys()
        for name, t in runs["none"][key].items():
            assert torch.equal(runs["offload"][key][name], t), (key, name)


@pytest.mark.slow
def test_offloading_on_two_gloo_ranks_is_bit_exact_and_meters_the_copies(tmp_path: Path) -> None:
    plans = {}
    for schedule in ("1f1b", "zb-h1"):
        base = make_plan(SPEC, 2, 4, schedule, recompute="none")
        plans[f"{schedule}-none"] = base
        plans[f"{schedule}-offload"] = base.resimulate(recompute="offload")
    results = launch(f"{HERE / '_runtime_common.py'}:recompute_worker", 2,
                     {"spec": SPEC, "plans": {k: p.to_dict() for k, p in plans.items()}, "out": str(tmp_path)},
                     timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    for schedule in ("1f1b", "zb-h1"):
        plan = plans[f"{schedule}-offload"]
        for rank in range(2):
            got = torch.load(tmp_path / f"{schedule}-offload-{rank}.pt", weights_only=False)
            ref = torch.load(tmp_path / f"{schedule}-none-{rank}.pt", weights_only=False)
            assert torch.equal(got["loss"], ref["loss"])
            assert got["grads"] and got["grads"].keys() == ref["grads"].keys()
            for name, g in got["grads"].items():
                assert torch.equal(g, ref["grads"][name]), (schedule, rank, name)
            # a CPU's copies are in its own memory: the plan prices offload as none there, and the meter counts them
            for s in plan.schedule.stages_of(rank):
                kept, predicted = got["kept"][s], plan.partition.stages[s].activations
                assert abs(kept - predicted) <= 0.1 * predicted, (schedule, rank, s, kept, predicted)
                assert math.isclose(predicted, plans[f"{schedule}-none"].partition.stages[s].activations)


@pytest.mark.slow
def test_offload_under_full_shard_is_exact(tmp_path: Path) -> None:
    from test_sharding import _check_exact, _run

    ranks = _run(tmp_path, "full_shard", recompute="offload")
    _check_exact(ranks, 2, "full_shard offload")
    for res in ranks:
        assert res["sharding"] == "full_shard" and set(res["recompute"]) == {"offload"}


def test_cli_takes_offload() -> None:
    import json

    from typer.testing import CliRunner

    from smp.cli import app

    out = CliRunner().invoke(app, ["plan", "mlp", "--stages", "2", "--meta", "--recompute", "offload", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["recompute"] == ["offload", "offload"]
