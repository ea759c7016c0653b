"""Sharded data parallel (FSDP2 over the replicas) on gloo: 2 replicas x 2 stages train as one model on the global batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _launch import launch
from _runtime_common import assert_close_maps
from _sharding_checks import reference_run

HERE = Path(__file__).resolve().parent
WORKER = f"{HERE / '_sharding_checks.py'}:shard_worker"
SPEC = "gpt:size=tiny,batch=8"  # a tied embedding and LM head, on the first and last stage
STEPS = 3


def _run(tmp_path: Path, sharding: str, world: int = 4, stages: int = 2, **kw: Any) -> list[dict]:
    out = tmp_path / sharding
    out.mkdir()
    results = launch(WORKER, world, {"spec": SPEC, "stages": stages, "sharding": sharding, "out": str(out),
                                     "steps": STEPS, **kw}, timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: {r.stdout[-1500:]}\n{r.stderr[-3000:]}"
    return [torch.load(out / f"shard-{r}.pt", weights_only=False) for r in range(world)]


def _check_exact(ranks: list[dict], replicas: int, label: str) -> None:
    """Losses and (gathered) parameters after the AdamW steps equal the unpartitioned model's on the global batch."""
    ref = reference_run(SPEC, replicas * 2, STEPS)
    seen: set[str] = set()
    for r, res in enumerate(ranks):
        for i, (got, want) in enumerate(zip(res["losses"], ref["losses"])):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"{label} rank {r} step {i}: {got} != {want}"
        assert_close_maps(res["params"], ref["params"], f"{label} rank {r} params after {STEPS} AdamW steps",
                          per_tensor=True)
        seen |= set(res["params"])
    assert seen == set(ref["params"]), f"{label}: parameters missing {set(ref['params']) - seen}"


@pytest.mark.slow
def test_sharded_replicas_train_as_the_unpartitioned_model_with_a_sharded_optimizer(tmp_path: Path) -> None:
    plain = _run(tmp_path, "none")
    grads_only = _run(tmp_path, "shard_grad_op", recompute="full")
    _check_exact(plain, 2, "none")
    _check_exact(grads_only, 2, "shard_grad_op")
    for res in grads_only:
        assert res["sharding"] == "shard_grad_op" and res["recompute"] == ["full", "full"]
        assert set(res["dtensors"]) == {"DTensor"}, res["dtensors"]  # FSDP2 replaced them: sharded over dp
    for res in plain:
        assert set(res["dtensors"]) == {"Parameter"}
    # AdamW's state per rank is 1/D of the unsharded run's (D = 2; the tiny model's rows split evenly)
    by_place = {res["pp_rank"]: res["optimizer_bytes"] for res in plain}
    for res in grads_only:
        assert res["optimizer_bytes"] * 2 == by_place[res["pp_rank"]], (res["pp_rank"], res["optimizer_bytes"])


@pytest.mark.slow
def test_full_shard_with_interleaved_stages_and_selective_recomputation_is_exact(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "full_shard", schedule="interleaved", recompute="selective")
    _check_exact(ranks, 2, "full_shard")
    for res in ranks:
        assert res["sharding"] == "full_shard" and set(res["recompute"]) == {"selective"}
        assert set(res["dtensors"]) == {"DTensor"}
