"""v1's checkpoints: ``smp.save`` / ``smp.load`` (torch.save files, one per partition, ``f"{path}_{pp_rank}"``,
or one) and ``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` (directories; partial ones are smp's own)."""

from __future__ import annotations

import glob
import pickle
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from smp.v1.comm import barrier
from smp.v1.errors import V1Error
from smp.v1.info import dp_rank, pp_rank
from smp.v1.model import DistributedModel
from smp.v1.optimizer import DistributedOptimizer
from smp.v1.state import current

__all__ = ["save", "load", "partial_path", "save_checkpoint", "resume_from_checkpoint"]


def partial_path(f: str | Path, partition: int) -> str:
    """The file v1 wrote for ``partition`` (its pp_rank): the path with ``_{partition}`` appended."""
    return f"{f}_{partition}"


def save(obj: Any, f: str | Path, partial: bool = True, pickle_module: ModuleType = pickle,
         pickle_protocol: int = 2) -> None:
    """``torch.save(obj)``: with ``partial`` to this partition's own file (each rank its own, as v1; call it on
    the ranks with ``dp_rank() == 0``: on other replicas, which hold the same partition, it writes nothing),
    else to ``f``, written by rank 0 (the other ranks' calls write nothing)."""
    if partial:
        if dp_rank() != 0:  # the same file from every replica would be written concurrently
            return
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


# ---------------------------------------------------------------------- v1's checkpoint directories

NEWEST = "newest"
USER_CONTENT = "user_content.pt"


def save_checkpoint(path: str | Path, tag: str, partial: bool = True, model: DistributedModel | None = None,
                    optimizer: DistributedOptimizer | None = None, user_content: Any = None,
                    translate_if_full: bool = True, num_kept_partial_checkpoints: int | None = None) -> None:
    """v1's checkpoint directory, a collective: ``partial`` writes ``{path}/{tag}_partial`` with smp's sharded
    checkpoint (every rank its own tensors and optimizer state, loadable into any partitioning); otherwise
    rank 0 writes the full model and optimizer state to ``{path}/{tag}``. ``{path}/newest`` names the tag.

    ``translate_if_full`` changes nothing: a full state already has the original model's names.
    """
    st = current()
    model = model or st.model
    if not isinstance(model, DistributedModel):
        raise V1Error("smp.save_checkpoint needs a DistributedModel")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    inner = optimizer.optimizer if optimizer is not None else None
    if partial:
        directory = root / f"{tag}_partial"
        model.need_pipe("smp.save_checkpoint(partial=True)").save_checkpoint(directory, inner)
        extra, content_path = None, directory / USER_CONTENT
    else:
        extra = {"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer is not None else None}
        content_path = root / f"user_content_{tag}"
    if st.topology.rank == 0:
        if extra is not None:
            torch.save(extra, root / tag)
        torch.save(user_content, content_path)
        (root / NEWEST).write_text(str(tag))
        if partial and num_kept_partial_checkpoints is not None:
            kept = sorted(root.glob("*_partial"), key=lambda d: d.stat().st_mtime)
            for old in kept[:-num_kept_partial_checkpoints]:
                shutil.rmtree(old)
    barrier()


def resume_from_checkpoint(path: str | Path, tag: str | None = None, partial: bool = True, strict: bool = True,
                           load_optimizer: bool = True, load_sharded_optimizer_state: bool = True,
                           translate_function: Any = None) -> Any:
    """Load ``save_checkpoint``'s tag (default: the newest) into the DistributedModel and DistributedOptimizer;
    returns its ``user_content``. A partial checkpoint loads right after partitioning (at once if partitioned)."""
    if translate_function is not None:
        raise V1Error("resume_from_checkpoint(translate_function=...) translates other formats' checkpoints; load "
                      "those with model.load_state_dict instead")
    st = current()
    model = st.model
    optimizer = st.optimizer if load_optimizer and isinstance(st.optimizer, DistributedOptimizer) else None
    if not isinstance(model, DistributedModel):
        raise V1Error("smp.resume_from_checkpoint needs a DistributedModel")
    root = Path(path)
    if tag is None:
        if not (root / NEWEST).exists():
            raise V1Error(f"smp.resume_from_checkpoint: {root / NEWEST} does not exist; pass tag=...")
        tag = (root / NEWEST).read_text().strip()
    if partial:
        directory = root / f"{tag}_partial"
        if not directory.is_dir():
            raise V1Error(f"smp.resume_from_checkpoint: no partial checkpoint {directory}")
        inner = optimizer.optimizer if optimizer is not None else None
        model.register_post_partition_hook(
            lambda m: m.need_pipe("smp.resume_from_checkpoint()").load_checkpoint(directory, inner))
        return torch.load(directory / USER_CONTENT, weights_only=False)
    full = torch.load(root / tag, weights_only=False)
    model.load_state_dict(full["model"], strict=strict)
    if optimizer is not None and full["optimizer"] is not None:
        optimizer.load_state_dict(full["optimizer"])
    return torch.load(root / f"user_content_{tag}", weights_only=False)
