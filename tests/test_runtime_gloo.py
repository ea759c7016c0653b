"""The pipeline engine on real gloo process groups (2 and 4 local ranks): correctness and fault behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.launch import launch

from _runtime_common import check_against_reference, make_plan, reference_run

HERE = Path(__file__).resolve().parent
WORKER = f"{HERE / '_runtime_common.py'}:train_worker"
FAULT = f"{HERE / '_runtime_common.py'}:fault_worker"
STEPS = 5


def _launch_and_check(spec: str, world: int, plans: dict, tmp_path: Path, timeout: float = 240.0,
                      check_state: bool = False) -> dict:
    results = launch(WORKER, world, {"spec": spec, "plans": {k: p.to_dict() for k, p in plans.items()},
                                     "out": str(tmp_path), "steps": STEPS, "check_state": check_state},
                     timeout=timeout)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    out = {}
    for label, plan in plans.items():
        ranks = [torch.load(tmp_path / f"{label}-{r}.pt", weights_only=False) for r in range(world)]
        check_against_reference(ranks, reference_run(spec, plan.microbatches, STEPS), f"{spec} {label} x{world}")
        out[label] = ranks
    return out


@pytest.mark.slow
def test_gpt_two_ranks_all_schedules(tmp_path: Path) -> None:
    spec = "gpt:size=tiny,batch=4"
    base = make_plan(spec, 2, 4, "1f1b")
    plans = {s: base.resimulate(schedule=s) for s in ("gpipe", "1f1b", "zb-h1")}
    plans["interleaved"] = make_plan(spec, 2, 4, "interleaved")
    ranks = _launch_and_check(spec, 2, plans, tmp_path, check_state=True)
    # state_dict gathers to rank 0 and loads into the original model, reproducing the pipeline's output
    from smp.models import build

    res0 = ranks["1f1b"][0]
    assert ranks["1f1b"][1]["state"] == {}
    model = build(spec, seed=5).model  # other initial weights: everything must come from the state dict
    model.load_state_dict(res0["state"])
    with torch.no_grad():
        expected = model(*build(spec, seed=0).example_args)
    out_rank = base.schedule.stage_to_rank[-1]
    assert torch.allclose(ranks["1f1b"][out_rank]["forward"], expected, rtol=1e-5, atol=1e-6)


def _long_edges(plan) -> list:
    return [t for t in plan.partition.transfers if t.dst_stage - t.src_stage >= 2]


@pytest.mark.slow
def test_unet_resnet_on_gloo(tmp_path: Path) -> None:
    """U-Net (skips across 2+ stages on 3 ranks) and ResNet (BatchNorm, train mode) on real gloo."""
    unet = make_plan("unet:size=tiny,batch=4", 3, 2, "1f1b")
    assert _long_edges(unet), "the U-Net plan should send a skip connection past a stage"
    _launch_and_check("unet:size=tiny,batch=4", 3, {"1f1b": unet}, tmp_path)
    _launch_and_check("resnet:size=tiny,batch=4", 2,
                      {"zb-h1": make_plan("resnet:size=tiny,batch=4", 2, 2, "zb-h1")}, tmp_path)


@pytest.mark.slow
def test_t5_cross_edges_on_gloo(tmp_path: Path) -> None:
    """T5: the encoder's output feeds every decoder layer, across the cut, forward and backward."""
    spec = "t5:size=tiny,batch=4,dec_layers=4"
    plan = make_plan(spec, 3, 2, "gpipe")
    assert _long_edges(plan), "the T5 plan should send the encoder output past a stage"
    _launch_and_check(spec, 3, {"gpipe": plan}, tmp_path)


@pytest.mark.slow
def test_hf_models_two_ranks(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    for spec in ("hf-gpt2:size=tiny,batch=4", "hf-t5:size=tiny,batch=4"):
        _launch_and_check(spec, 2, {"1f1b": make_plan(spec, 2, 2, "1f1b")}, tmp_path)


@pytest.mark.slow
def test_gpt_four_ranks(tmp_path: Path) -> None:
    spec = "gpt:size=tiny,batch=4,layers=4"
    plans = {"1f1b": make_plan(spec, 4, 4, "1f1b"), "interleaved": make_plan(spec, 4, 4, "interleaved")}
    _launch_and_check(spec, 4, plans, tmp_path, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_dead_rank_stops_every_rank_with_its_name(how: str) -> None:
    spec = "gpt:size=tiny,batch=4,layers=3"
    plan = make_plan(spec, 3, 4, "1f1b")
    victim = 1
    results = launch(FAULT, 3, {"spec": spec, "plan": plan.to_dict(), "victim": victim, "how": how, "timeout": 10.0},
                     timeout=120)
    for r in results:
        assert r.returncode is not None, f"rank {r.rank} hung (killed by the launcher)"
        if r.rank == victim:
            assert r.returncode != 0
            continue
        assert r.returncode == 3, f"rank {r.rank}: {r.stdout[-1500:]}\n{r.stderr[-1500:]}"
        assert "SMP-ERROR PipelineError" in r.stdout and f"rank {victim}" in r.stdout, r.stdout[-1500:]
        assert r.seconds < 60, f"rank {r.rank} took {r.seconds:.1f} s to stop"
