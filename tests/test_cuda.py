"""CUDA paths: whole-model timing that waits for the GPU, the runtime with every stage in one process in bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import smp
from partitioner import profile
from partitioner.profile_measured import time_whole_model
from smp.models import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_time_whole_model_waits_for_the_gpu() -> None:
    # Eight 4096^3 matrix products take milliseconds on any GPU, their launches microseconds: a clock
    # read without synchronising would see the launches only.
    dev = torch.device("cuda")
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(8)]).to(dev)
    x = torch.randn(4096, 4096, device=dev)
    fwd, _ = time_whole_model(model, (x,), repeats=3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.no_grad():
        model(x)
        start.record()
        model(x)
        end.record()
    end.synchronize()
    kernels = start.elapsed_time(end) / 1e3
    assert fwd >= 0.5 * kernels, (fwd, kernels)


def test_runtime_in_one_process_on_the_gpu_in_bf16_matches_the_whole_model() -> None:
    dev = torch.device("cuda")
    b = build("gpt:layers=4,d_model=256,heads=4,seq_len=128,vocab=1024,batch=8", device=dev, seed=0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = b.loss_fn(b.model(*b.example_args), b.target)
    ref.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in b.model.named_parameters()}
    b.model.zero_grad(set_to_none=True)
    pipe = smp.partition(b.model, stages=2, microbatches=4, loss_fn=b.loss_fn, device=dev, precision="bf16")
    loss = pipe.step(*b.example_args, target=b.target)
    # bf16 keeps 8 significant bits: the same sums split into microbatches differ by rounding, ~2^-8 relative.
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=2 ** -7)
    num = sum(float((p.grad - ref_grads[n]).norm()) ** 2 for n, p in b.model.named_parameters())
    den = sum(float(g.norm()) ** 2 for g in ref_grads.values())
    assert (num / den) ** 0.5 < 2 ** -4
    assert all(p.device.type == "cuda" for p in b.model.parameters())
    stats = pipe.memory_stats()
    assert all(s["cuda_max_allocated"] > 0 for s in stats.values())


def test_measured_profile_adds_up_to_the_whole_model_on_the_gpu() -> None:
    # Events around each call timed the op's launch too (the GPU idle while the CPU dispatched it): GPT-2
    # base's per-op sums came to 2.0x (forward) and 2.7x (backward) the whole model on an H200.
    b = build("gpt:layers=4,d_model=768,heads=12,seq_len=1024,vocab=8192,batch=8", device="cuda",
              dtype=torch.bfloat16)
    graph = profile(b.model, b.example_args, b.example_kwargs)
    fwd, bwd = time_whole_model(b.model, b.example_args, b.example_kwargs)
    assert 0.3 * fwd < graph.total_fwd < 1.3 * fwd, (graph.total_fwd, fwd)
    assert 0.3 * bwd < graph.total_bwd < 1.3 * bwd, (graph.total_bwd, bwd)
