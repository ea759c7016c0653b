"""Tensor parallelism inside pipeline stages (DTensor over a "tp" mesh dimension): exact against one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _launch import launch
from _tp_checks import reference_step
from smp.models.common import output_logits

HERE = Path(__file__).resolve().parent
WORKER = f"{HERE / '_tp_checks.py'}:tp_worker"
GPT = "gpt:size=tiny,batch=4"


def _run(tmp_path: Path, spec: str, world: int, stages: int, tp: int, **kw: Any) -> list[dict]:
    out = tmp_path / f"{world}-{stages}-{tp}"
    out.mkdir()
    results = launch(WORKER, world, {"spec": spec, "stages": stages, "tp": tp, "out": str(out), **kw}, timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: {r.stdout[-1500:]}\n{r.stderr[-3000:]}"
    return [torch.load(out / f"tp-{r}.pt", weights_only=False) for r in range(world)]


def _max_relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def _check_exact(ranks: list[dict], spec: str, pieces: int, tp: int, label: str, sharded_over: int = 1,
                 sequence_parallel: bool = True) -> float:
    """Every rank's loss and gathered gradients equal the one-process step (fp32, relative 1e-5); each rank holds
    1/tp of each split weight, and the whole of the others (each 1/``sharded_over`` of that: sharded over the
    replicas). The plan runs ``sequence_parallel`` (the default "auto" runs it on these models), its stage programs
    holding the gathers and scatters. Returns the largest relative gradient error."""
    assert all(r["sequence_parallel"] is sequence_parallel for r in ranks), f"{label}: sequence_parallel"
    collectives = sum(r["sequence_collectives"] for r in ranks)
    assert collectives > 0 if sequence_parallel else collectives == 0, f"{label}: {collectives} gathers/scatters"
    ref = reference_step(spec, pieces)
    worst = 0.0
    seen: set[str] = set()
    for r, res in enumerate(ranks):
        assert torch.allclose(res["loss"], ref["loss"], rtol=1e-5, atol=0), f"{label} rank {r}: loss {res['loss']}"
        for name, g in res["grads"].items():
            want = ref["grads"][name]
            err = _max_relative(g, want)
            worst = max(worst, err)
            assert err < 1e-5, f"{label} rank {r}: gradient of {name} off by {err:.2e} (relative)"
        seen |= set(res["grads"])
        assert res["split"], f"{label} rank {r}: no split weight"
        for name, held in res["held"].items():
            expected = (res["whole"][name] // tp if name in res["split"] else res["whole"][name]) // sharded_over
            assert held == expected, f"{label} rank {r}: holds {held} of {name}'s {res['whole'][name]}"
    assert seen == set(ref["grads"]), f"{label}: gradients missing {set(ref['grads']) - seen}"
    for r, res in enumerate(ranks):  # clipping's global norm over every stage's shards
        assert torch.allclose(res["norm"], ref["norm"], rtol=1e-5), f"{label} rank {r}: norm {res['norm']}"
    assert ranks[0]["state"].keys() == ref["state"].keys() and not any(r["state"] for r in ranks[1:])
    for name, t in ranks[0]["state"].items():  # whole tensors under the original names, after an SGD step
        assert type(t) is torch.Tensor and torch.allclose(t, ref["state"][name], rtol=1e-5, atol=1e-7), name
    outputs = [res for res in ranks if res["eval"] is not None]
    assert len(outputs) == len(ranks) // 2, f"{label}: {len(outputs)} eval outputs"  # the last of 2 stages
    for res in outputs:
        got, want = output_logits(res["eval"]), output_logits(ref["eval"])[res["rows"]]
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"{label}: eval output"
    print(f"{label}: largest relative gradient error {worst:.1e}")
    return worst


@pytest.mark.slow
def test_zoo_gpt_at_tp2_pp2_trains_as_one_process(tmp_path: Path) -> None:
    ranks = _run(tmp_path, GPT, world=4, stages=2, tp=2)
    assert sorted((r["pp_rank"], r["tp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["tp_rank"] for r in ranks] == [0, 1, 0, 1]  # a stage's tp ranks are consecutive
    _check_exact(ranks, GPT, 2, 2, "gpt tp2 x pp2")


@pytest.mark.slow
def test_zoo_gpt_at_tp2_pp2_without_sequence_parallelism_trains_as_one_process(tmp_path: Path) -> None:
    """sequence_parallel=False: every rowwise output all-reduced whole, the norms run whole on each tp rank."""
    ranks = _run(tmp_path, GPT, world=4, stages=2, tp=2, sequence_parallel=False)
    _check_exact(ranks, GPT, 2, 2, "gpt tp2 x pp2, no sequence parallelism", sequence_parallel=False)


@pytest.mark.slow
def test_zoo_gpt_at_tp2_pp2_interleaved_with_full_recomputation_trains_as_one_process(tmp_path: Path) -> None:
    ranks = _run(tmp_path, GPT, world=4, stages=2, tp=2, schedule="interleaved", recompute="full")
    _check_exact(ranks, GPT, 2, 2, "gpt tp2 x pp2 interleaved, full recomputation")


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective", "offload"])
def test_zoo_gpt_at_tp2_pp2_with_selective_recomputation_or_offloading_trains_as_one_process(
        tmp_path: Path, recompute: str) -> None:
    ranks = _run(tmp_path, GPT, world=4, stages=2, tp=2, recompute=recompute)
    assert all(r["recompute"] == [recompute, recompute] for r in ranks)
    _check_exact(ranks, GPT, 2, 2, f"gpt tp2 x pp2, recompute={recompute}")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zoo_gpt_at_tp2_pp2_under_half_precision_matches_autocast(tmp_path: Path, precision: str) -> None:
    """Within the half type's rounding: the loss to one epsilon; a gradient to four (a rowwise output is the sum of
    T half-precision partial products, each rounded before the all-reduce: one rounding more than the whole
    matmul's). fp16 runs with smp's loss scaling, which scales and unscales by powers of two."""
    ranks = _run(tmp_path, GPT, world=4, stages=2, tp=2, precision=precision)
    ref = reference_step(GPT, 2, precision)
    eps = torch.finfo(torch.bfloat16 if precision == "bf16" else torch.float16).eps
    for r, res in enumerate(ranks):
        assert torch.allclose(res["loss"], ref["loss"], rtol=eps), f"rank {r}: loss {res['loss']} != {ref['loss']}"
        for name, g in res["grads"].items():
            assert _max_relative(g, ref["grads"][name]) < 4 * eps, f"rank {r}: gradient of {name}"


@pytest.mark.slow
def test_zoo_gpt_at_dp2_pp2_tp2_trains_as_one_process_and_its_checkpoint_loads_at_tp1_and_tp2(tmp_path: Path) -> None:
    saved = tmp_path / "ckpt"
    ranks = _run(tmp_path, GPT, world=8, stages=2, tp=2, checkpoint_to=str(saved))
    assert [(r["dp_rank"], r["pp_rank"], r["tp_rank"]) for r in ranks] == \
        [(d, p, t) for d in range(2) for p in range(2) for t in range(2)]  # cluster: tp innermost, then pp
    _check_exact(ranks, GPT, 4, 2, "gpt dp2 x pp2 x tp2")
    _check_loads(tmp_path, saved, ranks, [(2, 1, {}), (4, 2, {})])  # resharded to 1 tp rank, and back to 2


def _check_loads(tmp_path: Path, saved: Path, ranks: list[dict], layouts: list[tuple[int, int, dict]]) -> None:
    """``saved`` (the checkpoint of ``ranks``' step) loads into a fresh pipeline of each layout (world, tp,
    options): its state dict and each parameter's SGD momentum bit for bit."""
    grads = {n: g for r in ranks for n, g in r["grads"].items()}
    for i, (world, tp, options) in enumerate(layouts):
        out = tmp_path / f"load-{i}"
        out.mkdir()
        results = launch(f"{HERE / '_tp_checks.py'}:load_worker", world, {
            "spec": GPT, "stages": 2, "tp": tp, "checkpoint_from": str(saved), "out": str(out), **options},
            timeout=300)
        for r in results:
            assert r.returncode == 0, f"rank {r.rank}: {r.stdout[-1500:]}\n{r.stderr[-3000:]}"
        loaded = [torch.load(out / f"load-{r}.pt", weights_only=False) for r in range(world)]
        label = f"world {world}, tp {tp} {options}"
        assert loaded[0]["state"].keys() == ranks[0]["state"].keys()
        for name, t in loaded[0]["state"].items():
            assert torch.equal(t, ranks[0]["state"][name]), f"{label}: {name}"
        for res in loaded:  # SGD's momentum after one step: the first replica's gradient (the global one)
            for name, m in res["momentum"].items():
                assert torch.equal(m, grads[name]), f"{label}: momentum of {name}"


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["shard_grad_op", "full_shard"])
def test_zoo_gpt_at_dp2_pp2_tp2_sharded_over_the_replicas_trains_as_one_process(tmp_path: Path,
                                                                                sharding: str) -> None:
    """FSDP2 over "dp" on the tp-split stages (torchtitan's 2-D order: parallelize_module, then fully_shard on
    the same mesh): each rank holds 1/(T x D) of a split weight (a fused k/v's shares too), 1/D of the others;
    the checkpoint loads unsharded at tp 1 and tp 2, and sharded again."""
    saved = tmp_path / "ckpt"
    ranks = _run(tmp_path, GPT, world=8, stages=2, tp=2, sharding=sharding, checkpoint_to=str(saved))
    for res in ranks:
        assert all("dp" in mesh for mesh in res["meshes"].values()), res["meshes"]  # FSDP's DTensors
        assert {res["meshes"][n] for n in res["split"]} == {("dp", "tp")}
        # the meters see the shards' storage, and the step held this rank's tp shares whole (gathered over "dp")
        memory = res["memory"]
        assert memory["params"] == memory["grads"] == res["tp_share_bytes"] // 2
        assert memory["gathered_peak"] == memory["whole_grads_peak"] == res["tp_share_bytes"], memory
    assert any(n.endswith("attn.kv.weight") for n in ranks[0]["split"])  # the fused projection (strided)
    _check_exact(ranks, GPT, 4, 2, f"gpt dp2 x pp2 x tp2 {sharding}", sharded_over=2)
    _check_loads(tmp_path, saved, ranks, [(2, 1, {}), (4, 2, {}), (8, 2, {"sharding": sharding})])


