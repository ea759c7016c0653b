"""smp.v1 on real gloo ranks: a v1-style script under torchrun against plain PyTorch (2 ranks, partitions=2; 4 ranks,
partitions=2 and ddp=true), data-parallel checks on 4 ranks (layouts, buffers, checkpoints), and checks on 2 ranks started as
mpirun starts them."""

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


def _reference(epochs: int, lr: float = 1.0, gamma: float = 0.7, steps: int | None = None
               ) -> tuple[list[float], list[float], torch.nn.Module]:
    """The script's model and data trained by plain PyTorch on one batch at a time (the first ``steps`` only)."""
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
            if len(losses) == steps:
                return losses, tests, model
        tests.append(_test_loss(model))
        scheduler.step()
    return losses, tests, model


def _test_loss(model: torch.nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        return sum(F.nll_loss(model(x), y, reduction="sum").item()
                   for x, y in DataLoader(mnist.random_mnist(64, seed=3), batch_size=32)) / 64


def _run_mnist(tmp_path: Path, nproc: int, config: dict, batch_size: int) -> tuple[dict, str]:
    """The v1 MNIST script under torchrun: rank 0's log and everyone's output."""
    log = tmp_path / "log.json"
    (tmp_path / "ranks").mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(HERE / "_v1_mnist.py"), "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-json", str(log),
           "--batch-size", str(batch_size), "--ranks-dir", str(tmp_path / "ranks"),
           "--first-step-state", str(tmp_path / "first_step.pt")]
    proc = subprocess.Popen(cmd, env=_env(SM_HP_MP_PARAMETERS=json.dumps(config)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    [(code, out)] = _finish([proc], timeout=300)
    assert code == 0, out[-4000:]
    return json.loads(log.read_text()), out


def _check_against_plain_pytorch(got: dict, tmp_path: Path) -> None:
    """Every step's loss (of the global batch) and the test losses as plain PyTorch's on the same batches; the
    parameters after the first step are plain PyTorch's; the partial checkpoint reloads; the full one loads into the
    plain model with the same test loss."""
    losses, tests, reference = _reference(epochs=2)
    assert len(got["train_losses"]) == 3 * len(losses) // 2
    for step, (a, b) in enumerate(zip(got["train_losses"], losses)):
        assert abs(a - b) <= 1e-5, f"step {step}: pipelined {a}, plain {b}"
    # the parameters after the first step: Adadelta's first update is lr * sqrt(eps) * g / sqrt(0.1 g^2 + eps),
    # at most 1:1 in g, so float32 gradients summed in another order move them by well under 1e-6
    first = torch.load(tmp_path / "first_step.pt")
    stepped = _reference(epochs=1, steps=1)[2].state_dict()
    assert sorted(first) == sorted(stepped)
    worst = max((first[n] - p).abs().max().item() for n, p in stepped.items())
    print(f"\n{len(losses)} steps against plain PyTorch: largest loss difference "
          f"{max(abs(a - b) for a, b in zip(got['train_losses'], losses)):.3g}, largest parameter difference after "
          f"the first step {worst:.3g}; test losses pipelined {got['test_losses']}, plain {tests}; reloaded "
          f"{got['reloaded_test_loss']}")
    assert worst <= 1e-6
    full = torch.load(tmp_path / "ckpt" / "full.pt")
    for a, b in zip(got["test_losses"], tests):
        assert abs(a - b) <= 1e-5
    # the partial checkpoint brought back the test loss it was saved at, after an epoch had moved it
    assert got["moved_test_loss"] != got["test_losses"][-1]
    assert abs(got["reloaded_test_loss"] - got["test_losses"][-1]) <= 1e-6
    reference.load_state_dict(full)
    assert abs(_test_loss(reference) - got["test_losses"][-1]) <= 1e-5
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == \
        ["full.pt", "pt_mnist_checkpoint.pt_0", "pt_mnist_checkpoint.pt_1"]


@pytest.mark.slow
def test_v1_script_under_torchrun_matches_plain_pytorch(tmp_path: Path) -> None:
    got, out = _run_mnist(tmp_path, 2, CONFIG, batch_size=32)
    _check_against_plain_pytorch(got, tmp_path)
    assert "into 2 stages on 2 ranks" in got["plan"]
    assert out.count("Train Epoch: 1 [0/256 (0%)]") == 1  # printed by rank 0 only, as the script says


#: v1's documented layouts (its "Ranking Basics"), for 4 ranks and 2 partitions: the model replicas (mp groups)
#: and the replicas of each partition (dp groups).
LAYOUTS = {"cluster": {"mp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]},
           "spread": {"mp": [[0, 2], [1, 3]], "dp": [[0, 1], [2, 3]]}}


def _check_layout(directory: Path, placement: str) -> None:
    """Every rank's helpers give v1's documented layout, and smp's pipeline put the rank where they say."""
    layout = LAYOUTS[placement]
    for r in range(4):
        h = json.loads((directory / f"rank{r}.json").read_text())
        mp = next(g for g in layout["mp"] if r in g)
        dp = next(g for g in layout["dp"] if r in g)
        assert (h["rank"], h["size"], h["local_rank"], h["local_size"]) == (r, 4, r, 4)
        assert (h["pp_size"], h["mp_size"], h["dp_size"], h["rdp_size"]) == (2, 2, 2, 2)
        assert h["pp_rank"] == h["mp_rank"] == mp.index(r), (r, h)
        assert h["dp_rank"] == h["rdp_rank"] == dp.index(r), (r, h)
        assert h["get_mp_group"] == h["mp_process_group"] == mp and h["get_dp_group"] == h["dp_process_group"] == dp
        assert h["pipe"] == [h["pp_rank"], h["dp_rank"], mp]  # smp's pipeline: same coordinates and pipeline ranks
        assert h["local_parameters"] and all(n.startswith(("net1.", "a.", "norm.") if h["pp_rank"] == 0 else
                                                          ("net2.", "b.")) for n in h["local_parameters"]), h


@pytest.mark.slow
def test_v1_script_on_two_replicas_of_two_partitions_matches_plain_pytorch(tmp_path: Path) -> None:
    """4 ranks, "partitions": 2, "ddp": true, "placement_strategy": "spread": two replicas, each on its shard (16
    examples of each 32 the plain run takes in one batch), train as plain PyTorch on the global batch; the rank
    helpers give v1's layout. (The default "cluster" layout is checked in the next test.)"""
    got, _ = _run_mnist(tmp_path, 4, {**CONFIG, "ddp": True, "placement_strategy": "spread"}, batch_size=16)
    _check_against_plain_pytorch(got, tmp_path)
    assert "into 2 stages on 4 ranks" in got["plan"]
    _check_layout(tmp_path / "ranks", "spread")


@pytest.mark.slow
def test_ddp_layout_buffers_and_checkpoints_on_two_replicas(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(HERE / "_v1_ddp_checks.py"), str(tmp_path)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    [(code, out)] = _finish([proc], timeout=240)
    assert code == 0, out[-4000:]
    _check_layout(tmp_path / "ranks", "cluster")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    first = [r for r in ranks if r["pp_rank"] == 0]
    assert sorted(r["dp_rank"] for r in first) == [0, 1]
    # batch norm's statistics: apart after a step on each replica's own data; together after a step on the same
    # data, because dp rank 0's were broadcast before it (DistributedDataParallel's broadcast_buffers)
    assert first[0]["after_own_data"] != first[1]["after_own_data"]
    assert first[0]["after_same_data"] == first[1]["after_same_data"]
    # the partial checkpoint of replicated partitions brings every rank's weights back
    for r in ranks:
        assert r["moved"] and r["resumed"] and r["user_content"] == {"step": 2}, r


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
