"""Surviving a lost rank: a torchrun job restarted after a rank is killed resumes from its last checkpoint exactly."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import smp

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "resume_after_failure.py"


@dataclass
class _Run:
    """One torchrun job of the example, started in a session of its own: its process, log and result file."""

    proc: subprocess.Popen[bytes]
    log: Path
    out: Path

    def stop(self) -> None:
        """Kill the job (agent and ranks) if it is still running."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def finish(self) -> tuple[str, dict[str, Any]]:
        """Wait for the job; its output and what its rank 0 saved."""
        try:
            self.proc.wait(timeout=600)
        finally:
            self.stop()
        text = self.log.read_text()
        assert self.proc.returncode == 0, text[-6000:]
        return text, torch.load(self.out, weights_only=True)


def _torchrun(ranks: int, folder: Path, *args: str) -> _Run:
    """Start the example under ``torchrun --max-restarts 1`` (c10d rendezvous on a free port), writing in ``folder``."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    folder.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(folder / "log.txt", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                                 "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                 f"localhost:{port}", str(EXAMPLE), "--checkpoints", str(folder / "ckpt"), *args,
                                 "--out", str(folder / "result.pt")],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    return _Run(proc, folder / "log.txt", folder / "result.pt")


def _check_resumes_exactly(tmp_path: Path, ranks: int, *options: str, kill_at: int, kill_rank: int) -> None:
    """The same job uninterrupted and with ``kill_rank`` killed after step ``kill_at`` (both at once): the restarted
    attempt resumes from the last checkpoint before the kill, and every loss from there and every final weight
    are bit for bit the uninterrupted run's."""
    steps, every = 6, 2
    common = ["--steps", str(steps), "--save-every", str(every), *options]
    runs = [_torchrun(ranks, tmp_path / "whole", *common),
            _torchrun(ranks, tmp_path / "cut", *common, "--kill-at", str(kill_at), "--kill-rank", str(kill_rank))]
    try:
        (_, whole), (log, cut) = (run.finish() for run in runs)
    finally:
        for run in runs:
            run.stop()
    resumed_at = kill_at - kill_at % every
    assert f"attempt 1: resuming from step-{resumed_at} (step {resumed_at})" in log, log
    assert re.search(rf"attempt 0 step {kill_at}:", log) and not re.search(rf"attempt 0 step {kill_at + 1}:", log)
    assert sorted(cut["losses"]) == list(range(resumed_at + 1, steps + 1))
    for step, loss in cut["losses"].items():
        assert loss == whole["losses"][step], (step, loss, whole["losses"][step])
    assert whole["state"].keys() == cut["state"].keys()
    for name, tensor in whole["state"].items():
        assert torch.equal(tensor, cut["state"][name]), name


@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_last_checkpoint_bit_for_bit(tmp_path: Path) -> None:
    """2 stages on 2 gloo ranks, rank 1 killed after step 3 (after the step-2 save). Was: the group could not
    re-form in the restarted attempt (stale gloo addresses in torchrun's store), and the resumed run's dropout
    drew other masks (no RNG state in the checkpoint) and had no step to go on from."""
    _check_resumes_exactly(tmp_path, 2, kill_at=3, kill_rank=1)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "shard_grad_op"])
def test_a_killed_rank_of_a_replica_resumes_bit_for_bit(tmp_path: Path, sharding: str) -> None:
    """2 stages x 2 replicas on 4 gloo ranks, the second replica's last rank killed after step 3; the replicas
    all-reducing, or sharding optimizer state and gradients with FSDP2 (the checkpoint holds each rank's shards)."""
    _check_resumes_exactly(tmp_path, 4, "--stages", "2", "--sharding", sharding, kill_at=3, kill_rank=3)


def test_init_distributed_outside_torchrun_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(smp.LaunchError, match="not started by torchrun.*torchrun --nproc-per-node N"):
        smp.init_distributed()


def _pipe() -> tuple[smp.PipelinedModel, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    pipe = smp.partition(model, stages=2, microbatches=2, loss_fn=nn.functional.mse_loss, timing="analytic")
    x = torch.randn(4, 4)
    pipe.prepare(x)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=0.1), x


def test_a_checkpoint_brings_back_its_step_and_the_random_draws(tmp_path: Path) -> None:
    """Dropout after a resume draws what it would have drawn without the interruption."""
    pipe, opt, x = _pipe()
    pipe.save_checkpoint(tmp_path / "step-3", opt, step=3)
    expected = torch.rand(5)
    assert pipe.load_checkpoint(tmp_path / "step-3", opt) == 3
    assert torch.equal(torch.rand(5), expected)
    assert smp.latest_checkpoint(tmp_path) == tmp_path / "step-3"


def test_a_save_cut_short_leaves_no_checkpoint_under_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """A rank dying while the checkpoint is written: nothing appears under its name, latest_checkpoint keeps the
    previous one, and the next save of that name replaces the leftovers."""
    import torch.distributed.checkpoint as dcp

    pipe, opt, x = _pipe()
    assert smp.latest_checkpoint(tmp_path) is None
    pipe.save_checkpoint(tmp_path / "step-2", opt, step=2)
    real_save = dcp.save

    def dies_while_writing(state: dict[str, Any], checkpoint_id: str, **kwargs: Any) -> None:
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a tensor")
        raise RuntimeError("the rank died")

    monkeypatch.setattr(dcp, "save", dies_while_writing)
    with pytest.raises(RuntimeError, match="the rank died"):
        pipe.save_checkpoint(tmp_path / "step-4", opt, step=4)
    assert not (tmp_path / "step-4").exists()
    assert smp.latest_checkpoint(tmp_path) == tmp_path / "step-2"
    monkeypatch.setattr(dcp, "save", real_save)
    pipe.step(x, target=torch.zeros(4, 2))
    opt.step()
    pipe.save_checkpoint(tmp_path / "step-4", opt, step=4)
    pipe.save_checkpoint(tmp_path / "step-2", opt, step=2)  # a name saved again is replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]
    assert smp.latest_checkpoint(tmp_path) == tmp_path / "step-4"
    assert pipe.load_checkpoint(smp.latest_checkpoint(tmp_path), opt) == 4
