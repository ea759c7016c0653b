"""The planner's side of sharded data parallelism: each mode's memory per rank, its collectives' prices, the choice."""

from __future__ import annotations

import json

import networkx as nx
import pytest
import torch
from torch import nn

import smp
from partitioner.cluster import Cluster, Link
from partitioner.cost import evaluate
from partitioner.errors import MemoryLimitError
from partitioner.ir import Action, ActionKind, ScheduleError, StageGraph
from partitioner.plan import Plan
from partitioner.schedule import make_schedule
from partitioner.sharding import state_bytes
from partitioner.simulate import StageCosts, simulate
from partitioner.walk import validate
from smp.cli import app
from typer.testing import CliRunner


def test_each_mode_holds_its_share_of_the_state_per_rank() -> None:
    # D = 4 replicas, per byte of parameters: none keeps everything whole and the all-reduce's buckets;
    # the sharded modes keep a quarter of the parameters, gradients and AdamW's two moments for the
    # step, and while the stage computes the parameters gathered and the whole gradients.
    none, zero2, zero3 = (state_bytes(mode, 4, workspace=1.0) for mode in ("none", "shard_grad_op", "full_shard"))
    assert (none.state, none.working, none.workspace) == (1 + 1 + 2 + 1, 0.0, 1.0)
    assert (zero2.parameters, zero2.gradients, zero2.optimizer, zero2.buckets) == (0.25, 0.25, 0.5, 0.0)
    assert (zero2.gathered, zero2.unsharded_gradients, zero2.workspace) == (1.0, 1.0, 0.25)
    assert zero3 == zero2  # one stage per rank: its one FSDP unit is gathered whenever it computes
    # two interleaved stages per rank: full_shard holds one of them gathered at a time
    assert state_bytes("full_shard", 4, workspace=1.0, stages_per_rank=2).gathered == 0.5
    assert state_bytes("none", 1, workspace=1.0).state == 4.0  # no replicas, no buckets
    with pytest.raises(ValueError, match="data_parallel=1"):
        state_bytes("shard_grad_op", 1, workspace=1.0)


def _heavy_then_light() -> nx.DiGraph:
    """a holds 100 bytes of parameters and keeps 10 bytes of activations per microbatch; b is light."""
    g = nx.DiGraph()
    g.add_node("a", fwd=1.0, bwd=2.0, params=100, out_bytes=10)
    g.add_node("b", fwd=1.0, bwd=2.0, params=1, out_bytes=10)
    g.add_edge("a", "b")
    return g


def test_a_sharded_stage_peaks_at_its_shards_plus_the_working_copies_and_activations() -> None:
    held = state_bytes("shard_grad_op", 4, workspace=1.0)
    part = evaluate(_heavy_then_light(), {"a": 0, "b": 1}, microbatches=4, state_factor=held.state,
                    working_factor=held.working, workspace_factor=held.workspace)
    a, b = part.stages
    # a: shards 100 x (0.25 + 0.25 + 0.5) = 100, while computing 100 x (1 + 1) = 200 and 1f1b's 2 x 10 bytes
    # in flight; at the step 100 / 4 of workspace only, less.
    assert a.memory == 100 + max(200 + 2 * 10, 25)
    assert (a.working, a.workspace, a.state) == (200, 25, 100)
    assert b.memory == 1 + 2 + 10
    unsharded = evaluate(_heavy_then_light(), {"a": 0, "b": 1}, microbatches=4, state_factor=5.0)
    assert unsharded.stages[0].memory == 500 + max(2 * 10, 100)


def test_ring_collectives_move_their_share_of_the_bytes() -> None:
    link = Link(bandwidth=1e9, latency=1e-6)
    # 2 replicas: an all-gather or a reduce-scatter sends half of 1 MB in one step; an all-reduce is both
    assert link.allgather_seconds(1e6, 2) == pytest.approx(0.5e-3 + 1e-6)
    assert link.reduce_scatter_seconds(1e6, 2) == pytest.approx(0.5e-3 + 1e-6)
    assert link.allreduce_seconds(1e6, 2) == pytest.approx(2 * link.allgather_seconds(1e6, 2))
    assert link.allgather_seconds(1e6, 4) == pytest.approx(0.75e-3 + 3e-6)
    assert link.allgather_seconds(1e6, 1) == 0.0


def _one_stage(sharding: str):
    return make_schedule("gpipe", StageGraph.chain(1), 2, data_parallel=2, sharding=sharding)


def test_the_schedule_places_and_the_simulator_prices_each_modes_collectives() -> None:
    costs = dict(fwd=[1.0], bwd=[2.0], allgather=[0.5], reduce_scatter=[0.25], allreduce=[0.75])
    zero2 = _one_stage("shard_grad_op")
    assert [str(a) for a in zero2.actions[0]] == ["AG0.0", "F0.0", "F0.1", "B0.0", "B0.1", "RS0"]
    # the gather before the first forward, two microbatches of compute, then the reduce-scatter
    assert simulate(zero2, StageCosts(**costs)).step_time == pytest.approx(0.5 + 2 * 3.0 + 0.25)
    zero3 = _one_stage("full_shard")
    assert [str(a) for a in zero3.actions[0]] == ["AG0.0", "F0.0", "AG0.1", "F0.1", "AGB0.0", "B0.0", "AGB0.1",
                                                  "B0.1", "RS0"]
    # a gather before every forward and every backward, each waited for
    assert simulate(zero3, StageCosts(**costs)).step_time == pytest.approx(4 * 0.5 + 2 * 3.0 + 0.25)
    timeline = simulate(zero3, StageCosts(**costs)).timeline
    assert [e.kind for e in timeline.events if e.kind in ("AG", "RS")] == ["AG"] * 4 + ["RS"]
    # none: the all-reduce, overlapped with the last backward, ends its whole length after it
    assert simulate(_one_stage("none"), StageCosts(**costs)).step_time == pytest.approx(2 * 3.0 + 0.75)


