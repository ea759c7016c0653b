"""The data-parallel x pipeline shape search: the grid, the pruning bound, the choice, the errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import smp
from partitioner import synthetic
from partitioner.cluster import Cluster
from partitioner.compile import plan_from_graph
from partitioner.errors import PlanError
from partitioner.request import PlanRequest
from partitioner.shapes import Shape, search_shapes, shapes_for

GB = 2**30


def test_the_grid_is_every_divisor_shape_with_enough_microbatches() -> None:
    # 4 devices, 8 samples: P=1 (D=4, 2 each: m in {1, 2}, one schedule only), P=2 (D=2, 4 each:
    # m >= 2 dividing 4), P=4 (D=1, 8 each: m >= 4 dividing 8).
    got = shapes_for(4, 8, schedules=["gpipe", "1f1b"])
    want = [Shape(4, 1, 1, "1f1b"), Shape(4, 1, 2, "1f1b"),
            Shape(2, 2, 2, "gpipe"), Shape(2, 2, 4, "gpipe"), Shape(2, 2, 2, "1f1b"), Shape(2, 2, 4, "1f1b"),
            Shape(1, 4, 4, "gpipe"), Shape(1, 4, 8, "gpipe"), Shape(1, 4, 4, "1f1b"), Shape(1, 4, 8, "1f1b")]
    assert got == want


def test_fixed_stages_and_microbatches_narrow_the_grid() -> None:
    assert shapes_for(8, 32, schedules=["1f1b"], stages=2) == [Shape(4, 2, m, "1f1b") for m in (2, 4, 8)]
    assert shapes_for(2, 32, schedules=["1f1b"], stages=1) == [Shape(2, 1, m, "1f1b") for m in (1, 2, 4, 8, 16)]
    assert shapes_for(8, 32, schedules=["1f1b"], microbatches=[4]) == [
        Shape(8, 1, 4, "1f1b"), Shape(4, 2, 4, "1f1b"), Shape(2, 4, 4, "1f1b"), Shape(1, 8, 4, "1f1b")]
    # A replica share that the fixed microbatch count does not divide has no shape.
    assert shapes_for(4, 6, schedules=["1f1b"], microbatches=[4]) == []


def test_bad_grids_are_named() -> None:
    with pytest.raises(PlanError, match="3 stages do not divide 8 devices"):
        shapes_for(8, 16, schedules=["1f1b"], stages=3)
    with pytest.raises(PlanError, match="devices must be a whole number >= 1"):
        shapes_for(0, 16, schedules=["1f1b"])
    with pytest.raises(PlanError, match="unknown schedule"):
        shapes_for(4, 16, schedules=["zigzag"])


def _cluster(devices: int, memory: float | None = None) -> Cluster:
    return Cluster.uniform(devices, bandwidth=50e9, latency=5e-6, memory=memory)


def _search(graph, devices: int, batch: int, **kwargs):
    return search_shapes(graph, PlanRequest(devices=devices, global_batch=batch, cluster=_cluster(devices),
                                            method="dp", **kwargs), profiled_batch=1, solve_plan=plan_from_graph)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), devices=st.sampled_from([2, 4, 6]), batch=st.sampled_from([4, 8, 12]))
def test_pruning_keeps_the_fastest_shape_and_bounds_hold(seed: int, devices: int, batch: int) -> None:
    graph = synthetic.random_dag(10, seed=seed)
    cluster = _cluster(devices)
    search = _search(graph, devices, batch, schedule=("gpipe", "1f1b"))
    # Every shape solved without pruning, each on its own scaled graph, as a user would.
    exhaustive = []
    for shape in shapes_for(devices, batch, schedules=["gpipe", "1f1b"], max_stages=len(graph)):
        micro = batch // (shape.data_parallel * shape.microbatches)
        g = graph.scaled(micro) if micro != 1 else graph
        p = plan_from_graph(g, stages=shape.stages, microbatches=shape.microbatches, schedule=shape.schedule,
                            cluster=cluster, data_parallel=shape.data_parallel, method="dp",
                            placement=None if shape.data_parallel > 1 and shape.stages > 1 else "cluster")
        exhaustive.append((p.step_time, shape))
        cand = next(c for c in search.candidates if c.shape == shape)
        assert cand.lower_bound <= p.step_time * (1 + 1e-9)
        if cand.plan is not None:
            assert cand.plan.step_time == pytest.approx(p.step_time, rel=1e-9)
    assert search.best.step_time == pytest.approx(min(t for t, _ in exhaustive), rel=1e-9)
    assert search.best.data_parallel * search.best.pipeline_ranks == devices
    step_of = {shape: t for t, shape in exhaustive}
    for c in (c for c in search.candidates if c.pruned):
        if "critical path" in c.reason:  # its screened partition's path, not the shape's: the plan dp makes of it
            assert step_of[c.shape] >= search.best.step_time * (1 - 1e-9)
        else:
            assert c.lower_bound >= search.best.step_time


def test_memory_that_one_replica_cannot_hold_forces_a_pipeline() -> None:
    graph = synthetic.transformer(6, d_model=1024, tokens=512, seed=0)
    state = sum(graph[v].get("params", 0) for v in graph.nx) * 4  # weights, grads, Adam's two moments
    cluster = _cluster(4, memory=0.6 * state)
    search = search_shapes(graph, PlanRequest(devices=4, global_batch=8, cluster=cluster, method="dp"),
                           profiled_batch=1, solve_plan=plan_from_graph)
    best = search.candidates[0]
    assert best.plan is search.best and best.shape.stages >= 2
    dp_only = [c for c in search.candidates if c.shape.stages == 1]
    assert dp_only and all(c.plan is None and "memory" in c.reason for c in dp_only)
    assert best.memory <= 0.6 * state


def test_no_shape_fits_names_the_reasons() -> None:
    graph = synthetic.chain(6, seed=1)
    cluster = _cluster(2, memory=1.0)
    search = search_shapes(graph, PlanRequest(devices=2, global_batch=4, cluster=cluster, method="dp"),
                           profiled_batch=1, solve_plan=plan_from_graph)
    with pytest.raises(PlanError, match="no shape of 2 devices runs a global batch of 4"):
        search.best  # noqa: B018


def test_a_global_batch_no_replica_count_divides_is_refused() -> None:
    graph = synthetic.chain(6, seed=1)
    with pytest.raises(PlanError, match="splits a global batch of 5 evenly"):
        search_shapes(graph, PlanRequest(devices=4, global_batch=5, cluster=_cluster(4), stages=2),
                      profiled_batch=2, solve_plan=plan_from_graph)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).sum(dim=1)


def test_smp_plan_with_devices_returns_the_best_shape_and_plan_shapes_lists_them() -> None:
    model, x = _Tiny(), torch.randn(2, 32)
    search = smp.plan_shapes(model, (x,), devices=4, global_batch=8, cluster="h100-sxm", schedule="all",
                             timing="analytic", device_profile="h100-sxm")
    assert search.candidates and search.candidates[0].plan is search.best
    assert {c.shape.schedule for c in search.candidates if c.shape.stages > 1} >= {"gpipe", "1f1b"}
    times = [c.step_time for c in search.candidates if c.plan is not None]
    assert times == sorted(times)
    # with the default method and objective, shapes are screened by the DP and the finalists solved in full
    assert search.candidates[0].final and any(c.plan is not None and not c.final for c in search.candidates)
    chosen = smp.plan(model, (x,), devices=4, global_batch=8, cluster="h100-sxm", schedule="all",
                      timing="analytic", device_profile="h100-sxm")
    assert chosen.data_parallel * chosen.pipeline_ranks == 4
    assert chosen.step_time == pytest.approx(search.best.step_time, rel=1e-9)
    again = smp.Plan.from_dict(chosen.to_dict())
    assert (again.data_parallel, again.placement) == (chosen.data_parallel, chosen.placement)


def test_smp_plan_devices_mistakes_are_named() -> None:
    model, x = _Tiny(), torch.randn(2, 32)
    with pytest.raises(PlanError, match="pass stages="):
        smp.plan(model, (x,))
    with pytest.raises(PlanError, match="global_batch= goes with devices="):
        smp.plan(model, (x,), stages=2, global_batch=8)
    with pytest.raises(PlanError, match="pass a cluster"):
        smp.plan_shapes(model, (x,), devices=2)
    with pytest.raises(PlanError, match="drop data_parallel="):
        smp.plan(model, (x,), devices=4, data_parallel=2, cluster="h100-sxm")


def test_without_a_method_shapes_are_screened_by_the_dp_and_finalists_solved_in_full() -> None:
    graph = synthetic.transformer(4, d_model=512, tokens=256, seed=3)
    cluster = _cluster(4)
    search = search_shapes(graph, PlanRequest(devices=4, global_batch=8, cluster=cluster), profiled_batch=1,
                           solve_plan=plan_from_graph)
    finalists = [c for c in search.candidates if c.final]
    assert finalists and search.candidates[0].final
    for c in search.candidates:
        if c.plan is not None and not c.final:
            assert c.plan.partition.method.startswith("dp")  # screened only
    best = search.candidates[0].shape
    micro = 8 // (best.data_parallel * best.microbatches)
    again = plan_from_graph(graph.scaled(micro) if micro != 1 else graph, stages=best.stages,
                            microbatches=best.microbatches, schedule=best.schedule, cluster=cluster,
                            data_parallel=best.data_parallel,
                            placement=search.best.placement)
    assert search.best.step_time == pytest.approx(again.step_time, rel=1e-9)


def test_cli_plan_devices_prints_the_candidates_and_reports_the_shape() -> None:
    import json

    from typer.testing import CliRunner

    from smp.cli import app

    runner = CliRunner()
    args = ["plan", "gpt:size=tiny", "--devices", "4", "--global-batch", "16", "--cluster", "h100-sxm"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "candidates weighed" in res.stdout and "replicas x stages" in res.stdout
    assert "--devices 4: a global batch of 16" in res.stdout
    assert "no plan of these shapes steps in under" in res.stdout and "the chosen step is within" in res.stdout
    top = runner.invoke(app, [*args, "--top", "2"])
    rows = [line for line in top.stdout.splitlines() if line.lstrip().startswith(("1 x ", "2 x ", "4 x "))]
    weighed = int(top.stdout.split("candidates weighed (")[1].split(",")[0])
    assert len(rows) == 2 and f"... and {weighed - 2} more (--top 0 shows every one" in top.stdout
    data = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    search = data["search"]
    assert search["devices"] == 4 and search["global_batch"] == 16
    best = search["candidates"][0]
    assert best["data_parallel"] * best["stages"] == 4 and data["num_ranks"] == 4
    assert data["microbatches"] == best["microbatches"]
    for bad, why in ((["plan", "gpt:size=tiny"], "pass --stages P"),
                     (["plan", "gpt:size=tiny", "--stages", "2", "--global-batch", "8"], "goes with --devices")):
        res = runner.invoke(app, bad)
        assert res.exit_code == 2 and why in res.output, res.output


def test_a_size_profiled_on_its_own_is_solved_and_bounded_on_its_own_graph() -> None:
    graph = synthetic.chain(8, seed=2)  # costed for a microbatch of 4 samples
    asked: list[int] = []

    def graph_for(micro: int):
        asked.append(micro)
        # what a measured profile of one sample may say: slower than a quarter of four (per-op overheads)
        return graph.scaled(3.0) if micro == 1 else None

    search = search_shapes(graph, PlanRequest(devices=2, global_batch=4, stages=2, method="dp"), profiled_batch=4,
                           solve_plan=plan_from_graph, graph_for=graph_for)
    assert sorted(set(asked)) == [1, 2]  # m = 4 and 2 (m = 1 would leave a rank idle)
    by_m = {c.shape.microbatches: c for c in search.candidates}
    one = by_m[4]
    assert one.plan is not None or one.pruned
    if one.plan is not None:
        assert one.plan.graph.total_fwd == pytest.approx(graph.total_fwd * 3.0)
        assert one.lower_bound <= one.plan.step_time * (1 + 1e-9)
    two = by_m[2].plan
    assert two is not None and two.graph.total_fwd == pytest.approx(graph.total_fwd / 2)


def test_speed_up_counts_every_replica_and_pure_data_parallel_is_not_told_to_use_fewer_stages() -> None:
    """Was: single_device_time was one replica's batch, so a D x P plan's speed-up was D times too small and a
    pure data-parallel plan (P = 1) was told that "splitting into 1 stages does not pay"."""
    from smp.cli.render import _no_gain

    graph = synthetic.transformer(4, seed=0)
    one = plan_from_graph(graph, stages=2, microbatches=4, cluster=_cluster(2), method="dp")
    two = plan_from_graph(graph, stages=2, microbatches=4, cluster=_cluster(4), method="dp", data_parallel=2,
                          placement="cluster")
    assert two.single_device_time == pytest.approx(2 * one.single_device_time)
    assert two.speedup == pytest.approx(2 * one.single_device_time / two.step_time)
    assert one.speedup < two.speedup <= 2 * one.speedup  # the all-reduce costs a little of the doubling
    pure = plan_from_graph(graph, stages=1, microbatches=1, cluster=_cluster(4), method="dp", data_parallel=4,
                           placement="cluster")
    assert pure.speedup > 1 and _no_gain(pure) is None


def test_resimulating_on_another_cluster_lays_the_replicas_out_as_the_plan_does() -> None:
    """Was: resimulate(cluster=) kept the old cluster's all-reduce link and ran the pipeline on the first P devices,
    the "cluster" layout even for a "spread" plan."""
    graph = synthetic.transformer(4, seed=0)
    plan = plan_from_graph(graph, stages=2, microbatches=4, cluster=_cluster(4), method="dp", data_parallel=2,
                           placement="spread")
    fast, slow = 100e9, 1e9  # devices 0-1 and 2-3 on fast links, a slow one between them
    other = Cluster.heterogeneous([1.0] * 4, bandwidths=[fast, slow, fast])
    moved = plan.resimulate(cluster=other)
    assert moved.dp_link is not None and moved.dp_link.bandwidth == fast  # stage s's replicas: devices 2s, 2s + 1
    assert moved.partition.cluster["links"][0]["bandwidth"] == slow  # the pipeline: devices 0 and 2
    assert moved.step_time > plan.step_time


def test_replicas_count_the_gradient_buckets_flat_copies() -> None:
    """With D > 1 each rank holds its gradients twice at the end of a step (the buckets' flat copies being
    all-reduced), so the plan's state is weights, gradients, Adam's two moments and one more gradient.
    Was: the same memory as one replica, so a shape could "fit" and run out of memory."""
    graph = synthetic.transformer(4, seed=0)
    one = plan_from_graph(graph, stages=2, microbatches=4, cluster=_cluster(2), method="dp")
    two = plan_from_graph(graph, stages=2, microbatches=4, cluster=_cluster(4), method="dp", data_parallel=2,
                          placement="cluster")
    assert two.partition.stage_of == one.partition.stage_of  # no memory limit: the same stages
    for a, b in zip(one.partition.stages, two.partition.stages):
        assert b.memory - a.memory == pytest.approx(a.params, rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["chain", "layered", "transformer", "unet", "inception", "encdec"]),
       seed=st.integers(0, 10_000), stages=st.integers(2, 5), microbatches=st.integers(1, 9),
       schedule=st.sampled_from(["gpipe", "1f1b"]), data_parallel=st.sampled_from([1, 2]),
       recompute=st.sampled_from(["none", "full"]))
def test_the_pipeline_bound_never_exceeds_the_simulated_step(kind: str, seed: int, stages: int, microbatches: int,
                                                             schedule: str, data_parallel: int,
                                                             recompute: str) -> None:
    # The screen skips scheduling a partition whose critical path (pipeline_step_bound) already
    # rules it out; that is exact only if the bound is below every step the simulator gives.
    from partitioner.compile import pipeline_step_bound
    from partitioner.ir import ScheduleKind

    graph = synthetic.generate(kind, 24, seed=seed)
    plan = plan_from_graph(graph, stages=stages, microbatches=microbatches, schedule=schedule,
                           cluster=_cluster(stages * data_parallel), data_parallel=data_parallel, method="dp",
                           objective="bottleneck", recompute=recompute, placement="cluster")
    bound = pipeline_step_bound(plan.partition, ScheduleKind.parse(schedule), microbatches)
    assert bound is not None and 0 < bound <= plan.step_time
    # every rank runs its m forwards and backwards: the bound is at least that much
    busiest = max(s.fwd + s.bwd + s.recompute_time for s in plan.partition.stages)
    assert bound >= microbatches * busiest * (1 - 1e-6)
