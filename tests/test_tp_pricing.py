"""The planner's price of tensor parallelism (partitioner/tensor_parallel.py): T's compute, bytes and collectives."""

from __future__ import annotations

from pathlib import Path

import pytest

from partitioner.cluster import Cluster
from partitioner.compile import plan
from partitioner.plan import Plan
from partitioner.shapes import Shape
from smp.models import build

GPT = "gpt:size=tiny,batch=8"
SPLIT = ("attn.q", "attn.kv", "attn.out", "fc", "proj")  # the zoo GPT's tp plan, by module leaf


@pytest.fixture(scope="module")
def plans() -> tuple[Plan, Plan, object]:
    b = build(GPT, seed=0)
    common = dict(stages=2, device_profile="h100-sxm", cluster="h100-sxm", timing="analytic")
    return plan(b.model, b.example_args, **common), plan(b.model, b.example_args, tensor_parallel=2,
                                                          sequence_parallel=False, **common), b.model


def test_split_ops_cost_half_and_replicated_ops_whole(plans) -> None:
    one, two, _ = plans
    assert (one.tensor_parallel, two.tensor_parallel) == (1, 2)
    kinds = {"split": 0, "whole": 0}
    for name in one.graph.nx:
        a, b = one.graph[name], two.graph[name]
        if a["op"] == "output":
            continue
        compute = b["fwd"] - b["tp_fwd_comm"], b["bwd"] - b["tp_bwd_comm"]
        if a["module"].endswith(SPLIT) or a["op"] == "scaled_dot_product_attention":
            assert compute == pytest.approx((a["fwd"] / 2, a["bwd"] / 2), rel=1e-12), name
            kinds["split"] += 1
        elif a["op"] in ("LayerNorm", "Embedding", "add", "Dropout") and not a["module"].endswith(".attn"):
            assert (b["fwd"], b["bwd"], b["out_bytes"], b["params"]) == (a["fwd"], a["bwd"], a["out_bytes"],
                                                                         a["params"]), name
            kinds["whole"] += 1
    assert kinds["split"] >= 5 * 2 + 2 and kinds["whole"] >= 8  # two blocks' five Linears and attentions


def test_each_rowwise_output_and_colwise_input_gradient_pays_a_ring_all_reduce_on_the_nvlink(plans) -> None:
    one, two, _ = plans
    link = Cluster.load("h100-sxm", devices=8).links[0]  # within a node
    assert link.bandwidth < float("inf")
    rowwise = colwise = 0
    for name in two.graph.nx:
        a, b = one.graph[name], two.graph[name]
        module = a["module"]
        if module.endswith(("attn.out", "proj")):  # rowwise: its whole output all-reduced in the forward
            nbytes = a["out_bytes"]
            assert b["tp_fwd_bytes"] == nbytes and b["tp_bwd_bytes"] == 0
            assert b["tp_fwd_comm"] == pytest.approx(2 * (2 - 1) / 2 * nbytes / link.bandwidth
                                                     + 2 * (2 - 1) * link.latency, rel=1e-12)
            assert b["fwd"] == pytest.approx(a["fwd"] / 2 + b["tp_fwd_comm"], rel=1e-12)
            rowwise += 1
        elif module.endswith(("attn.q", "attn.kv", "fc")):  # colwise: its input's gradient all-reduced in backward
            producer = next(iter(one.graph.nx.predecessors(name)))
            nbytes = one.graph[producer]["out_bytes"]  # the LayerNorm's output, whole
            assert b["tp_bwd_bytes"] == nbytes and b["tp_fwd_bytes"] == 0
            assert b["tp_bwd_comm"] == pytest.approx(nbytes / link.bandwidth + 2 * link.latency, rel=1e-12)
            assert b["bwd"] == pytest.approx(a["bwd"] / 2 + b["tp_bwd_comm"], rel=1e-12)
            colwise += 1
        else:
            assert b["tp_fwd_comm"] == b["tp_bwd_comm"] == 0, name
    assert (rowwise, colwise) == (4, 6)


def test_split_weights_count_half_per_rank_and_so_does_a_split_activation(plans) -> None:
    one, two, model = plans
    for name in one.graph.nx:
        a, b = one.graph[name], two.graph[name]
        module = a["module"]
        if module.endswith(SPLIT):
            m = model.get_submodule(module)
            rowwise = module.endswith(("attn.out", "proj"))
            weight, bias = m.weight.numel() * 4, m.bias.numel() * 4
            assert a["params"] == weight + bias
            assert b["params"] == weight // 2 + (bias if rowwise else bias // 2), name
            assert b["out_bytes"] == (a["out_bytes"] if rowwise else a["out_bytes"] // 2), name
    split_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if n.rpartition(".")[0].endswith(SPLIT)
                      and not (n.endswith("bias") and n.rpartition(".")[0].endswith(("attn.out", "proj"))))
    assert sum(s.params for s in two.partition.stages) == sum(s.params for s in one.partition.stages) - split_bytes / 2
    assert max(two.rank_memory) < max(one.rank_memory)


