"""One plan for every rank: made on rank 0 alone (measured profiles differ between ranks), shared through the store."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from partitioner.plan import Plan, PlanError
from runtime.errors import PipelineError
from runtime.faults import FailureNote, wait_watching

__all__ = ["plan_on_rank0", "PLANNING_WAIT"]

#: How long the other ranks wait at least for rank 0 to trace, profile and plan the model (seconds).
PLANNING_WAIT = 3600.0

#: This process's planning keys: every rank plans its pipelines in the same order, so the n-th is the same key.
_KEYS = itertools.count()


def plan_on_rank0(build: Callable[[], Plan], *, rank: int, store: dist.Store | None, timeout: float,
                  key: str | None = None, note: FailureNote | None = None) -> Plan:
    """``build()`` on rank 0, its plan on every rank (``store`` None: one process, which builds it).

    Rank 0 writes its plan, or why it failed, under ``key`` (default: this process's next
    planning key) and re-raises its own error. The others wait at most the larger of
    ``timeout`` (the caller's bound on a wait for a peer) and ``PLANNING_WAIT``, and raise
    :class:`PlanError` naming rank 0: its error, or that it got stuck or died (a store on rank 0
    dies with it; the wait is bounded either way). A failure another rank publishes on ``note``
    meanwhile ends the wait at once (:class:`PipelineError` with its message). Every rank,
    rank 0 included, runs the plan read back from its dict, so all run the same.
    """
    if store is None:
        return build()
    key = key if key is not None else f"smp/plan/{next(_KEYS)}"
    wait = max(PLANNING_WAIT, timeout)
    if rank == 0:
        try:
            payload: dict[str, Any] = {"plan": build().to_dict()}
        except Exception as err:  # noqa: BLE001 - every rank must learn that planning failed
            store.set(key, pickle.dumps({"error": f"{type(err).__name__}: {err}"}))
            raise
        store.set(key, pickle.dumps(payload))
    else:
        try:
            if not wait_watching(lambda: store.check([key]), wait, note, rank, "rank 0 to plan the model"):
                raise TimeoutError(f"no plan after {wait:g} s")
            payload = pickle.loads(store.get(key))
        except PipelineError:
            raise
        except Exception as err:  # noqa: BLE001 - a timeout, or the store's host died
            raise PlanError(f"rank {rank} gave up waiting for rank 0 to plan the model (at most {wait:g} s; "
                            f"{type(err).__name__}: {err}): rank 0 is stuck or died") from None
        if "error" in payload:
            raise PlanError(f"rank 0 could not plan the model: {payload['error']}")
    return Plan.from_dict(payload["plan"])
