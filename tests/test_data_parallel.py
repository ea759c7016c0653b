"""Data parallel x pipeline on gloo: D replicas of a P-rank pipeline train as one model on the global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


from _launch import launch
from _runtime_common import check_data_parallel, make_plan

HERE = Path(__file__).resolve().parent
WORKER = f"{HERE / '_runtime_common.py'}:data_parallel_worker"
FAULT = f"{HERE / '_runtime_common.py'}:fault_worker"
FAULT_TIMEOUT = 10.0


def _run(world: int, stages: int, schedule: str, tmp_path: Path, spec: str, **kw) -> list[dict]:
    results = launch(WORKER, world, {"spec": spec, "stages": stages, "schedule": schedule, "out": str(tmp_path),
                                     **kw}, timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: {r.stdout[-1500:]}\n{r.stderr[-3000:]}"
    return [torch.load(tmp_path / f"dp-{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_two_replicas_of_two_stages(schedule: str, tmp_path: Path) -> None:
    spec = "gpt:size=tiny,batch=8"  # a tied embedding and LM head, on the two stages
    check_data_parallel(_run(4, 2, schedule, tmp_path, spec), spec, 2)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_three_replicas_of_two_stages(placement: str, tmp_path: Path) -> None:
    spec = "gpt:size=tiny,batch=12"
    check_data_parallel(_run(6, 2, "1f1b", tmp_path, spec, placement=placement), spec, 3)


@pytest.mark.slow
@pytest.mark.parametrize(("victim", "how"), [(2, "raise"), (3, "kill")])
def test_a_dead_rank_in_replica_1_stops_replica_0(victim: int, how: str) -> None:
    """Ranks 0-1 are replica 0, ranks 2-3 replica 1 ("cluster"): a rank of replica 1 raises or is SIGKILLed
    mid-step; every rank of both replicas stops within the timeout and names it (none hangs in an all-reduce)."""
    spec = "gpt:size=tiny,batch=4,layers=3"
    plan = make_plan(spec, 2, 4, "1f1b", data_parallel=2, placement="cluster")
    results = launch(FAULT, 4, {"spec": spec, "plan": plan.to_dict(), "victim": victim, "how": how,
                                "timeout": FAULT_TIMEOUT}, timeout=120)
    for r in results:
        assert r.returncode is not None, f"rank {r.rank} hung (killed by the launcher)"
        if r.rank == victim:
            assert r.returncode != 0
            continue
        assert r.returncode == 3, f"rank {r.rank}: {r.stdout[-1500:]}\n{r.stderr[-1500:]}"
        error = next(line for line in r.stdout.splitlines() if line.startswith("SMP-ERROR"))
        assert error.startswith("SMP-ERROR PipelineError") and f"rank {victim}" in error, (r.rank, error)
        stopped = float(next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("SMP-STOPPED")))
        assert stopped <= FAULT_TIMEOUT, f"rank {r.rank} took {stopped:.1f} s to stop (timeout {FAULT_TIMEOUT:g} s)"


@pytest.mark.slow
@pytest.mark.parametrize("broadcast", [True, False])
def test_replicas_start_each_step_from_the_first_replicas_buffers(broadcast: bool, tmp_path: Path) -> None:
    results = launch(f"{HERE / '_runtime_common.py'}:buffer_worker", 2,
                     {"out": str(tmp_path), "broadcast_buffers": broadcast}, timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: {r.stderr[-3000:]}"
    a, b = (torch.load(tmp_path / f"buf-{r}.pt") for r in range(2))
    stats = [n for n in a if n.endswith("running_mean")]
    assert stats
    same = all(torch.equal(a[n], b[n]) for n in stats)
    assert same == broadcast  # without the broadcast, each replica keeps its own statistics


@pytest.mark.slow
def test_a_parameter_no_gradient_reaches_keeps_none_with_replicas(tmp_path: Path) -> None:
    """As with one replica (and DDP): a parameter that gets no gradient on any replica is sent as zeros in its
    bucket but left without one after the step, so that an optimizer with momentum or weight decay skips it.
    Was: it kept the zeros, and AdamW moved it under data parallelism only."""
    results = launch(f"{HERE / '_runtime_common.py'}:unused_parameter_worker", 2, {"out": str(tmp_path)}, timeout=120)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: {r.stderr[-3000:]}"
    for rank in range(2):
        missing = torch.load(tmp_path / f"unused-{rank}.pt")
        assert missing["0.spare"] is True and not any(v for n, v in missing.items() if n != "0.spare"), missing