def test_a_plan_at_tp2_round_trips_through_json(plans, tmp_path: Path) -> None:
    _, two, _ = plans
    again = Plan.load(two.save(tmp_path / "tp2.json"))
    assert again.tensor_parallel == 2 and again.graph.meta["tensor_parallel"] == 2
    assert again.step_time == pytest.approx(two.step_time, rel=1e-12)
    assert [s.params for s in again.partition.stages] == [s.params for s in two.partition.stages]
    name = next(n for n in two.graph.nx if two.graph[n]["module"].endswith("attn.out"))
    assert again.graph[name]["tp_fwd_comm"] == two.graph[name]["tp_fwd_comm"] > 0


def test_a_graph_priced_for_one_t_is_refused_for_another(plans) -> None:
    from partitioner.compile import plan_from_graph
    from partitioner.errors import PlanError

    one, two, _ = plans
    with pytest.raises(PlanError, match="priced for tensor_parallel=1, the request asks for 2"):
        plan_from_graph(one.graph, stages=2, tensor_parallel=2)
    assert plan_from_graph(two.graph, stages=2, tensor_parallel=2, cluster="h100-sxm").tensor_parallel == 2


def test_the_shape_search_weighs_t_within_a_node_skips_what_the_model_cannot_split_and_bounds_hold() -> None:
    from partitioner.compile import plan_shapes

    b = build(GPT, seed=0)  # 4 heads: T = 8 cannot split them
    search = plan_shapes(b.model, b.example_args, devices=8, global_batch=32, device_profile="h100-sxm",
                         cluster="h100-sxm", timing="analytic", tensor_parallel="auto")
    assert set(search.skipped) == {8} and "4 heads" in search.skipped[8] and "=8 does not divide" in search.skipped[8]
    weighed = {c.shape.tensor_parallel for c in search.candidates}
    assert weighed == {1, 2, 4}
    for c in search.candidates:
        assert c.shape.devices == 8 and c.shape.data_parallel * c.shape.stages * c.shape.tensor_parallel == 8
        if c.plan is not None:
            assert c.plan.tensor_parallel == c.shape.tensor_parallel
            assert c.lower_bound <= c.step_time * (1 + 1e-9), c.shape  # the screen's bound holds under T
            if c.shape.tensor_parallel > 1 and c.shape.data_parallel > 1:  # split stages' sharding weighed too
                assert set(c.plan.sharding_weighed) == {"none", "shard_grad_op", "full_shard"}
    best = search.candidates[0].step_time
    for c in (c for c in search.candidates if c.plan is None and c.pruned):
        # pruned by its bound, a bound no plan beats; or by its screened partition's critical path (that partition's
        # bound, not the shape's: the shape keeps its compute bound)
        assert c.lower_bound >= best or "screened partition's critical path" in c.reason, c.reason
    data = search.to_dict()
    assert data["tensor_parallel_skipped"] == {"8": search.skipped[8]}
    assert {c["tensor_parallel"] for c in data["candidates"]} == {1, 2, 4}
    fixed = plan_shapes(b.model, b.example_args, devices=8, global_batch=32, device_profile="h100-sxm",
                        cluster="h100-sxm", timing="analytic", tensor_parallel=2)
    assert {c.shape.tensor_parallel for c in fixed.candidates} == {2} and not fixed.skipped
    solved = [c for c in fixed.candidates if c.plan is not None]
    assert len(solved) >= 3 and all(c.plan.tensor_parallel == 2 for c in solved)
    assert all(c.lower_bound <= c.step_time * (1 + 1e-9) for c in solved)  # the screen's bound holds under T


def test_a_tp_degree_that_does_not_divide_a_node_is_not_weighed() -> None:
    from partitioner.shapes import shapes_for

    shapes = shapes_for(8, 16, schedules=("1f1b",), tensor_parallel=(1, 2, 4))
    assert {s.tensor_parallel for s in shapes} == {1, 2, 4}
    assert all(s.devices == 8 for s in shapes) and str(Shape(2, 2, 4, "1f1b", 2)) == "2x2 tp2 1f1b m=4"
    assert {s.tensor_parallel for s in shapes_for(6, 12, schedules=("1f1b",), tensor_parallel=(1, 2, 4))} == {1, 2}