def test_collective_actions_print_parse_and_are_validated_against_the_mode() -> None:
    for text in ("AG3.2", "AGB3.2", "RS3", "AR3"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError, match="once a step"):
        Action(ActionKind.REDUCE_SCATTER, 0, 1)
    zero3 = _one_stage("full_shard")
    missing = type(zero3)(zero3.name, zero3.graph, 2, zero3.stage_to_rank,
                          (tuple(a for a in zero3.actions[0] if str(a) != "AGB0.1"),), data_parallel=2,
                          sharding="full_shard")
    with pytest.raises(ScheduleError, match="missing AGB0.1"):
        validate(missing)
    wrong = type(zero3)(zero3.name, zero3.graph, 2, zero3.stage_to_rank, _one_stage("none").actions,
                        data_parallel=2, sharding="full_shard")
    with pytest.raises(ScheduleError, match="ALLREDUCE does not belong"):
        validate(wrong)


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])


def _plan(**options):
    return smp.plan(_model(), torch.randn(16, 64), stages=2, data_parallel=2, microbatches=4, timing="analytic",
                    cluster=Cluster.uniform(4, bandwidth=1e9, latency=1e-5), **options)


def test_auto_keeps_none_where_it_fits_and_is_fastest() -> None:
    chosen = _plan()
    assert chosen.sharding == "none"
    assert chosen.sharding_weighed["none"].startswith("chosen")
    assert chosen.sharding_weighed["shard_grad_op"].startswith("fits, step")
    assert chosen.step_time <= _plan(sharding="shard_grad_op").step_time
    assert chosen.sharding_weighed["full_shard"].startswith("not weighed")


def test_auto_shards_when_only_a_sharded_mode_fits_the_memory_limit() -> None:
    none, zero2 = _plan(sharding="none"), _plan(sharding="shard_grad_op")
    need_none, need_zero2 = max(none.rank_memory), max(zero2.rank_memory)
    assert need_zero2 < need_none
    limit = (need_none + need_zero2) / 2
    with pytest.raises(MemoryLimitError):
        _plan(sharding="none", memory_limit=limit, recompute="none")
    chosen = _plan(memory_limit=limit, recompute="none")
    assert chosen.sharding == "shard_grad_op" and chosen.partition.memory_ok
    assert chosen.sharding_weighed["none"].startswith("does not fit")
    split = chosen.memory_split()[0]
    params = chosen.partition.stages[0].params
    assert split["parameters"] == pytest.approx(1.5 * params) and split["optimizer"] == pytest.approx(params)


def test_a_sharded_plan_round_trips_through_json() -> None:
    made = _plan(sharding="full_shard")
    back = Plan.from_dict(json.loads(json.dumps(made.to_dict(), default=str)))
    assert back.sharding == "full_shard"
    assert back.schedule.actions == made.schedule.actions
    assert back.step_time == made.step_time
    chosen = _plan()
    assert Plan.from_dict(json.loads(json.dumps(chosen.to_dict(), default=str))).sharding_weighed == \
        chosen.sharding_weighed


def test_the_shape_search_says_each_candidates_mode_and_why_not_the_others() -> None:
    search = smp.plan_shapes(_model(), (torch.randn(8, 64),), devices=4, global_batch=8,
                             cluster=Cluster.uniform(4, bandwidth=1e9, latency=1e-5), timing="analytic", method="dp")
    replicated = [c for c in search.candidates if c.plan is not None and c.shape.data_parallel > 1]
    assert replicated
    for cand in replicated:
        row = cand.to_dict()
        assert row["sharding"] in ("none", "shard_grad_op")
        assert set(row["sharding_weighed"]) == {"none", "shard_grad_op", "full_shard"}
    alone = [c for c in search.candidates if c.plan is not None and c.shape.data_parallel == 1]
    assert all(c.to_dict()["sharding"] == "none" and not c.to_dict()["sharding_weighed"] for c in alone)


def test_cli_sharding_flag_is_checked_and_shown(tmp_path) -> None:
    runner = CliRunner()
    bad = runner.invoke(app, ["plan", "mlp", "--stages", "2", "--sharding", "zero3"])
    assert bad.exit_code != 0 and "--sharding" in bad.output
    one = runner.invoke(app, ["plan", "mlp", "--stages", "2", "--meta", "--sharding", "shard_grad_op"])
    assert one.exit_code != 0 and "data_parallel=1" in " ".join(one.output.split())
    out = runner.invoke(app, ["plan", "mlp", "--devices", "4", "--stages", "2", "--meta", "--cluster", "h100-sxm",
                              "--sharding", "shard_grad_op", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["sharding"] == "shard_grad_op" and report["data_parallel"] == 2
    assert set(report["stages"][0]["memory_split_bytes"]) == {"parameters", "gradients", "optimizer", "activations",
                                                              "other"}
    text = runner.invoke(app, ["plan", "mlp", "--devices", "4", "--stages", "2", "--meta", "--cluster", "h100-sxm",
                               "--sharding", "shard_grad_op"])
    assert text.exit_code == 0, text.output
    assert "sharding shard_grad_op" in text.output and "optimizer state" in text.output


def test_rank_memory_counts_what_sharding_holds_whole_while_computing() -> None:
    # one stage per rank: the rank's peak is its stage's, gathered parameters and whole gradients included
    zero2 = _plan(sharding="shard_grad_op", recompute="none")
    assert all(s.working > 0 for s in zero2.partition.stages)
    assert zero2.rank_memory == pytest.approx(zero2.stage_memory)
