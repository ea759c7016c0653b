"""The examples run as docs/runtime.md tells users to run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = "gpt:layers=4,d_model=64,heads=4,vocab=256,seq_len=16,batch=8"


def _run(*args: str, ranks: int = 0) -> str:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] \
        if ranks else [sys.executable]
    done = subprocess.run([*launcher, str(ROOT / "examples" / "train_large.py"), "--model", MODEL, *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", out)]


@pytest.mark.slow
def test_train_large_checkpoint_train_save_and_resume_elsewhere(tmp_path: Path) -> None:
    """make a sharded checkpoint; train 3 steps on 2 ranks built without weights and save; resume 2 steps in one
    process: the same losses as 5 uninterrupted steps in one process."""
    init, saved = tmp_path / "init", tmp_path / "step"
    _run("--make-checkpoint", str(init))
    assert (init / "model.safetensors.index.json").exists()
    trained = _run("--checkpoint", str(init), "--save", str(saved), "--steps", "3", ranks=2)
    holds = [(float(a), float(b)) for a, b in re.findall(r"holds (\d+) MiB of the model's (\d+) MiB", trained)]
    assert len(_losses(trained)) == 3 and holds and all(mine < whole for mine, whole in holds)
    resumed = _losses(_run("--checkpoint", str(saved), "--resume", "--steps", "2"))
    uninterrupted = _losses(_run("--checkpoint", str(init), "--steps", "5"))
    assert _losses(trained) == pytest.approx(uninterrupted[:3], abs=2e-4)  # 2 stages against 1: float rounding
    assert resumed == pytest.approx(uninterrupted[3:], abs=2e-4)