def test_what_split_stages_do_not_run_is_never_planned_for_them() -> None:
    """A search leaves zero-bubble schedules out of its T > 1 shapes (the runtime refuses them at T > 1, so a plan
    chosen for T > 1 must not need them); every recomputation choice runs split, so none is refused."""
    from partitioner.recompute import CHOICES
    from partitioner.request import PlanRequest
    from partitioner.shapes import shapes_for
    from partitioner.tensor_parallel import not_run_split

    shapes = shapes_for(8, 16, schedules=("1f1b", "zb-h1"), tensor_parallel=(1, 2))
    assert {s.schedule for s in shapes if s.tensor_parallel == 1 and s.stages > 1} == {"1f1b", "zb-h1"}
    assert {s.schedule for s in shapes if s.tensor_parallel == 2} == {"1f1b"}
    assert not_run_split(compiled=False, schedules=["1f1b", "interleaved", "gpipe"]) is None
    assert "zb-h1" in not_run_split(compiled=False, schedules=["1f1b", "zb-h1"])
    assert "compile=True" in not_run_split(compiled=True, schedules=["1f1b"])
    for choice in ("auto", *CHOICES):  # asked for at T > 1: planned, not refused
        assert PlanRequest(stages=2, data_parallel=2, tensor_parallel=2, recompute=choice).recompute == choice


def test_recompute_auto_chooses_selective_and_offload_for_split_stages() -> None:
    """At T = 2 under a memory limit the first stage meets only by recomputing, auto takes selective recomputation
    (no host link) or offloading (the cluster's host link): the planner weighs every choice at T > 1 (it weighed
    none and full only)."""
    b = build("gpt:size=tiny,batch=64", seed=0)
    common = dict(stages=2, device_profile="h100-sxm", timing="analytic", tensor_parallel=2, recompute="auto",
                  memory_limit=3.3e6, sequence_parallel=False)  # (the limit is set for whole norms' activations)
    assert plan(b.model, b.example_args, **common).recompute == ["selective", "none"]
    assert plan(b.model, b.example_args, cluster="h100-sxm", **common).recompute == ["offload", "none"]


@pytest.mark.parametrize("option", [{"schedule": "zb-h1"}, {"compile": True}])
def test_a_request_for_what_split_stages_do_not_run_is_refused_before_planning(option: dict) -> None:
    from partitioner.errors import OptionError
    from partitioner.request import PlanRequest

    with pytest.raises(OptionError, match=r"tensor_parallel=2 does not run with .* yet"):
        PlanRequest.build(stages=2, data_parallel=2, tensor_parallel=2, **option)


def test_split_stages_sharded_over_the_replicas_hold_their_share_of_the_split_state(plans) -> None:
    """Sharding at T = 2 is requested (no longer refused) and priced by the one formula: the graph priced for T
    holds each tp rank's parameter bytes, which state_bytes' factors split over the D replicas, so a rank holds
    1/(T x D) of a split module's optimizer state (and 1/D of a whole one's)."""
    from partitioner.request import PlanRequest
    from partitioner.sharding import OPTIMIZER_BYTES, SHARDING_MODES, state_bytes

    one, two, model = plans
    for mode in ("shard_grad_op", "full_shard"):
        assert PlanRequest(stages=2, data_parallel=2, tensor_parallel=2, sharding=mode).sharding == mode
    b = build(GPT, seed=0)
    common = dict(stages=2, data_parallel=2, tensor_parallel=2, device_profile="h100-sxm", cluster="h100-sxm",
                  timing="analytic")
    sharded = plan(b.model, b.example_args, sharding="shard_grad_op", **common)
    assert (sharded.sharding, sharded.tensor_parallel, sharded.data_parallel) == ("shard_grad_op", 2, 2)
    held = state_bytes("shard_grad_op", 2, workspace=1.0)
    for stage in sharded.partition.stages:  # by the stage's own (one tp rank's) parameter bytes
        assert stage.state == pytest.approx(held.state * stage.params + stage.buffers, rel=1e-12)
        assert stage.working == pytest.approx(held.working * stage.params, rel=1e-12)
    split = [n for n in two.graph.nx if one.graph[n]["module"].endswith(SPLIT) and one.graph[n]["params"]]
    whole_bytes = sum(one.graph[n]["params"] for n in split)  # T = 1: each split module's whole parameters
    rank_bytes = sum(sharded.graph[n]["params"] for n in split)  # T = 2: one tp rank's share (a rowwise bias whole)
    biases = sum(2 * sharded.graph[n]["params"] - one.graph[n]["params"] for n in split)  # a rowwise bias: whole
    assert whole_bytes > 0 and 0 < biases < whole_bytes / 20
    assert held.optimizer * rank_bytes == pytest.approx(OPTIMIZER_BYTES * (whole_bytes + biases) / (2 * 2),
                                                        rel=1e-12)
    assert held.optimizer * rank_bytes < OPTIMIZER_BYTES * whole_bytes / (2 * 2) * 1.05  # 1/(T x D)-ish
    weighed = plan(b.model, b.example_args, sharding="auto", virtual_stages=2, schedule="interleaved", **common)
    assert set(weighed.sharding_weighed) == set(SHARDING_MODES)
    assert not any(v.startswith("not weighed") for v in weighed.sharding_weighed.values()), weighed.sharding_weighed


