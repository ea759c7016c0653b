"""A plan priced in bf16 counts what a mixed-precision run keeps: the profile's walk runs under autocast, on meta too."""

import pytest
import torch

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
    assert planned.meta["autocast"] == "bf16" and expected.meta["autocast"] is None
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
    assert alone.meta["autocast"] == "bf16" and within.meta["autocast"] is None
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
