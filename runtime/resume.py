"""What an exact resume needs besides weights and optimizer state: the step, the RNG, whole checkpoints, the latest.

A pipeline checkpoint is written under a hidden staging name (``.NAME.partial``) and renamed
to its own name by rank 0 only after every rank has written its part and the
torch.distributed.checkpoint metadata is down, with ``progress.json`` (the step and the world
size) inside it. So a directory under its own name is always whole: a rank that dies while
saving leaves at most a staging directory, which :func:`latest_checkpoint` never returns and
the next save of that name clears.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["PROGRESS_FILE", "RNG_PREFIX", "latest_checkpoint", "publish", "read_progress", "rng_state",
           "set_rng_state", "staging_dir"]

#: In every published checkpoint: ``{"step": int | None, "world_size": int}``.
PROGRESS_FILE = "progress.json"
#: Keys ``rng/<rank>/cpu`` (and ``rng/<rank>/cuda``): each rank's generator states when it saved.
RNG_PREFIX = "rng/"


def rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's random generators (dropout draws from them) by checkpoint key: the CPU one, and ``device``'s."""
    states = {f"{RNG_PREFIX}{rank}/cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states[f"{RNG_PREFIX}{rank}/cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_state(states: Mapping[str, torch.Tensor], rank: int, device: torch.device) -> None:
    """Put back this rank's generators from ``rng_state``'s entries (those present)."""
    cpu = states.get(f"{RNG_PREFIX}{rank}/cpu")
    if cpu is not None:
        torch.set_rng_state(cpu)
    gpu = states.get(f"{RNG_PREFIX}{rank}/cuda")
    if gpu is not None and device.type == "cuda":
        torch.cuda.set_rng_state(gpu, device)


def staging_dir(directory: str | Path) -> Path:
    """Where the ranks write ``directory``'s checkpoint before it is published under its name."""
    final = Path(directory)
    return final.with_name(f".{final.name}.partial")


def publish(staging: Path, directory: str | Path, step: int | None, world_size: int) -> None:
    """Record the progress in the whole checkpoint at ``staging`` and give it its name (one process, after every
    rank wrote); an older checkpoint of that name is replaced."""
    final = Path(directory)
    record = staging / PROGRESS_FILE
    record.write_text(json.dumps({"step": step, "world_size": world_size}))
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(final)


def read_progress(directory: str | Path) -> dict[str, int | None] | None:
    """A published checkpoint's ``{"step", "world_size"}``; None for one written before progress was recorded."""
    record = Path(directory) / PROGRESS_FILE
    return json.loads(record.read_text()) if record.is_file() else None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The whole checkpoint with the highest step among ``root``'s directories (``save_checkpoint(...,
    step=N)``), or None when there is none yet (a first run, or a rank died before the first save finished).

    Staging directories (a save cut short) and checkpoints saved without a step are skipped.
    """
    base = Path(root)
    if not base.is_dir():
        return None
    found: list[tuple[int, str, Path]] = []
    for d in base.iterdir():
        if d.name.startswith(".") or not (d / ".metadata").is_file():
            continue
        progress = read_progress(d)
        if progress is not None and progress.get("step") is not None:
            found.append((int(progress["step"]), d.name, d))
    return max(found)[2] if found else None
