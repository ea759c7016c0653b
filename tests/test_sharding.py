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


def _check_exact(ranks: list[dict], replicas: int, label: str, precision: str = "fp32") -> None:
    """Losses, clipped norms, (gathered) parameters after the AdamW steps and the eval output equal the
    unpartitioned model's on the global batch (fp32: to 1e-5; bf16: to one bf16 rounding)."""
    ref = reference_run(SPEC, replicas * 2, STEPS, precision)
    rtol = 1e-5 if precision == "fp32" else torch.finfo(torch.bfloat16).eps
    seen: set[str] = set()
    outputs = 0
    for r, res in enumerate(ranks):
        for i, (got, want) in enumerate(zip(res["losses"], ref["losses"])):
            assert torch.allclose(got, want, rtol=rtol, atol=1e-6), f"{label} rank {r} step {i}: {got} != {want}"
        for i, (got, want) in enumerate(zip(res["norms"], ref["norms"])):
            assert torch.allclose(got, want, rtol=rtol, atol=1e-6), f"{label} rank {r} norm {i}: {got} != {want}"
        assert_close_maps(res["params"], ref["params"], f"{label} rank {r} params after {STEPS} AdamW steps",
                          rtol=rtol, per_tensor=True)
        if res["eval"] is not None:  # the output stage's ranks: their replica's rows
            outputs += 1
            assert_close_maps({"eval": res["eval"].float()}, {"eval": ref["eval"][res["rows"]].float()},
                              f"{label} rank {r} eval output", rtol=rtol, per_tensor=True)
        seen |= set(res["params"])
    assert outputs == replicas, f"{label}: {outputs} eval outputs"
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
    # AdamW keeps two moments per parameter: unsharded, twice the rank's parameter bytes; sharded, 1/D of that
    # (D = 2; the tiny model's rows split evenly). By the rank's own parameters: the two runs' recomputation
    # differs, and so may their cuts.
    for res in plain:
        assert res["optimizer_bytes"] == 2 * res["param_bytes"], (res["pp_rank"], res["optimizer_bytes"])
    for res in grads_only:
        assert res["optimizer_bytes"] * 2 == 2 * res["param_bytes"], (res["pp_rank"], res["optimizer_bytes"])


@pytest.mark.slow
def test_full_shard_with_interleaved_stages_and_selective_recomputation_is_exact(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "full_shard", schedule="interleaved", recompute="selective")
    _check_exact(ranks, 2, "full_shard")
    for res in ranks:
        assert res["sharding"] == "full_shard" and set(res["recompute"]) == {"selective"}
        assert set(res["dtensors"]) == {"DTensor"}


@pytest.mark.slow
def test_bf16_under_shard_grad_op_matches_autocast(tmp_path: Path) -> None:
    _check_exact(_run(tmp_path, "shard_grad_op", precision="bf16"), 2, "shard_grad_op bf16", "bf16")


