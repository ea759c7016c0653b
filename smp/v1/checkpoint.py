"""``smp.save`` / ``smp.load``: torch.save files, one per partition (``f"{path}_{pp_rank}"``, v1's names) or one in all."""

from __future__ import annotations

import glob
import pickle
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from smp.v1.errors import V1Error
from smp.v1.info import pp_rank
from smp.v1.state import current

__all__ = ["save", "load", "partial_path"]


def partial_path(f: str | Path, pp_rank: int) -> str:
    """The file v1 wrote for partition ``pp_rank``: the path with ``_{pp_rank}`` appended."""
    return f"{f}_{pp_rank}"


def save(obj: Any, f: str | Path, partial: bool = True, pickle_module: ModuleType = pickle,
         pickle_protocol: int = 2) -> None:
    """``torch.save(obj)``: with ``partial`` to this partition's own file (each rank its own, as v1; call it on
    the ranks with ``dp_rank() == 0``), else to ``f``, written by rank 0 (the other ranks' calls write nothing)."""
    if partial:
        torch.save(obj, partial_path(f, pp_rank()), pickle_module=pickle_module, pickle_protocol=pickle_protocol)
        return
    if current().topology.rank == 0:  # v1 scripts call it on every rank with dp_rank() == 0: one file
        torch.save(obj, str(f), pickle_module=pickle_module, pickle_protocol=pickle_protocol)


def load(f: str | Path, map_location: Any = None, pickle_module: ModuleType | None = None, partial: bool = True,
         **pickle_load_args: Any) -> Any:
    """``torch.load``: with ``partial`` this partition's file (``smp.save(..., partial=True)``), else ``f``.

    ``pickle_load_args`` go to torch.load (e.g. ``weights_only=False`` for objects other
    than tensors, dicts, lists and numbers).
    """
    path = partial_path(f, pp_rank()) if partial else str(f)
    if not Path(path).exists():
        found = sorted(glob.glob(glob.escape(str(f)) + "_*"))
        hint = f" (found {', '.join(found)}: saved with {len(found)} partitions?)" if partial and found else ""
        raise V1Error(f"smp.load: no file {path}{hint}")
    kwargs = dict(pickle_load_args)
    if pickle_module is not None:
        kwargs["pickle_module"] = pickle_module
    return torch.load(path, map_location=map_location, **kwargs)
