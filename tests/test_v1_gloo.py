"""smp.v1 on real gloo ranks: a v1-style script under torchrun (2 ranks, partitions=2) against plain PyTorch, and
checks on 2 ranks started as mpirun starts them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _v1_mnist as mnist  # noqa: E402

CONFIG = {"partitions": 2, "microbatches": 4, "pipeline": "interleaved", "timeout": 60}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
                **extra})
    return env


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int | None, str]]:
    """Wait for every process; kill the whole session of any still running after ``timeout`` seconds."""
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
        results.append((p.returncode, out))
    return results


def _reference(epochs: int, lr: float = 1.0, gamma: float = 0.7) -> tuple[list[float], list[float], torch.nn.Module]:
    """The script's model and data trained by plain PyTorch on one batch at a time."""
    torch.manual_seed(1)
    model = mnist.GroupedNet()
    opt = torch.optim.Adadelta(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
    train = DataLoader(mnist.random_mnist(256, seed=2), batch_size=32)
    losses, tests = [], []
    for _ in range(epochs):
        model.train()
        for x, y in train:
            opt.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        tests.append(_test_loss(model))
        scheduler.step()
    return losses, tests, model


def _test_loss(model: torch.nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        return sum(F.nll_loss(model(x), y, reduction="sum").item()
                   for x, y in DataLoader(mnist.random_mnist(64, seed=3), batch_size=32)) / 64


@pytest.mark.slow
def test_v1_script_under_torchrun_matches_plain_pytorch(tmp_path: Path) -> None:
    log = tmp_path / "log.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "_v1_mnist.py"), "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-json", str(log)]
    proc = subprocess.Popen(cmd, env=_env(SM_HP_MP_PARAMETERS=json.dumps(CONFIG)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    [(code, out)] = _finish([proc], timeout=300)
    assert code == 0, out[-4000:]
    got = json.loads(log.read_text())
    losses, tests, reference = _reference(epochs=2)
    assert len(got["train_losses"]) == 3 * len(losses) // 2
    for step, (a, b) in enumerate(zip(got["train_losses"], losses)):
        assert abs(a - b) <= 1e-5, f"step {step}: pipelined {a}, plain {b}"
    print(f"\n{len(losses)} steps against plain PyTorch: largest loss difference "
          f"{max(abs(a - b) for a, b in zip(got['train_losses'], losses)):.3g}; test losses pipelined "
          f"{got['test_losses']}, plain {tests}; reloaded {got['reloaded_test_loss']}")
    for a, b in zip(got["test_losses"], tests):
        assert abs(a - b) <= 1e-5
    # the partial checkpoint brought back the test loss it was saved at, after an epoch had moved it
    assert got["moved_test_loss"] != got["test_losses"][-1]
    assert abs(got["reloaded_test_loss"] - got["test_losses"][-1]) <= 1e-6
    # the full checkpoint (one file, from the gathered state) loads into the plain model
    reference.load_state_dict(torch.load(tmp_path / "ckpt" / "full.pt"))
    assert abs(_test_loss(reference) - got["test_losses"][-1]) <= 1e-5
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == \
        ["full.pt", "pt_mnist_checkpoint.pt_0", "pt_mnist_checkpoint.pt_1"]
    assert "into 2 stages on 2 ranks" in got["plan"]
    assert out.count("Train Epoch: 1 [0/256 (0%)]") == 1  # printed by rank 0 only, as the script says


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_v1_checks_on_ranks_started_like_mpirun(tmp_path: Path) -> None:
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(HERE / "_v1_checks.py"), str(tmp_path)],
                              env=_env(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2",
                                       OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE="2",
                                       MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in range(2)]
    for code, out in _finish(procs, timeout=180):
        assert code == 0, out[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert [(r["rank"], r["size"], r["local_rank"], r["pp_rank"], r["dp_size"]) for r in (r0, r1)] == \
        [(0, 2, 0, 0, 1), (1, 2, 1, 1, 1)]
    assert r0["allgather"] == r1["allgather"] == [0, 10]
    assert (r0["received"], r1["received"]) == ("hello from 1", {"from": 0})
    # manual partitions: each rank holds the module created in its smp.partition block
    assert (r0["local"], r1["local"]) == (["a.weight", "a.bias"], ["b.weight", "b.bias"])
    assert r0["loss"] == r1["loss"]  # the step's outputs reach every rank
    # an inf in rank 1's gradients only: both ranks skipped the step and backed off the same way
    assert not r0["stepped"] and not r1["stepped"] and r0["scale"] == r1["scale"] == 2.0**15
    # the evaluation function's error is the user's on the rank that ran it, and named on the other
    assert r1["eval_error"] == "ValueError: a bug in the evaluation function"
    assert r0["eval_error"].startswith("V1Error") and r0["eval_error"].endswith(r1["eval_error"])
    # state_dict() on rank 0 only: a clear error naming rank 1 after the 5 s timeout, not a hang
    assert "rank 1 did not call it within 5 s" in r0["state_dict_error"]
    assert r0["state_dict_waited"] < 30