def _load(tmp_path: Path, label: str, sharding: str, stages: int, source: Path, target: Path) -> list[dict]:
    out = tmp_path / label
    out.mkdir()
    results = launch(f"{HERE / '_sharding_checks.py'}:load_worker", 4,
                     {"spec": SPEC, "stages": stages, "sharding": sharding, "checkpoint_from": str(source),
                      "checkpoint_to": str(target), "out": str(out)}, timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: {r.stdout[-1500:]}\n{r.stderr[-3000:]}"
    return [torch.load(out / f"load-{r}.pt", weights_only=False) for r in range(4)]


def _whole_optimizer_state(ranks: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    merged: dict[str, dict[str, torch.Tensor]] = {}
    for res in ranks:
        for name, state in res["optimizer"].items():
            if name in merged:  # replicas (and a tie's ranks) hold the same state
                for k, v in state.items():
                    assert torch.equal(v, merged[name][k]), (name, k)
            merged.setdefault(name, state)
    return merged


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: names {sorted(got)[:4]} != {sorted(want)[:4]}"
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"{what}: {name} differs"


@pytest.mark.slow
def test_state_dict_is_whole_and_checkpoints_reshard_across_modes_replicas_and_stages(tmp_path: Path) -> None:
    from smp.models import build

    first, second, third = tmp_path / "ck-2x2-full", tmp_path / "ck-1x4-none", tmp_path / "ck-2x2-again"
    trained = _run(tmp_path, "full_shard", checkpoint_to=str(first))
    state = trained[0]["state_dict"]
    model_state = build(SPEC, seed=0).model.state_dict()
    assert list(state) == list(model_state)  # the model's names, whole tensors, on rank 0
    for name, t in model_state.items():
        assert type(state[name]) is torch.Tensor and state[name].shape == t.shape, name
    for res in trained:
        for name, p in res["params"].items():
            assert torch.equal(state[name], p), name
    assert all(not res["state_dict"] for res in trained[1:])
    optim = _whole_optimizer_state(trained)

    # 2 replicas x 2 stages, full_shard -> 1 x 4 stages, none -> 2 x 2, full_shard: bit-equal every time
    unsharded = _load(tmp_path, "none-1x4", "none", 4, first, second)
    assert set(unsharded[0]["dtensors"]) == {"Parameter"}
    assert list(unsharded[0]["state_dict"]) == list(state)
    _assert_bit_equal(unsharded[0]["state_dict"], state, "loaded at 1x4 none")
    back = _load(tmp_path, "full-2x2", "full_shard", 2, second, third)
    assert set(back[0]["dtensors"]) == {"DTensor"}
    _assert_bit_equal(back[0]["state_dict"], state, "loaded back at 2x2 full_shard")
    for ranks, label in ((unsharded, "1x4 none"), (back, "2x2 full_shard")):
        got = _whole_optimizer_state(ranks)
        assert set(got) == set(optim), label
        for name in optim:
            _assert_bit_equal(got[name], optim[name], f"AdamW state of {name} at {label}")


@pytest.mark.slow
@pytest.mark.parametrize("replicas, stages, sharding", [(2, 4, "full_shard"), (4, 2, "shard_grad_op")])
def test_eight_ranks_are_exact(replicas: int, stages: int, sharding: str, tmp_path: Path) -> None:
    _check_exact(_run(tmp_path, sharding, world=replicas * stages, stages=stages), replicas,
                 f"{replicas} x {stages} {sharding}")


@pytest.mark.slow
def test_a_split_backward_schedule_is_refused_under_sharding(tmp_path: Path) -> None:
    results = launch(f"{HERE / '_sharding_checks.py'}:refusal_worker", 4,
                     {"spec": SPEC, "schedule": "zb-h1", "out": str(tmp_path)}, timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: {r.stdout[-1500:]}\n{r.stderr[-3000:]}"
        message = (tmp_path / f"refusal-{r.rank}.txt").read_text()
        assert "splits the backward" in message and "sharding='none'" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "shard_grad_op", "full_shard"])
def test_memory_stats_counts_the_shards_and_what_is_held_whole(tmp_path: Path, sharding: str) -> None:
    """Each rank's memory_stats under sharding: the optimizer step metered on DTensors, the shards of parameters,
    gradients and AdamW state, and what the step held whole (gathered parameters, unsharded gradients), or
    plain data parallelism's all-reduce buckets, in the total."""
    import json

    results = launch(f"{HERE / '_sharding_checks.py'}:memory_worker", 4,
                     {"spec": SPEC, "sharding": sharding, "out": str(tmp_path)}, timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: {r.stdout[-1500:]}\n{r.stderr[-3000:]}"
    for r in range(4):
        res = json.loads((tmp_path / f"memory-{r}.json").read_text())
        got, whole = res["stats"], res["whole"]
        shard = whole if sharding == "none" else whole // 2
        assert got["params"] == shard and got["grads"] == shard
        assert got["optimizer"] == 2 * shard + 4 * res["tensors"]  # exp_avg, exp_avg_sq; a float32 step each
        assert got["optimizer_step_peak"] > 0
        if sharding == "none":
            assert got["buckets"] == whole and "gathered_peak" not in got
            computing = got["activations_peak"]
        else:
            assert got["gathered_peak"] == whole and got["whole_grads_peak"] == whole and "buckets" not in got
            computing = got["activations_peak"] + 2 * whole
        # the activations a stage stashes do not depend on the sharding: the plan's, as unsharded (full_shard's
        # freed gathers once hid the activations later allocated at their addresses: 0.88 of the plan's)
        assert abs(got["activations_peak"] / res["planned_activations"] - 1) <= 0.01, (r, got, res)
        state = got["params"] + got["grads"] + got["optimizer"] + got["buffers"] + got.get("buckets", 0)
        assert got["total"] == state + max(computing, got["optimizer_step_peak"])
