"""Join the process group torchrun describes, with keys of its own per attempt, so that a restarted job re-forms it."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DEFAULT_TIMEOUT", "LaunchError", "init_distributed", "launched_by_torchrun", "local_gpu", "resolve_device"]

#: Seconds any wait on a peer may last (joining, transfers, collectives), unless a caller says otherwise.
DEFAULT_TIMEOUT = 300.0

#: What torchrun (or any env:// launcher) puts in each rank's environment; joining needs all of it.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(RuntimeError):
    """This process cannot join a process group as asked; the message says how to launch it."""


def launched_by_torchrun() -> bool:
    """Whether the environment describes a process group to join (torchrun's RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    return all(name in os.environ for name in LAUNCH_VARIABLES)


def local_gpu() -> torch.device:
    """This rank's GPU: ``cuda:LOCAL_RANK`` (torchrun numbers the ranks of a node 0.. in LOCAL_RANK)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def init_distributed(backend: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                     device: str | torch.device | None = None) -> None:
    """Join the default process group torchrun describes, in a way that a restarted attempt re-forms.

    Call it first in a script that needs its rank before ``smp.partition`` (which otherwise
    joins the same way on its own). ``backend``: default NCCL when this rank's ``device`` is a
    GPU (default ``cuda:LOCAL_RANK`` where there is one), gloo otherwise; ``timeout`` (seconds)
    bounds the group's collectives. Does nothing when a process group already exists.

    Why not ``dist.init_process_group(backend)``: under ``torchrun --max-restarts`` every attempt
    shares torchrun's store, which still holds the previous attempt's addresses; a rank of the
    new attempt may read a dead peer's address before that peer rewrites it ("Gloo
    connectFullMesh failed ... Connection refused"). Here each attempt
    (``TORCHELASTIC_RESTART_COUNT``) keeps its keys under its own prefix, so nothing stale is read.
    """
    if not dist.is_available():
        raise LaunchError("this torch has no torch.distributed: smp.init_distributed cannot join a process group")
    if dist.is_initialized():
        return
    if not launched_by_torchrun():
        missing = [name for name in LAUNCH_VARIABLES if name not in os.environ]
        raise LaunchError(f"smp.init_distributed: this process was not started by torchrun ({', '.join(missing)} "
                          "not in the environment): launch it with `torchrun --nproc-per-node N script.py`, or "
                          "run it as one process without calling init_distributed (smp.partition then runs every "
                          "stage here)")
    where = torch.device(device) if device is not None else (
        local_gpu() if torch.cuda.is_available() else torch.device("cpu"))
    if where.type == "cuda":
        torch.cuda.set_device(where)
    limit = datetime.timedelta(seconds=timeout)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=limit))
    store.set_timeout(limit)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend or ("nccl" if where.type == "cuda" else "gloo"),
                            store=dist.PrefixStore(f"smp/attempt_{attempt}/", store), rank=rank,
                            world_size=world_size, timeout=limit)


def resolve_device(device: str | torch.device | None, model: nn.Module) -> torch.device:
    """Where this rank's stages run: ``device``, else ``cuda:LOCAL_RANK`` when there is a GPU, else the model's
    (the device of its first tensor with values; the CPU for a model on the meta device)."""
    if device is not None:
        d = torch.device(device)
        return local_gpu() if d.type == "cuda" and d.index is None else d
    if torch.cuda.is_available():
        return local_gpu()
    for t in list(model.parameters()) + list(model.buffers()):
        if not t.is_meta:
            return t.device
    return torch.device("cpu")
