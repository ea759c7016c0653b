"""Repeated blocks (partitioner/blocks.py): found, folded one node each with costs kept, and what the search makes of it."""

from __future__ import annotations

import dataclasses
import math

import pytest

from partitioner.blocks import block_graph, block_prefix
from partitioner.compile import plan_from_graph, profile_model
from partitioner.cost import evaluate
from partitioner.graph import OpGraph
from partitioner.request import PlanRequest
from partitioner.shapes import search_shapes
from partitioner.synthetic import chain
from smp.models import build

ANALYTIC = PlanRequest.build(device_profile="h100-sxm", timing="analytic")


@pytest.fixture(scope="module")
def gpt() -> tuple[OpGraph, object]:
    b = build("gpt:size=tiny,layers=6,batch=4", seed=0)
    return profile_model(b.model, b.example_args, None, ANALYTIC, microbatches=1)


def test_the_numbered_module_list_is_found_and_each_member_becomes_one_node(gpt) -> None:
    graph, _ = gpt
    assert block_prefix(graph) == "blocks"
    folded = block_graph(graph, min_ops=0)
    modules = [folded[v]["module"] for v in folded.topological_order()]
    assert [m for m in modules if m.startswith("blocks")] == [f"blocks.{i}" for i in range(6)]
    assert folded.meta["blocks"] == "blocks" and len(folded) < len(graph) / 10
    assert "ln_f" in modules and "lm_head" in modules  # the ops outside the blocks keep their own nodes
    # every op is in exactly one node, and the costs add up
    members = [f for v in folded.nx for f in folded[v]["fx_nodes"]]
    assert sorted(members) == sorted(f for v in graph.nx for f in graph[v]["fx_nodes"])
    for key in ("fwd", "bwd", "flops", "params", "saved_bytes"):
        assert sum(folded[v][key] for v in folded.nx) == pytest.approx(sum(graph[v][key] for v in graph.nx),
                                                                        rel=1e-12), key


def test_a_small_graph_or_one_without_a_module_list_is_left_as_it_is(gpt) -> None:
    graph, _ = gpt
    assert block_graph(graph) is graph  # 188 ops: below MIN_OPS, solved op by op
    data = chain(2000).to_dict()
    for node in data["nodes"]:
        node["module"] = ""
    plain = OpGraph.from_dict(data)  # ops of no module
    assert block_prefix(plain) is None and block_graph(plain) is plain
    b = build("mlp:batch=4", seed=0)  # body.0 Linear, body.1 GELU, ...: four alike members, each one op already
    mlp, _ = profile_model(b.model, b.example_args, None, ANALYTIC, microbatches=1)
    assert block_prefix(mlp) == "body" and len(block_graph(mlp, min_ops=0)) == len(mlp)


def test_a_tied_weight_counts_once_in_a_group_that_holds_its_owner(gpt) -> None:
    graph, _ = gpt
    tied = [v for v in graph.nx if graph[v]["shared_from"]]
    assert tied and sum(graph[v]["shared_bytes"] for v in tied) > 0  # lm_head reads tok_emb's weight
    whole = graph.contract(lambda v: "all")
    assert whole[next(iter(whole.nx))]["shared_bytes"] == 0  # the owner is in the group: held once
    apart = block_graph(graph, min_ops=0)
    head = next(v for v in apart.nx if apart[v]["module"] == "lm_head")
    assert apart[head]["shared_bytes"] == sum(graph[v]["shared_bytes"] for v in tied)  # another stage's copy


def test_a_plan_of_the_folded_graph_cuts_between_blocks_and_prices_as_the_ops_do(gpt) -> None:
    graph, _ = gpt
    folded = block_graph(graph, min_ops=0)
    request = PlanRequest(stages=3, microbatches=4, cluster="h100-sxm")
    coarse, fine = plan_from_graph(folded, request), plan_from_graph(graph, request)
    stage_of = coarse.fx_stage_of  # every traced op's stage
    for i in range(6):
        ops = [f for v in graph.nx if graph[v]["module"].startswith(f"blocks.{i}.") for f in graph[v]["fx_nodes"]]
        assert len({stage_of[f] for f in ops}) == 1, i  # a block is never cut
    assert len(set(stage_of.values())) == 3
    assert coarse.step_time >= fine.step_time * (1 - 1e-9)  # the op-by-op space holds the folded one


def test_the_search_reports_each_plans_bound_and_the_gap(gpt) -> None:
    graph, info = gpt
    from partitioner.cluster import Cluster

    search = search_shapes(graph, PlanRequest(devices=4, global_batch=16, cluster=Cluster.load("h100-sxm", devices=4)),
                           profiled_batch=4, solve_plan=plan_from_graph, model_info=info)
    best = search.candidates[0]
    assert 0 < best.compute_bound <= best.step_time
    assert best.gap == pytest.approx(best.step_time / best.compute_bound - 1)
    assert search.lower_bound <= best.compute_bound and search.gap >= best.gap - 1e-12
    # the bound holds for every shape's plans, each solved on its own as a user would
    for c in search.candidates:
        micro = 16 // (c.shape.data_parallel * c.shape.microbatches)
        try:
            own = plan_from_graph(graph.scaled(micro / 4), PlanRequest(
                stages=c.shape.stages, microbatches=c.shape.microbatches, schedule=c.shape.schedule,
                data_parallel=c.shape.data_parallel, cluster=Cluster.load("h100-sxm", devices=4), method="dp"))
        except Exception:  # does not fit
            continue
        assert own.step_time >= search.lower_bound * (1 - 1e-9) and own.step_time >= c.compute_bound * (1 - 1e-9)
    data = search.to_dict()
    assert data["gap"] == pytest.approx(search.gap) and data["candidates"][0]["gap"] == pytest.approx(best.gap)
    assert all(c["gap"] is None for c in data["candidates"] if not c["fits"])
    assert math.isfinite(search.gap)


