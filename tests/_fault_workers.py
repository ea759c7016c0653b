"""Rank workers of tests/test_faults_together.py: one rank fails, or skips a collective call, and lives on."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp.partition import partition

BATCH = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 8, generator=g)


def _pipe(world: int, timeout: float, arrival_deadline: float, **options: Any) -> Any:
    return partition(_model(), loss_fn=_loss, stages=world, microbatches=2, timing="analytic", timeout=timeout,
                     arrival_deadline=arrival_deadline, **options)


def _outcome(call: Any) -> dict[str, Any]:
    try:
        result = call()
    except Exception as err:  # noqa: BLE001 - what each rank was told is the result
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None, "result": None if result is None else type(result).__name__}


def _finish(rank: int, world: int, out: str, res: dict[str, Any], wait: float) -> None:
    """Write this rank's outcome, then stay alive until every rank has written its own (at most ``wait`` s): a
    rank that failed lives on, so its peers cannot learn of it from closed connections at its exit."""
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/done/{rank}", "1")
    try:
        store.wait([f"test/done/{r}" for r in range(world)], datetime.timedelta(seconds=wait))
    except Exception:  # noqa: BLE001 - a peer still stuck: the test reads what was written
        pass


def setup_failure_worker(rank: int, world: int, *, out: str, checkpoint: str, timeout: float) -> None:
    """Every rank loads ``checkpoint``, which lacks a tensor only rank 0's stage holds."""
    x, y = _batch()
    pipe = _pipe(world, timeout, timeout, checkpoint=checkpoint)
    _finish(rank, world, out, _outcome(lambda: pipe.step(x, target=y)), 3 * timeout)


def step_failure_worker(rank: int, world: int, *, out: str, victim: int, timeout: float) -> None:
    """Rank ``victim`` raises in its stage's forward during the second step, and lives on."""
    x, y = _batch()
    pipe = _pipe(world, timeout, timeout)
    pipe.step(x, target=y)
    if rank == victim:
        stages = pipe._engine.split.stages
        stage = stages[next(iter(stages))]

        def failing(*args: Any, **kwargs: Any) -> Any:
            raise ValueError("injected failure")

        stage.gm.forward = failing
    res = _outcome(lambda: pipe.step(x, target=y))
    _finish(rank, world, out, res, 3 * timeout)


#: The collective calls, each as made on a pipeline already set up by a first step (but "prepare", made instead of
#: that step).
_CALLS = {
    "prepare": lambda pipe, x, y, d: pipe.prepare(x),
    "state_dict": lambda pipe, x, y, d: pipe.state_dict(),
    "save_checkpoint": lambda pipe, x, y, d: pipe.save_checkpoint(d),
    "load_checkpoint": lambda pipe, x, y, d: pipe.load_checkpoint(d),
    "eval_forward": lambda pipe, x, y, d: pipe.eval()(x),
    "clip_grad_norm_": lambda pipe, x, y, d: pipe.clip_grad_norm_(1.0),
}


def one_rank_calls_worker(rank: int, world: int, *, out: str, call: str, timeout: float, deadline: float) -> None:
    """Rank 0 makes collective ``call`` alone; the others go on to the next step (as after
    ``if rank == 0: torch.save(pipe.state_dict(), ...)``), or, for a forward, wait."""
    x, y = _batch()
    pipe = _pipe(world, timeout, deadline)
    directory = str(Path(out) / "ckpt")
    if call != "prepare":
        pipe.step(x, target=y)
    if call == "load_checkpoint":
        pipe.save_checkpoint(directory)
    if rank == 0:
        res = _outcome(lambda: _CALLS[call](pipe, x, y, directory))
    elif call in ("prepare", "eval_forward"):  # nothing else to do: the others only wait
        res = {"error": None, "result": "skipped"}
    else:
        res = _outcome(lambda: pipe.step(x, target=y))
    _finish(rank, world, out, res, 3 * timeout)