# ---------------------------------------------------------------------- the typed option (one process)

def test_tensor_parallel_is_a_checked_request_field_and_a_plan_fact() -> None:
    import smp
    from partitioner.errors import PlanError
    from partitioner.request import PlanRequest

    assert PlanRequest().tensor_parallel == 1 and PlanRequest(tensor_parallel=4).tensor_parallel == 4
    for bad in (0, -2, 1.5, True):
        with pytest.raises(PlanError, match="tensor_parallel must be a whole number >= 1"):
            PlanRequest(tensor_parallel=bad)
    with pytest.raises(PlanError, match="tensor_parallel='auto'.*not supported yet"):
        PlanRequest.build(tensor_parallel="auto")
    old = smp.Plan.load(HERE / "data" / "plan_schema1_gpt_tiny_1f1b.json")  # written before the field
    assert old.tensor_parallel == 1
    data = old.to_dict()
    assert data["replicas"]["tensor_parallel"] == 1 and data["summary"]["tensor_parallel"] == 1
    data["replicas"]["tensor_parallel"] = 2
    with pytest.raises(PlanError, match="runs tensor_parallel=2, .* on a graph priced for tensor_parallel=1"):
        smp.Plan.from_dict(data)
    data["graph"]["meta"]["tensor_parallel"] = 2
    assert smp.Plan.from_dict(data).tensor_parallel == 2
    data["replicas"]["tensor_parallel"] = 0
    with pytest.raises(PlanError, match="tensor_parallel is 0"):
        smp.Plan.from_dict(data)


