"""A plan priced in bf16 counts what a mixed-precision run keeps: the profile walks under autocast, on meta too."""

import pytest
import torch
from torch import nn

from partitioner import profile
from partitioner.profile_autocast import walk_autocast
from smp.models import build

MODELS = ["gpt:layers=2,d_model=64,heads=4,vocab=128,seq_len=16,batch=2",  # fx; a tied embedding
          "hf-llama"]  # torch.export: device constants, get_attr weights, rotary buffers
FIELDS = ("out_bytes", "saved_bytes", "saved_output_bytes", "kernel_bytes", "kernel_saved_bytes", "params",
          "shared_bytes", "flops", "fwd", "bwd")


def _profile(bundle, **how):
    return profile(bundle.model, bundle.example_args, bundle.example_kwargs, timing="analytic",
                   device_profile="h100-sxm", **how)


@pytest.mark.parametrize("spec", MODELS)
def test_a_model_on_meta_priced_in_bf16_records_what_autocast_keeps_on_a_real_device(spec):
    if spec.startswith("hf-"):
        pytest.importorskip("transformers")
    # the runtime's own profile: real tensors, the stages' autocast around it, each op in its own dtype
    real = build(spec, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _profile(real)
    planned = _profile(build(spec, seed=0, meta=True), dtype="bf16")
    assert planned.meta["autocast"] == expected.meta["autocast"] == "bf16"
    assert set(planned.nx) == set(expected.nx)
    for node in expected.nx:
        for field in FIELDS:
            want = expected[node].get(field)
            got = planned[node].get(field)
            assert got == (want if want is None else pytest.approx(want, rel=1e-12, abs=0)), (node, field)
    # what autocast changes: the matmuls' outputs are bf16 (half the bytes of the fp32 walk)
    fp32 = _profile(build(spec, seed=0, meta=True))
    linears = [v for v in fp32.nx if fp32[v]["op"] in ("aten.linear.default", "linear", "torch._C._nn.linear")
               or fp32[v]["op"].endswith("Linear")]
    assert linears
    for v in linears:
        assert planned[v]["out_bytes"] * 2 == fp32[v]["out_bytes"], v


def test_bf16_on_a_real_model_walks_under_autocast_once():
    bundle = build(MODELS[0], seed=0)
    alone = _profile(bundle, dtype="bf16")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the runtime's: autocast already on, not entered twice
        within = _profile(bundle, dtype="bf16")
    assert alone.meta["autocast"] == within.meta["autocast"] == "bf16"
    for node in alone.nx:
        assert alone[node]["saved_bytes"] == within[node]["saved_bytes"], node
        assert alone[node]["out_bytes"] == within[node]["out_bytes"], node


def test_full_precision_and_measured_timing_walk_as_the_model_is():
    bundle = build(MODELS[0], seed=0, meta=True)
    for dtype in (None, "fp32"):
        graph = _profile(bundle, dtype=dtype)
        assert graph.meta["autocast"] is None
        assert all(graph[v]["out_bytes"] % 4 == 0 for v in graph.nx)
    assert walk_autocast("bf16", torch.device("meta")) is torch.bfloat16
    assert walk_autocast("fp16", torch.device("cpu")) is torch.float16
    assert walk_autocast("fp32", torch.device("cpu")) is None


def test_the_walk_on_fake_tensors_leaves_the_model_and_its_program_as_they_were():
    bundle = build(MODELS[0], seed=0, meta=True)
    before = {name: (p.device, p.dtype, p.requires_grad) for name, p in bundle.model.named_parameters()}
    graph = _profile(bundle, dtype="bf16")
    assert {name: (p.device, p.dtype, p.requires_grad) for name, p in bundle.model.named_parameters()} == before
    # the tied embedding (GPT's LM head reads it) is still counted once, and marked shared where read again
    assert graph.total_params == sum(p.numel() * 4 for p in bundle.model.parameters())
    shared = [v for v in graph.nx if graph[v]["shared_params"]]
    fp32 = _profile(bundle)
    assert shared == [v for v in fp32.nx if fp32[v]["shared_params"]] and len(shared) == 1
    assert graph[shared[0]]["shared_bytes"] == bundle.model.tok_emb.weight.numel() * 4


class _Scaled(nn.Module):
    """A Linear whose output is scaled by a plain tensor attribute: a constant of the traced program, no buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.scale = torch.full((16,), 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x) * self.scale)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_tensor_constant_is_walked_as_a_constant_not_as_state(frontend):
    # copying a GraphModule registers its tensor constants as buffers: the walk on fake tensors took the values
    # saved with them for state, and the mul that saves its activation recorded none (review)
    torch.manual_seed(0)
    real = _Scaled()
    with torch.device("meta"):
        meta = _Scaled()
    x = torch.randn(4, 16)

    def walk(model, inputs, **how):
        return profile(model, (inputs,), timing="analytic", device_profile="h100-sxm", frontend=frontend, **how)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = walk(real, x)
    planned = walk(meta, x.to("meta"), dtype="bf16")
    mul = next(v for v in expected.nx if "mul" in expected[v]["op"])
    # the constant's 64 bytes are counted once: state where fx registered it a buffer, else what the mul saves
    assert expected[mul]["saved_bytes"] + expected[mul]["buffers"] == 16 * 4
    for node in expected.nx:
        for field in ("saved_bytes", "out_bytes", "params", "buffers"):
            assert planned[node][field] == expected[node][field], (node, field)


def test_an_unknown_dtype_is_refused_naming_the_choices():
    from partitioner import PlanError
    from partitioner.request import PlanRequest

    assert PlanRequest.build(dtype="bfloat16").profiling.dtype == "bf16"
    with pytest.raises(PlanError, match="unknown dtype 'bf61'; choose one of fp64, fp32, bf16, fp16"):
        PlanRequest.build(dtype="bf61")


def _tiny_gpt(meta: bool = False):
    from smp.deferred import delay_param_initialization
    from smp.models.gpt import GPT

    torch.manual_seed(0)
    with delay_param_initialization(meta):
        return GPT(64, 32, 2, 4, 16)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), target.reshape(-1))


def test_a_plan_priced_for_bf16_runs_only_in_bf16():
    import smp
    from runtime.errors import RuntimeConfigError

    model, x = _tiny_gpt(), torch.randint(0, 64, (4, 16))
    bf16 = smp.plan(model, (x,), stages=2, microbatches=2, timing="analytic", dtype="bf16")
    with pytest.raises(RuntimeConfigError, match="priced for a bf16 mixed-precision run .* precision='fp32': pass "
                                                 "precision='bf16'"):
        smp.partition(model, plan=bf16, loss_fn=_cross_entropy)
    smp.partition(model, plan=bf16, loss_fn=_cross_entropy, precision="bf16")
    # a plan priced in full precision counted more than any precision holds: it runs in bf16 too
    fp32 = smp.plan(model, (x,), stages=2, microbatches=2, timing="analytic")
    smp.partition(model, plan=fp32, loss_fn=_cross_entropy, precision="bf16")


def test_a_model_on_meta_planned_by_its_bf16_pipeline_is_priced_as_its_stages_run():
    # the pipeline's own plan profiles under the stages' autocast, which does nothing to meta tensors: the model
    # built on meta (deferred initialization) was priced at fp32 widths (review)
    import smp

    x = torch.randint(0, 64, (4, 16))
    plans = {}
    for meta in (False, True):
        pipe = smp.partition(_tiny_gpt(meta), stages=2, microbatches=2, loss_fn=_cross_entropy, precision="bf16",
                             timing="analytic")
        plans[meta] = pipe.prepare(x).plan  # planned (and materialized) on the sample, as the first step would
    real, planned = plans[False], plans[True]
    assert real.graph.meta["autocast"] == planned.graph.meta["autocast"] == "bf16"
    for node in real.graph.nx:
        assert planned.graph[node]["saved_bytes"] == real.graph[node]["saved_bytes"], node
        assert planned.graph[node]["out_bytes"] == real.graph[node]["out_bytes"], node
