"""smp.partition options: broadcast_output on gloo ranks, and the batch-shape rule of export-traced programs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import smp
from smp.models import build
from smp.partition import RuntimeConfigError

from _launch import launch

SPEC = "gpt:size=tiny,batch=4"
BROADCAST = f"{Path(__file__).resolve()}:broadcast_worker"


def broadcast_worker(rank: int, world: int, *, plan: dict, out: str) -> None:
    """One rank: a forward pass with and without broadcast_output; what this rank got, to ``out``."""
    got = {}
    for broadcast in (False, True):
        b = build(SPEC, seed=0)
        pipe = smp.partition(b.model, plan=smp.Plan.from_dict(plan), broadcast_output=broadcast, timeout=60)
        got[broadcast] = pipe(*b.example_args, **b.example_kwargs)
        got[f"out_rank-{broadcast}"] = pipe._engine.out_rank
    torch.save(got, Path(out) / f"broadcast-{rank}.pt")


@pytest.mark.slow
def test_broadcast_output_returns_the_output_on_every_rank(tmp_path: Path) -> None:
    b = build(SPEC, seed=0)
    plan = smp.plan(b.model, b.example_args, b.example_kwargs, stages=2, microbatches=2, timing="analytic")
    with torch.no_grad():
        reference = b.model(*b.example_args, **b.example_kwargs)
    results = launch(BROADCAST, 2, {"plan": plan.to_dict(), "out": str(tmp_path)}, timeout=120)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    ranks = [torch.load(tmp_path / f"broadcast-{r}.pt", weights_only=False) for r in range(2)]
    out_rank = ranks[0]["out_rank-False"]
    assert out_rank == 1 and all(g[f"out_rank-{flag}"] == out_rank for g in ranks for flag in (False, True))
    # without it only the rank holding the output stage gets the output
    assert ranks[0][False] is None
    torch.testing.assert_close(ranks[1][False], reference, rtol=1e-5, atol=1e-6)
    for got in ranks:  # with it every rank gets the same output
        torch.testing.assert_close(got[True], reference, rtol=1e-5, atol=1e-6)


def test_an_export_traced_pipeline_refuses_a_batch_of_another_shape_and_keeps_working() -> None:
    b = build(SPEC, seed=0)
    pipe = smp.partition(b.model, stages=2, microbatches=2, loss_fn=b.loss_fn,
                         frontend="export", timing="analytic")
    first = pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
    assert pipe.plan.model.frontend == "export"
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    (x,) = b.example_args
    for other, target in ((torch.cat([x, x]), torch.cat([b.target, b.target])),  # another batch size
                          (x[:, :16], b.target[:, :16])):  # another sequence length
        with pytest.raises(RuntimeConfigError, match=r"traced with torch.export, which fixes the shapes: it runs "
                                                     rf"microbatches of input shapes \[\(2, 32\)\], not "
                                                     rf"\[\({other.shape[0] // 2}, {other.shape[1]}\)\]\. "
                                                     r"Keep the batch shape fixed"):
            pipe.step(other, target=target)
    # refused before any work: no gradient was accumulated, and the traced shape still trains
    for name, p in pipe.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    pipe.zero_grad()
    again = pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
    torch.testing.assert_close(again, first)