def test_a_plan_made_with_tensor_parallel_records_it(tmp_path: Path) -> None:
    import smp
    from smp.models import build

    b = build(GPT, seed=0)
    plan = smp.plan(b.model, b.example_args, stages=2, microbatches=2, timing="analytic", tensor_parallel=2)
    assert plan.tensor_parallel == 2
    assert smp.Plan.load(plan.save(tmp_path / "plan.json")).tensor_parallel == 2


def test_a_world_is_d_replicas_of_p_stages_of_t_ranks() -> None:
    from runtime.errors import RuntimeConfigError
    from runtime.layout import ReplicaLayout

    assert ReplicaLayout.replicas(8, 2, tensor_parallel=2) == 2
    assert ReplicaLayout.replicas(4, 2, planned_replicas=1, tensor_parallel=2) == 1
    with pytest.raises(RuntimeConfigError, match=r"world size 6 is not a multiple of 2 stages x tensor_parallel=2"):
        ReplicaLayout.replicas(6, 2, tensor_parallel=2)
    with pytest.raises(RuntimeConfigError, match=r"the plan is for 2 replicas of 4 ranks \(8 in all\), the world "
                                                 r"has 4"):
        ReplicaLayout.replicas(4, 2, planned_replicas=2, tensor_parallel=2)


