"""Failing together on real gloo process groups: one rank's failure reaches every other rank at once, with its
message; a collective call made on one rank only names the rank that did not come."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _launch import launch

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "_fault_workers.py"
#: Far above what a failure told through the store takes to arrive: a rank that waited it out failed the test.
TIMEOUT = 20.0
#: The collective calls' arrival deadline in these tests (ARRIVAL_DEADLINE is 30 s).
DEADLINE = 3.0


def _run(worker: str, world: int, tmp_path: Path, **kwargs: object) -> list[dict]:
    results = launch(f"{WORKERS}:{worker}", world, {"out": str(tmp_path), "timeout": TIMEOUT, **kwargs},
                     timeout=240, pg_timeout=2 * TIMEOUT)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_a_checkpoint_only_rank_0_cannot_read_stops_every_rank_with_its_message(tmp_path: Path) -> None:
    """The issue's case: rank 0 fails setting up (its stage's tensor is not in the checkpoint) and lives on; the
    others raise its message, not "rank 0 is dead or stuck" after the timeout."""
    from _fault_workers import _model

    state = _model().state_dict()
    del state["0.weight"]
    torch.save(state, tmp_path / "partial.pt")
    ranks = _run("setup_failure_worker", 3, tmp_path, checkpoint=str(tmp_path / "partial.pt"))
    assert ranks[0]["error"] == "RuntimeConfigError" and "has no tensor '0.weight'" in ranks[0]["message"], ranks[0]
    for r in ranks[1:]:
        assert r["error"] == "PipelineError", r
        assert r["message"].startswith("rank 0 failed: RuntimeConfigError: "), r
        assert "has no tensor '0.weight'" in r["message"] and "dead or stuck" not in r["message"], r


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_that_raises_in_a_step_and_lives_on_stops_the_others_at_once(victim: int, tmp_path: Path) -> None:
    """The failing rank raises the user's own error; the others its message, without waiting out the timeout."""
    ranks = _run("step_failure_worker", 3, tmp_path, victim=victim)
    assert ranks[victim] == {"error": "ValueError", "message": "injected failure"}
    for r, got in enumerate(ranks):
        if r == victim:
            continue
        assert got["error"] == "PipelineError", got
        assert f"rank {victim} raised ValueError: injected failure" in got["message"], got
        assert "timed out" not in got["message"], got


HINTS = {
    "prepare": "prepare() is collective: rank 1 did not call it within 3 s; call it on every rank",
    "state_dict": "state_dict() is collective: rank 1 did not call it within 3 s; call it on every rank, then save "
                  "on rank 0",
    "save_checkpoint": "save_checkpoint() is collective: rank 1 did not call it within 3 s; call it on every rank: "
                       "each writes its own tensors",
    "load_checkpoint": "load_checkpoint() is collective: rank 1 did not call it within 3 s; call it on every rank: "
                       "each reads its own tensors",
    "eval_forward": "pipe(x) is collective: rank 1 did not call it within 3 s; call it on every rank: its output "
                    "comes back on the rank holding the last stage (on every rank with broadcast_output=True)",
    "clip_grad_norm_": "clip_grad_norm_() is collective: rank 1 did not call it within 3 s; call it on every rank, "
                       "after step()",
}


@pytest.mark.slow
@pytest.mark.parametrize("call", list(HINTS))
def test_a_collective_called_on_rank_0_alone_names_the_rank_that_did_not_come(call: str, tmp_path: Path) -> None:
    """``if rank == 0: torch.save(pipe.state_dict(), ...)`` and its kin: rank 0 is told which rank did not call
    it, within the arrival deadline; a rank that went on to step() is told rank 0's message."""
    ranks = _run("one_rank_calls_worker", 2, tmp_path, call=call, deadline=DEADLINE)
    assert ranks[0] == {"error": "PipelineError", "message": HINTS[call]}
    if ranks[1].get("result") != "skipped":
        assert ranks[1]["error"] == "PipelineError", ranks[1]
        assert f"rank 0 failed: PipelineError: {HINTS[call]}" in ranks[1]["message"], ranks[1]
