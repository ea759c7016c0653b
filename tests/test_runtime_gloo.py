"""The pipeline engine on real gloo process groups (2 and 4 local ranks): correctness and fault behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


from _launch import launch
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
    # SMP v1's active_microbatches: fewer microbatches in flight, the same gradients
    plans["1f1b-cap1"] = base.resimulate(active_microbatches=1)
    plans["gpipe-cap2"] = base.resimulate(schedule="gpipe", active_microbatches=2)
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
    # dp's plan sends the encoder output from stage 0 to stage 2 (what this test runs); auto's
    # moves find one that keeps it within neighbouring stages, which would test nothing here.
    plan = make_plan(spec, 3, 2, "gpipe", method="dp")
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


FAULT_TIMEOUT = 10.0


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1, 2])
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_dead_rank_stops_every_rank_with_its_name(how: str, victim: int) -> None:
    """The first, a middle or the last rank raises or is SIGKILLed mid-step: every survivor stops, names it,
    and does so within the timeout (measured from the start of the failing step)."""
    spec = "gpt:size=tiny,batch=4,layers=3"
    plan = make_plan(spec, 3, 4, "1f1b")
    results = launch(FAULT, 3, {"spec": spec, "plan": plan.to_dict(), "victim": victim, "how": how,
                                "timeout": FAULT_TIMEOUT}, timeout=120)
    for r in results:
        assert r.returncode is not None, f"rank {r.rank} hung (killed by the launcher)"
        if r.rank == victim:
            assert r.returncode != 0
            continue
        assert r.returncode == 3, f"rank {r.rank}: {r.stdout[-1500:]}\n{r.stderr[-1500:]}"
        error = next(line for line in r.stdout.splitlines() if line.startswith("SMP-ERROR"))
        assert error.startswith("SMP-ERROR PipelineError") and f"rank {victim}" in error, error
        stopped = float(next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("SMP-STOPPED")))
        assert stopped <= FAULT_TIMEOUT, f"rank {r.rank} took {stopped:.1f} s to stop (timeout {FAULT_TIMEOUT:g} s)"


USER = f"{HERE / '_runtime_common.py'}:user_model_worker"


def _user_case(case: str, world: int, tmp_path: Path, order: str = "train-first") -> list[dict]:
    results = launch(USER, world, {"case": case, "out": str(tmp_path), "order": order}, timeout=240)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return [torch.load(tmp_path / f"{case}-{order}-{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.slow
def test_an_output_made_on_stage_0_reaches_the_last_of_3_ranks(tmp_path: Path) -> None:
    import copy

    from _runtime_common import make_optimizer
    from _user_models import TwoTowers, two_towers_loss

    ranks = _user_case("two_towers", 3, tmp_path)
    assert ranks[0]["emb_stage"] == 0
    torch.manual_seed(0)
    model, x = TwoTowers(), (torch.randn(8, 16), torch.randn(8, 16))
    target = torch.randn(8)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(2):
        pieces = [(x[0][i * 4:(i + 1) * 4], x[1][i * 4:(i + 1) * 4], target[i * 4:(i + 1) * 4]) for i in range(2)]
        step_losses = []
        for a, b_, t in pieces:
            loss = two_towers_loss(model(a, b_), t)
            (loss / 2).backward()
            step_losses.append(loss.detach())
        losses.append(torch.stack(step_losses).mean())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    for r, res in enumerate(ranks):
        for got, want in zip(res["losses"], losses):
            assert torch.allclose(got, want, rtol=1e-5), (r, got, want)
        for n, g in res["grads"].items():
            assert torch.allclose(g, grads[n], rtol=1e-5, atol=1e-6), (r, n)
    with torch.no_grad():
        expected = copy.deepcopy(model)(*x)
    out = ranks[2]["forward"]
    assert out.keys() == expected.keys()
    for k in out:
        assert torch.allclose(out[k], expected[k], rtol=1e-5, atol=1e-6), k


@pytest.mark.slow
@pytest.mark.parametrize("case,order", [("train_eval", "train-first"), ("train_eval", "eval-first"),
                                        ("train_eval_hf", "train-first")])
def test_train_and_eval_alternate_on_two_ranks(case: str, order: str, tmp_path: Path) -> None:
    """Validation during training: eval forwards between steps, in both orders, on 2 ranks (fx and export)."""
    from smp.models import build

    from _user_models import Dropping

    ranks = _user_case(case, 2, tmp_path, order)
    evals = ranks[1]["evals"]  # the last rank returns the output
    assert len(evals) == (3 if order == "train-first" else 4)
    for i, e in enumerate(evals):
        state = ranks[0]["evals"][i]["state"]  # gathered on rank 0 at the same point
        torch.manual_seed(0)
        if case == "train_eval":
            model, x, kwargs = Dropping(), (torch.randn(8, 16),), {}
        else:
            b = build("hf-gpt2:size=tiny,batch=4", seed=0)
            model, x, kwargs = b.model, b.example_args, b.example_kwargs
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            want = model(*x, **kwargs)
        got_t, want_t = _logits(e["output"]), _logits(want)
        assert torch.allclose(got_t, want_t, rtol=1e-5, atol=1e-5), (i, (got_t - want_t).abs().max())


def _logits(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    return output["logits"]


@pytest.mark.slow
def test_the_loss_is_float32_on_every_rank(tmp_path: Path) -> None:
    ranks = _user_case("bf16", 2, tmp_path)
    assert [r["dtype"] for r in ranks] == ["torch.float32", "torch.float32"]


@pytest.mark.slow
def test_rank_0_plans_and_its_failure_is_named_on_every_rank(tmp_path: Path) -> None:
    """Lazy planning: rank 0 plans; when it cannot, rank 1 raises a PlanError with rank 0's reason (no hang);
    when it can, both ranks run the same plan."""
    results = launch(f"{HERE / '_runtime_common.py'}:rank0_planning_worker", 2, {"out": str(tmp_path)}, timeout=180)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    got = [torch.load(tmp_path / f"rank0-planning-{r}.pt", weights_only=False) for r in range(2)]
    assert got[0]["failed"].startswith("MemoryLimitError: memory limit 1 B per device"), got[0]["failed"]
    reason = got[0]["failed"]
    assert got[1]["failed"] == f"PlanError: rank 0 could not plan the model: {reason}"
    assert got[0]["plan"] == got[1]["plan"]