def test_tensor_parallel_without_ranks_for_it_is_refused() -> None:
    import smp
    from runtime.errors import RuntimeConfigError
    from smp.models import build

    b = build(GPT, seed=0)
    with pytest.raises(RuntimeConfigError, match="tensor_parallel=2 splits each stage over 2 processes"):
        smp.partition(b.model, stages=1, tensor_parallel=2, loss_fn=b.loss_fn)
    with pytest.raises(RuntimeConfigError, match="tp_plan= goes with tensor_parallel"):
        smp.partition(b.model, stages=1, tp_plan={"blocks.*.fc": "colwise"}, loss_fn=b.loss_fn)
    for option, value in (("compile", True), ("schedule", "zb-h1")):
        with pytest.raises(RuntimeConfigError, match="does not run with .* yet"):
            smp.partition(b.model, stages=1, tensor_parallel=2, loss_fn=b.loss_fn, **{option: value})


# ---------------------------------------------------------------------- the graph pass (one process)

class _Block(torch.nn.Module):
    """The zoo's attention (fx bakes its head count into two views as constants), causal."""

    def __init__(self, d_model: int = 64, heads: int = 4) -> None:
        super().__init__()
        from smp.models.common import Attention

        self.attn = Attention(d_model, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, causal=True)


_STYLES = {"attn.q": "colwise", "attn.kv": "fused_colwise:2", "attn.out": "rowwise"}


def _traced_block(heads: int = 4) -> tuple[Any, Any, Any]:
    from partitioner.trace import trace
    from runtime.split import propagate_meta, state_meta_of

    torch.manual_seed(0)
    block = _Block(heads=heads)
    x = torch.randn(2, 5, 64)
    gm = trace(block, (x,), frontend="fx")
    every = {n.name for n in gm.graph.nodes if n.op not in ("output", "get_attr")}
    return gm, x, propagate_meta(gm, [x], every, state_meta_of(gm), torch.device("cpu"))


def _splits(model: torch.nn.Module, plan: dict, tp: int) -> dict:
    from partitioner.tp_plan import check_tp_plan

    return {name: how for name, (_, how) in check_tp_plan(model, plan, tp).items()}