def test_a_hugging_face_model_built_on_meta_is_priced_split() -> None:
    """torch.export bakes device="meta" into the positions and masks a meta-built model makes: pricing T runs the
    program on fake tensors there (it failed with a device mismatch, so "auto" skipped every T > 1)."""
    pytest.importorskip("transformers")
    from partitioner.compile import plan_shapes

    b = build("hf-llama:layers=2,d_model=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq_len=16,batch=2", seed=0,
              meta=True)
    search = plan_shapes(b.model, b.example_args, devices=4, global_batch=4, device_profile="h100-sxm",
                         cluster="h100-sxm", timing="analytic", tensor_parallel="auto", dtype="bf16")
    assert set(search.skipped) == {4, 8} and "heads" in search.skipped[4]  # 2 key/value heads: T = 4 cannot split
    assert {c.shape.tensor_parallel for c in search.candidates} == {1, 2}
    common = dict(stages=2, device_profile="h100-sxm", cluster="h100-sxm", timing="analytic", dtype="bf16")
    one, two = plan(b.model, b.example_args, **common), plan(b.model, b.example_args, tensor_parallel=2, **common)
    q = next(v for v in one.graph.nx if one.graph[v]["module"] == "model.layers.0.self_attn.q_proj")
    assert two.graph[q]["fwd"] - two.graph[q]["tp_fwd_comm"] == pytest.approx(one.graph[q]["fwd"] / 2, rel=1e-12)


def test_the_speed_up_compares_with_one_device_running_the_whole_model(plans) -> None:
    """A T-priced graph holds each rank's share; one device runs every op whole (it read the shares: at T = 2 the
    speed-up was about half what it is)."""
    one, two, _ = plans
    assert two.microbatches == one.microbatches
    assert two.single_device_time == pytest.approx(one.single_device_time, rel=1e-12)
    assert two.speedup == pytest.approx(one.single_device_time / two.step_time, rel=1e-12)


def test_a_split_plan_is_not_resimulated_on_another_cluster_but_on_its_own_it_is(plans) -> None:
    """Its collectives are priced on its cluster's node links (and its stages laid out over tp groups there): on
    another cluster it would keep the old prices; it used to be laid out as if unsplit."""
    from partitioner.errors import PlanError

    _, two, _ = plans
    with pytest.raises(PlanError, match="plan again for the other cluster"):
        two.resimulate(cluster=Cluster.load("a100-sxm", devices=8))
    again = two.resimulate(microbatches=two.microbatches)
    assert again.step_time == pytest.approx(two.step_time, rel=1e-9) and again.tensor_parallel == 2