def test_a_shape_refused_on_the_folded_graph_says_at_what_granularity(gpt, monkeypatch) -> None:
    graph, info = gpt
    import partitioner.blocks as blocks
    from partitioner.cluster import Cluster

    folded = search_shapes(graph, PlanRequest(devices=2, global_batch=8, cluster=Cluster.load("h100-sxm", devices=2),
                                              memory_limit=1e5), profiled_batch=4, solve_plan=plan_from_graph,
                           model_info=info)
    assert all(c.plan is None for c in folded.candidates)
    assert all("no cut inside one weighed" not in c.reason for c in folded.candidates)  # 188 ops: not folded
    monkeypatch.setattr(blocks, "MIN_OPS", 0)
    folded = search_shapes(graph, PlanRequest(devices=2, global_batch=8, cluster=Cluster.load("h100-sxm", devices=2),
                                              memory_limit=1e5), profiled_batch=4, solve_plan=plan_from_graph,
                           model_info=info)
    assert all("each member of blocks one node: no cut inside one weighed" in c.reason for c in folded.candidates)


def test_a_folded_layer_reruns_under_selective_what_its_ops_do_and_keeps_their_matmuls(gpt) -> None:
    """A folded layer has FLOPs, so by its own it would look one matmul: selective would rerun nothing (2.81 ms of
    rerun on the op graph was 0.16 ms folded). The fold carries what its ops rerun and which of them are matmuls."""
    from partitioner.graph import MATMUL_FX, SELECTIVE_FWD, is_matmul

    graph, _ = gpt
    folded = block_graph(graph, min_ops=0)
    request = PlanRequest(stages=2, microbatches=4, cluster="h100-sxm", recompute="selective", method="dp")
    coarse = plan_from_graph(folded, request)
    rerun = sum(graph[v]["fwd"] for v in graph.nx if not is_matmul(graph[v]["flops"]))
    assert sum(folded[v].get(SELECTIVE_FWD, 0.0 if is_matmul(folded[v]["flops"]) else folded[v]["fwd"])
               for v in folded.nx) == pytest.approx(rerun, rel=1e-12)
    # the folded plan's cut priced on the op graph: each stage reruns the same forward seconds
    stage_of = {v: coarse.fx_stage_of[graph[v]["fx_nodes"][0]] for v in graph.nx}
    same = evaluate(graph, stage_of, coarse.partition.settings())
    assert [s.recompute_time for s in coarse.partition.stages] == pytest.approx(
        [s.recompute_time for s in same.stages], rel=1e-9)
    assert all(s.recompute_time > 0 for s in same.stages)
    block = next(v for v in folded.nx if folded[v]["module"] == "blocks.0")
    matmuls = {f for v in graph.nx if graph[v]["module"].startswith("blocks.0.") and is_matmul(graph[v]["flops"])
               for f in graph[v]["fx_nodes"]}
    assert set(folded[block][MATMUL_FX]) == matmuls and 0 < len(matmuls) < len(folded[block]["fx_nodes"])


def test_the_runtime_keeps_a_folded_layers_matmuls_not_the_whole_layer() -> None:
    """The runtime's selective mode keeps the matmul-like fx nodes' outputs: of a folded layer, its matmuls (every
    op of it looked matmul-like by the group's FLOPs, so everything was kept)."""
    from partitioner.compile import plan, trace_model
    from partitioner.graph import is_matmul
    from runtime.program import program_for

    b = build("gpt:size=tiny,layers=6,batch=4", seed=0)
    request = PlanRequest.build(device_profile="h100-sxm", timing="analytic")
    made = plan(b.model, b.example_args, stages=2, microbatches=2, recompute="selective", device_profile="h100-sxm",
                timing="analytic")
    folded_plan = dataclasses.replace(made, graph=block_graph(made.graph, min_ops=0))  # the same cut, folded
    gm = trace_model(b.model, b.example_args, None, request, microbatches=2)
    kept = program_for(folded_plan, gm, b.model, 1).matmul_nodes
    assert kept == {f for v in made.graph.nx if is_matmul(made.graph[v]["flops"]) for f in made.graph[v]["fx_nodes"]}


def test_a_shape_with_more_stages_than_the_folded_graph_has_nodes_is_listed_with_why(gpt, monkeypatch) -> None:
    """Such shapes vanished (the grid stopped at the folded graph's size), and a fixed stages= beyond it blamed
    the batch. Now they are listed, not weighed, with why; their bound still counts in the search's."""
    import partitioner.blocks as blocks
    from partitioner.cluster import Cluster

    graph, info = gpt
    monkeypatch.setattr(blocks, "MIN_OPS", 0)  # 14 nodes folded
    search = search_shapes(graph, PlanRequest(devices=16, global_batch=16, cluster=Cluster.load("h100-sxm",
                                                                                                 devices=16)),
                           profiled_batch=4, solve_plan=plan_from_graph, model_info=info)
    wide = [c for c in search.candidates if c.shape.stages == 16]
    assert wide and all(c.plan is None and "more than the 14 nodes the graph folds to" in c.reason for c in wide)
    assert search.lower_bound <= min(c.compute_bound for c in wide)
    assert search.candidates[0].plan is not None and search.candidates[0].shape.stages <= 14