def test_views_that_bake_the_global_head_count_are_rewritten_to_each_ranks_share() -> None:
    import copy

    from partitioner.tp_graph import rewrite_stage, split_activations

    gm, x, meta = _traced_block()
    views = {n.name: n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("view", "reshape")}
    assert any(4 in n.args for n in views.values()) and any(64 in n.args for n in views.values())  # global counts
    acts = split_activations(gm, _splits(gm, _STYLES, 2), meta, 2)
    assert {views[v].target for v in acts.rewrites} == {"view", "reshape"}
    assert sorted(new for _, new in acts.rewrites.values()) == [2, 2, 2, 32]  # q, k, v: 2 heads; out: 32 features
    whole = gm(x)
    total = torch.zeros_like(whole)
    for t in range(2):  # each rank's program on its shares; the rowwise outputs sum to the whole output
        rank = copy.deepcopy(gm)
        rewrite_stage(rank, acts)
        attn = rank.get_submodule("attn")
        mine = slice(32 * t, 32 * (t + 1))
        kv_rows = torch.cat([torch.arange(64)[mine], 64 + torch.arange(64)[mine]])
        with torch.no_grad():
            attn.q.weight = torch.nn.Parameter(attn.q.weight[mine])
            attn.q.bias = torch.nn.Parameter(attn.q.bias[mine])
            attn.kv.weight = torch.nn.Parameter(attn.kv.weight[kv_rows])
            attn.kv.bias = torch.nn.Parameter(attn.kv.bias[kv_rows])
            attn.out.weight = torch.nn.Parameter(attn.out.weight[:, mine])
            attn.out.bias = torch.nn.Parameter(attn.out.bias * (t == 0))
            total += rank(x)
    assert torch.allclose(total, whole, rtol=1e-5, atol=1e-6)


def test_what_cannot_run_split_is_refused_naming_the_module_and_the_count() -> None:
    from partitioner.tp_graph import TensorParallelError
    from partitioner.tp_plan import check_tp_plan, resolve_tp_plan
    from partitioner.tp_graph import split_activations
    from smp.models import build

    gm, _, meta = _traced_block()
    with pytest.raises(TensorParallelError,
                       match=r"in module attn\) views attn_q with 4 \(heads, or features\).*tensor_parallel=8"):
        split_activations(gm, _splits(gm, _STYLES, 8), meta, 8)  # 64 features split 8 ways, 4 heads cannot be
    with pytest.raises(TensorParallelError, match="fused q/k/v or k/v Linear.*fused_colwise:N"):
        split_activations(gm, _splits(gm, dict(_STYLES, **{"attn.kv": "colwise"}), 2), meta, 2)
    with pytest.raises(TensorParallelError, match="rowwise and reads"):
        split_activations(gm, _splits(gm, {"attn.out": "rowwise"}, 2), meta, 2)
    model = build(GPT, seed=0).model
    with pytest.raises(TensorParallelError, match=r"'blocks\.\*\.mlp\.up', which matches no module of GPT"):
        check_tp_plan(model, {"blocks.*.mlp.up": "colwise"}, 2)
    with pytest.raises(TensorParallelError, match=r"module blocks\.0\.attn\.q has 64 output features.*=3 does not"):
        check_tp_plan(model, GPT_PLAN := resolve_tp_plan(model, None), 3)
    assert GPT_PLAN == type(model).tp_plan
    with pytest.raises(TensorParallelError, match="unknown style 'diagonal'"):
        check_tp_plan(model, {"blocks.*.fc": "diagonal"}, 2)
    with pytest.raises(TensorParallelError, match="a LayerNorm"):
        check_tp_plan(model, {"blocks.*.ln1": "colwise"}, 2)
    with pytest.raises(TensorParallelError, match="parameter lm_head.weight is tied to tok_emb.weight"):
        check_tp_plan(model, {"lm_head": "colwise"}, 2)


LLAMA = "hf-llama:size=tiny,kv_heads=2,batch=4"  # grouped-query attention: 4 query heads share 2 key/value heads