def test_sequence_parallelism_reduce_scatters_rowwise_outputs_gathers_once_per_colwise_group_and_splits_the_norms(
        plans) -> None:
    """With sequence parallelism (the default where the program allows it) the zoo GPT's second block runs its
    LayerNorms, dropouts and residual adds on half the sequence; each rowwise output is reduce-scattered (its
    gradient all-gathered) instead of all-reduced; each colwise group's input is all-gathered once, paid by its first
    reader (forward all-gather, backward reduce-scatter), its other readers paying nothing; the LM head reads the
    final norm gathered whole and runs whole. Same bytes on the wire per block, less compute and memory."""
    one, off, _ = plans
    b = build(GPT, seed=0)
    on = plan(b.model, b.example_args, stages=2, device_profile="h100-sxm", cluster="h100-sxm", timing="analytic",
              tensor_parallel=2)
    assert (on.sequence_parallel, off.sequence_parallel) == (True, False)
    link = Cluster.load("h100-sxm", devices=8).links[0]

    def half_ring(nbytes: float) -> float:  # an all-gather or reduce-scatter among 2 ranks
        return nbytes / 2 / link.bandwidth + link.latency

    by_module = {on.graph[v]["module"]: v for v in on.graph.topological_order()}
    for module in ("blocks.1.attn.out", "blocks.1.proj"):  # rowwise
        whole, share = one.graph[by_module[module]], on.graph[by_module[module]]
        assert share["tp_fwd_comm"] == pytest.approx(half_ring(whole["out_bytes"]), rel=1e-12)
        assert share["tp_bwd_comm"] == pytest.approx(half_ring(whole["out_bytes"]), rel=1e-12)
        assert share["out_bytes"] == whole["out_bytes"] // 2  # a sequence shard
    for first, other, norm in (("blocks.1.attn.kv", "blocks.1.attn.q", "blocks.1.ln1"),
                               ("blocks.1.fc", None, "blocks.1.ln2")):
        gathered = one.graph[by_module[norm]]["out_bytes"]
        payer = on.graph[by_module[first]]
        assert (payer["tp_fwd_bytes"], payer["tp_bwd_bytes"]) == (gathered, gathered)
        assert payer["tp_fwd_comm"] == pytest.approx(half_ring(gathered), rel=1e-12)
        assert payer["tp_bwd_comm"] == pytest.approx(half_ring(gathered), rel=1e-12)  # no all-reduce of its own
        if other is not None:
            assert on.graph[by_module[other]]["tp_fwd_comm"] == on.graph[by_module[other]]["tp_bwd_comm"] == 0
    for v in on.graph.nx:  # the ops between the rowwise and the next colwise modules: half the sequence
        a, d = one.graph[v], on.graph[v]
        if a["module"].startswith("blocks.1") and a["op"] in ("LayerNorm", "Dropout", "add") or a["module"] == "ln_f":
            assert (d["fwd"], d["bwd"], d["out_bytes"]) == pytest.approx((a["fwd"] / 2, a["bwd"] / 2,
                                                                          a["out_bytes"] // 2), rel=1e-12), v
    head, head_whole = on.graph[by_module["lm_head"]], one.graph[by_module["lm_head"]]
    assert head["fwd"] - head["tp_fwd_comm"] == pytest.approx(head_whole["fwd"], rel=1e-12)  # whole, on every rank
    assert head["tp_fwd_comm"] == pytest.approx(half_ring(one.graph[by_module["ln_f"]]["out_bytes"]), rel=1e-12)
    block = [v for v in on.graph.nx if on.graph[v]["module"].startswith("blocks.1")]
    # forward: two reduce-scatters and two all-gathers move what two all-reduces did; backward: two of each
    # instead of three all-reduces (q's, kv's and fc's input gradients)
    comm = {key: (sum(on.graph[v][key] for v in block), sum(off.graph[v][key] for v in block))
            for key in ("tp_fwd_comm", "tp_bwd_comm")}
    assert comm["tp_fwd_comm"][0] == pytest.approx(comm["tp_fwd_comm"][1], rel=1e-12)
    assert comm["tp_bwd_comm"][0] == pytest.approx(comm["tp_bwd_comm"][1] * 2 / 3, rel=1e-12)
    # (each plan cuts elsewhere: the ranks' memory together, not the fullest's)
    assert on.step_time < off.step_time and sum(on.rank_memory) < sum(off.rank_memory)


def test_a_rowwise_rep_input_gradient_is_gathered_with_sequence_parallelism_too() -> None:
    """rowwise_rep reads a whole input, whose gradient each rank holds a slice of (all-gathered in the backward);
    under sequence parallelism its output is reduce-scattered instead, and that gather stayed out of the price."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.ln, self.c = nn.Linear(32, 128), nn.Linear(128, 32), nn.LayerNorm(32), nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.b(F.gelu(self.a(x)))  # b reads a's whole output, which gets a gradient
            return self.c(self.ln(h) + h)

    torch.manual_seed(0)
    model, x = Mixer(), torch.randn(4, 8, 32)
    bwd = {}
    for sp in (False, True):
        p = plan(model, (x,), stages=1, microbatches=2, timing="analytic", tensor_parallel=2,
                 tp_plan={"b": "rowwise_rep"}, sequence_parallel=sp, cluster="h100-sxm")
        assert p.sequence_parallel is sp
        bwd[sp] = p.graph["b"]["tp_bwd_bytes"]
    whole_in, whole_out = 2 * 8 * 128 * 4, 2 * 8 * 32 * 4  # one microbatch of 2: a's output, b's output (fp32)
    assert (bwd[False], bwd[True]) == (whole_in, whole_in + whole_out)  # with SP, + b's output gradient gathered
