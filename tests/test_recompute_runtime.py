"""The runtime's recomputation and mixed precision on 2 gloo ranks: gradients unchanged, stashed bytes as planned,
bf16 as torch.autocast, an fp16 overflow on one rank skipping the step on all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partitioner.microbatch import split_microbatches
from smp.models import build

from _launch import launch
from _runtime_common import make_plan

HERE = Path(__file__).resolve().parent
COMMON = HERE / "_runtime_common.py"
SPEC = "gpt:size=tiny,batch=4,dropout=0.1"  # dropout: the rerun must draw the same masks
CHOICES = ("none", "selective", "full")
#: The rerun runs the same kernels on the same inputs: gradients agree to float32 rounding (in practice exactly).
RTOL, ATOL = 1e-6, 1e-7


def _run(worker: str, args: dict, tmp_path: Path) -> None:
    results = launch(f"{COMMON}:{worker}", 2, {**args, "out": str(tmp_path)}, timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


@pytest.mark.slow
def test_recomputation_keeps_gradients_and_stashes_what_the_plan_says(tmp_path: Path) -> None:
    base = make_plan(SPEC, 2, 4, "1f1b", recompute="none")
    bases = {"gpipe": base, "1f1b": base, "zb-h1": base, "interleaved": make_plan(SPEC, 2, 4, "interleaved",
                                                                                  recompute="none")}
    plans = {f"{sched}-{c}": b.resimulate(schedule=sched, recompute=c) for sched, b in bases.items() for c in CHOICES}
    _run("recompute_worker", {"spec": SPEC, "plans": {k: p.to_dict() for k, p in plans.items()}}, tmp_path)
    for label, plan in plans.items():
        sched, choice = label.rsplit("-", 1)
        assert plan.recompute == [choice] * plan.num_stages
        for rank in range(2):
            got = torch.load(tmp_path / f"{label}-{rank}.pt", weights_only=False)
            ref = torch.load(tmp_path / f"{sched}-none-{rank}.pt", weights_only=False)
            assert got["grads"] and set(got["grads"]) == set(ref["grads"])
            for name, g in got["grads"].items():
                assert torch.allclose(g, ref["grads"][name], rtol=RTOL, atol=ATOL), \
                    f"{label} rank {rank}: {name} differs by {(g - ref['grads'][name]).abs().max().item():.3g}"
            assert torch.allclose(got["loss"], ref["loss"], rtol=RTOL, atol=ATOL)
            predicted_peak = plan.simulated.peak_activation_bytes_per_rank[rank]
            for s in plan.schedule.stages_of(rank):
                kept, predicted = got["kept"][s], plan.partition.stages[s].activations
                assert abs(kept - predicted) <= 0.1 * predicted, (label, rank, s, kept, predicted)
                assert choice == "none" or kept < ref["kept"][s]  # recomputation stashes less, as planned
            assert abs(got["peak"] - predicted_peak) <= 0.1 * predicted_peak, (label, rank, got["peak"],
                                                                              predicted_peak)


def _autocast_reference(spec: str, microbatches: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unpartitioned model under torch.autocast(bf16), microbatch by microbatch (loss / m each)."""
    b = build(spec, seed=0)
    losses = []
    pieces = split_microbatches(b.example_args, b.example_kwargs, microbatches)
    targets = [t[0][0] for t in split_microbatches((b.target,), None, microbatches)]
    for (a, k), tgt in zip(pieces, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = b.loss_fn(b.model(*a, **k), tgt)
        (loss / microbatches).backward()
        losses.append(loss.detach().float())
    return torch.stack(losses).mean(), {n: p.grad for n, p in b.model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_bf16_matches_autocast_and_fp16_overflow_skips_every_rank(tmp_path: Path) -> None:
    spec = "gpt:size=tiny,batch=4"
    _run("precision_worker", {"spec": spec}, tmp_path)
    ranks = [torch.load(tmp_path / f"precision-{r}.pt", weights_only=False) for r in range(2)]
    ref_loss, ref_grads = _autocast_reference(spec, 2)
    eps = torch.finfo(torch.bfloat16).eps  # 2**-7: one bf16 rounding of a value, relative
    grads: dict[str, torch.Tensor] = {}
    for res in ranks:
        assert res["param_dtypes"] == {"torch.float32"}  # fp32 master weights
        assert "torch.bfloat16" in res["wire_dtypes"]  # a bf16 activation crosses the link as bf16
        for s, (kept, predicted) in res["kept"].items():  # planned under the same autocast
            if s != res["output_stage"]:  # (there the loss keeps an fp32 copy of bf16 logits: docs/memory.md)
                assert abs(kept - predicted) <= 0.1 * predicted, (s, kept, predicted)
        assert abs(res["bf16_loss"].item() - ref_loss.item()) <= eps * abs(ref_loss.item())
        grads.update(res["bf16_grads"])
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        r = ref_grads[name]
        assert g.dtype == torch.float32
        assert (g - r).abs().max().item() <= eps * r.abs().max().item(), name

    for rank, res in enumerate(ranks):
        assert res["local_overflow"] == [rank == 0, False], rank  # only rank 0's own gradients overflowed...
        assert res["skipped"] == [True, False], rank  # ...yet every rank skipped that step
        assert res["scales"] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15], rank
        before, after_skip, after_step = res["params"]
        for name, p in before.items():
            assert torch.equal(after_skip[name], p), f"rank {rank}: {name} changed on a skipped step"
        assert any(not torch.equal(after_step[n], p) for n, p in before.items()), rank


def test_every_choice_in_one_process_gives_the_same_gradients() -> None:
    """The single-process engine takes the same code path: full and selective against none, split backward too."""
    import smp

    from _runtime_common import pipeline_run

    base = make_plan(SPEC, 2, 2, "zb-h1", recompute="none")
    grads = {}
    for choice in CHOICES:
        b = build(SPEC, seed=0)
        torch.manual_seed(7)
        pipe = smp.partition(b.model, plan=base.resimulate(recompute=choice), loss_fn=b.loss_fn)
        grads[choice] = pipeline_run(pipe, SPEC, 1)["grads"]
        if choice != "none":  # a recomputing stage's rerun shows on the measured timeline
            assert "R" in {e.kind for e in pipe.timeline().events}
    for choice in ("selective", "full"):
        for name, g in grads["none"].items():
            assert torch.allclose(grads[choice][name], g, rtol=RTOL, atol=ATOL), (choice, name)


def test_precision_and_recompute_options_are_checked() -> None:
    import smp
    from smp.partition import RuntimeConfigError

    b = build("gpt:size=tiny,batch=4", seed=0)
    with pytest.raises(RuntimeConfigError, match="unknown precision 'fp8'"):
        smp.partition(b.model, precision="fp8")
    with pytest.raises(RuntimeConfigError, match="grad_scaler is for precision='fp16'"):
        from runtime.precision import PipelineGradScaler

        smp.partition(b.model, precision="bf16", grad_scaler=PipelineGradScaler())
    with pytest.raises(RuntimeConfigError, match="unknown recompute 'some'"):
        smp.partition(b.model, recompute="some")
    plan = make_plan("gpt:size=tiny,batch=4", 2, 2, "1f1b", recompute="none")
    with pytest.raises(RuntimeConfigError, match="disagrees with the plan"):
        smp.partition(b.model, plan=plan, recompute="full")