@pytest.mark.slow
def test_hf_llama_with_grouped_kv_heads_at_tp2_pp2_trains_as_one_process(tmp_path: Path) -> None:
    """Traced by torch.export (its linears are aten ops on the weights, made module calls again for DTensor); the
    tp plan is the config's base_model_tp_plan and the class's own (the LM head, "colwise_gather_output")."""
    pytest.importorskip("transformers")
    ranks = _run(tmp_path, LLAMA, world=4, stages=2, tp=2)
    assert {n for r in ranks for n in r["split"]} == {
        f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")} | {"lm_head.weight"}
    _check_exact(ranks, LLAMA, 2, 2, "llama tp2 x pp2")


def test_a_head_count_tp_does_not_divide_is_refused_before_any_collective() -> None:
    """Found from the model itself, before partitioning: the zoo's attention's heads, a Hugging Face config's
    grouped key/value heads (every projection's features divide by 4, the 2 key/value heads do not)."""
    import smp
    from runtime.errors import RuntimeConfigError
    from smp.models import build

    gpt = build("gpt:size=tiny,d_model=48,heads=6,batch=4", seed=0)
    with pytest.raises(RuntimeConfigError, match=r"attention module blocks\.0\.attn has 6 heads, which "
                                                 r"tensor_parallel=4 does not divide"):
        smp.partition(gpt.model, stages=1, tensor_parallel=4, loss_fn=gpt.loss_fn)
    pytest.importorskip("transformers")
    llama = build("hf-llama:size=tiny,d_model=48,heads=8,kv_heads=2,batch=4", seed=0)
    with pytest.raises(RuntimeConfigError, match=r"attention module model\.layers\.0\.self_attn has 2 num key "
                                                 r"value heads, which tensor_parallel=4 does not divide"):
        smp.partition(llama.model, stages=1, tensor_parallel=4, loss_fn=llama.loss_fn)


@pytest.mark.slow
def test_hf_llama_with_grouped_kv_heads_at_dp2_pp2_tp2_trains_as_one_process(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    ranks = _run(tmp_path, LLAMA, world=8, stages=2, tp=2)
    _check_exact(ranks, LLAMA, 4, 2, "llama dp2 x pp2 x tp2")


def test_a_fused_module_cut_into_other_than_its_projections_is_refused() -> None:
    """fused_colwise:4 on the 2-projection k/v: each rank would hold a quarter of each half, and its chunk(2) would
    give k and v the wrong heads (computed, silently wrong, before this was refused)."""
    from partitioner.tp_graph import TensorParallelError, split_activations

    gm, _, meta = _traced_block()
    with pytest.raises(TensorParallelError, match=r"cuts attn_kv into 2 .* 'fused_colwise:4' makes 4 projections"):
        split_activations(gm, _splits(gm, dict(_STYLES, **{"attn.kv": "fused_colwise:4"}), 2), meta, 2)


def test_a_device_search_with_a_given_tensor_parallel_degree_lays_out_d_x_p_x_t_devices() -> None:
    """devices=N with T given weighs the D x P shapes of N / T (an earlier search priced D x P = N at T = 1, and
    devices=4 with T = 2 planned D 4 x P 1 x T 2: 8 ranks)."""
    import smp

    built = smp.models.build(GPT)
    plan = smp.plan(built.model, built.example_args, devices=4, global_batch=4, tensor_parallel=2,
                    cluster="h100-sxm", timing="analytic")
    assert plan.tensor_parallel == 2
    assert plan.data_parallel * plan.pipeline_ranks * plan.tensor_parallel == 4


def test_a_hugging_face_models_lm_head_is_split_by_its_class_plan_unless_tied_to_the_embedding() -> None:
    """Hugging Face's own tensor parallelism applies the model class's ``_tp_plan`` too (the LM head,
    "colwise_gather_output": smp's colwise_rep), which left whole ran the vocabulary projection whole on every tp
    rank; a head tied to the embedding stays whole (a tied weight is not split)."""
    transformers = pytest.importorskip("transformers")
    from partitioner.tp_plan import resolve_tp_plan

    def llama(tied: bool) -> Any:
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
        return transformers.LlamaForCausalLM(config)

    assert resolve_tp_plan(llama(False), None)["lm_head"] == "colwise_rep"
    assert "lm_head" not in resolve_tp_plan(llama(True), None)
    assert resolve_tp_plan(llama(False), {"lm_head": "colwise_gather_output"}) == {"lm_head": "colwise_rep"}
