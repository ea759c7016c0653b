"""Checkpoints: weights read by name, lazily, from any common format; pipeline checkpoints through torch.distributed.checkpoint.

A rank reads only the tensors its stages hold: safetensors files are opened lazily
(``safe_open``), ``torch.save`` files memory-mapped, and smp checkpoints are
torch.distributed.checkpoint (DCP) directories read key by key. Names are the original
model's (``model.state_dict()`` names), so a checkpoint written by any number of stages,
or by the unpartitioned model, loads into any pipeline.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from runtime.resume import RNG_PREFIX, publish, read_progress, rng_state, set_rng_state, staging_dir
from runtime.sharding import copy_whole_into, is_strided, shard_like, storable

__all__ = ["CheckpointError", "WeightSource", "open_weights", "save_pipeline", "load_pipeline", "Restored",
           "consolidate", "save_sharded", "merge_partial_states", "MissingStateError", "MODEL_PREFIX", "OPTIM_PREFIX"]

#: Keys of an smp checkpoint: ``model/<name>`` for weights, ``optim/<name>/<state>`` for optimizer state.
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
_HYPER = "hyper"  # optim/<name>/hyper: the param group's hyperparameters and the non-tensor state, as JSON
SCALER_KEY = "scaler"  # the fp16 loss scaler's state (PipelineGradScaler.state_dict), as JSON


class CheckpointError(ValueError):
    """A checkpoint cannot be read or written as asked; the message names the file or tensor and the fix."""


class MissingStateError(CheckpointError):
    """No partial state holds some of the keys a full state needs; ``missing`` lists them in order."""

    def __init__(self, missing: Sequence[str]) -> None:
        super().__init__(f"no rank holds {list(missing[:3])} ({len(missing)} entries)")
        self.missing = list(missing)


V = TypeVar("V")


def merge_partial_states(parts: Sequence[Mapping[str, V]], order: Sequence[str], *,
                         require_all: bool = True) -> dict[str, V]:
    """One full state from the ranks' partial ones (in rank order): each key's first value, the keys of ``order``
    first (in that order), then any others in the order first seen.

    A tied tensor is held by several ranks, with the same value: the first is kept. With
    ``require_all`` a key of ``order`` that no part holds raises :class:`MissingStateError`.
    """
    full: dict[str, V] = {}
    for part in parts:
        for k, v in part.items():
            full.setdefault(k, v)
    if require_all:
        missing = [k for k in order if k not in full]
        if missing:
            raise MissingStateError(missing)
    ordered = {k: full[k] for k in order if k in full}
    return {**ordered, **{k: v for k, v in full.items() if k not in ordered}}


class WeightSource:
    """The tensors of one checkpoint, by name; only the tensors asked for are read."""

    def __init__(self, path: Path, kind: str, files: Mapping[str, Path]) -> None:
        self.path = path
        self.kind = kind
        self._files = dict(files)  # name -> file holding it (the DCP directory for smp checkpoints)
        self._shapes: dict[str, tuple[int, ...]] = {}  # smp checkpoints: from the DCP metadata
        self._dtypes: dict[str, torch.dtype] = {}

    def names(self) -> set[str]:
        return set(self._files)

    def read(self, targets: Mapping[str, torch.Tensor]) -> None:
        """Copy each named tensor into its target (same shape; converted to the target's dtype)."""
        missing = sorted(set(targets) - set(self._files))
        if missing:
            raise CheckpointError(f"{self.path} has no tensor {missing[0]!r}" + (
                f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""))
        by_file: dict[Path, list[str]] = {}
        for name in targets:
            by_file.setdefault(self._files[name], []).append(name)
        for file, names in by_file.items():
            getattr(self, f"_read_{self.kind}")(file, {n: targets[n] for n in names})

    def _check(self, name: str, got: tuple[int, ...], target: torch.Tensor) -> None:
        if tuple(got) != tuple(target.shape):
            raise CheckpointError(f"{name} in {self.path} has shape {tuple(got)}, the model's is "
                                  f"{tuple(target.shape)}: the checkpoint is for another model or configuration")

    def _read_safetensors(self, file: Path, targets: Mapping[str, torch.Tensor]) -> None:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name, target in targets.items():
                t = f.get_tensor(name)
                self._check(name, t.shape, target)
                with torch.no_grad():
                    target.copy_(t)

    def _read_torch(self, file: Path, targets: Mapping[str, torch.Tensor]) -> None:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        for name, target in targets.items():
            self._check(name, state[name].shape, target)
            with torch.no_grad():
                target.copy_(state[name])

    def _read_dcp(self, directory: Path, targets: Mapping[str, torch.Tensor]) -> None:
        import torch.distributed.checkpoint as dcp

        for name, target in targets.items():
            self._check(name, self._shapes[name], target)
        # a strided DTensor (stored whole) is read whole and cut here
        staged = {MODEL_PREFIX + n: torch.empty(t.shape, dtype=t.dtype) if is_strided(t) else
                  torch.empty_like(t, device="cpu") for n, t in targets.items()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(staged, checkpoint_id=str(directory), no_dist=True)  # this rank's keys only, no collective
        with torch.no_grad():
            for n, t in targets.items():
                if is_strided(t):
                    copy_whole_into(t, staged[MODEL_PREFIX + n])
                else:
                    t.copy_(staged[MODEL_PREFIX + n])


def open_weights(path: str | Path) -> WeightSource:
    """A checkpoint's tensors by name: a ``.safetensors`` file, a Hugging Face directory (``model.safetensors``,
    a sharded ``model.safetensors.index.json``, or ``pytorch_model.bin[.index.json]``), a ``torch.save``
    state dict, or an smp checkpoint directory (``pipe.save_checkpoint``)."""
    p = Path(path)
    if p.is_file():
        if p.suffix == ".safetensors":
            return WeightSource(p, "safetensors", {n: p for n in _safetensors_names(p)})
        if p.suffix == ".json":
            return _from_index(p)
        return WeightSource(p, "torch", {n: p for n in _torch_names(p)})
    if p.is_dir():
        if (p / ".metadata").is_file():
            return _from_dcp(p)
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (p / index).is_file():
                return _from_index(p / index)
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (p / single).is_file():
                return open_weights(p / single)
        raise CheckpointError(f"{p} is a directory without a checkpoint smp can read: expected an smp checkpoint "
                              "(.metadata), model.safetensors[.index.json] or pytorch_model.bin[.index.json]")
    raise CheckpointError(f"no checkpoint at {p}: give a .safetensors file, a Hugging Face model directory, a "
                          "torch.save state dict, or a directory written by pipe.save_checkpoint")


def _safetensors_names(file: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return list(f.keys())
    except Exception as err:  # noqa: BLE001 - a damaged or foreign file
        raise CheckpointError(f"{file} is not a readable safetensors file ({type(err).__name__}: {err})") from None


def _torch_names(file: Path) -> list[str]:
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"{file} is not a readable torch.save state dict ({type(err).__name__}: "
                              f"{str(err).splitlines()[0]})") from None
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not a state dict of tensors")
    return [k for k, v in state.items() if isinstance(v, torch.Tensor)]


def _from_index(index: Path) -> WeightSource:
    """A sharded Hugging Face checkpoint: the index maps every tensor to its shard file."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index} is not a checkpoint index (no weight_map: {err})") from None
    kind = "safetensors" if index.name.startswith("model.safetensors") else "torch"
    files = {name: index.parent / shard for name, shard in weight_map.items()}
    absent = sorted({f for f in files.values() if not f.is_file()})
    if absent:
        raise CheckpointError(f"{index} names shard {absent[0].name}, which is not in {index.parent}")
    return WeightSource(index, kind, files)


def _from_dcp(directory: Path) -> WeightSource:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    source = WeightSource(directory, "dcp", {k[len(MODEL_PREFIX):]: directory for k in metadata
                                             if k.startswith(MODEL_PREFIX)})
    for k, v in metadata.items():
        if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata):
            source._shapes[k[len(MODEL_PREFIX):]] = tuple(v.size)
            source._dtypes[k[len(MODEL_PREFIX):]] = v.properties.dtype
    return source


def save_sharded(state: Mapping[str, torch.Tensor], directory: str | Path, shard_bytes: int = 2 << 30) -> Path:
    """Write ``state`` as a Hugging Face sharded safetensors directory (shards of at most ``shard_bytes``
    plus ``model.safetensors.index.json``), the layout ``open_weights`` and ``from_pretrained`` read.

    Tied tensors (one storage under several names) are written once, under their first name.
    """
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file))
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return out


# ---------------------------------------------------------------------- pipeline checkpoints


def _optimizer_entries(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """``optim/<name>/<key>`` for each tensor of a parameter's state, ``optim/<name>/hyper`` for the rest."""
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:  # another rank's parameter, emptied when the model was partitioned
                continue
            state = optimizer.state.get(p, {})
            plain = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            out[f"{OPTIM_PREFIX}{name}/{_HYPER}"] = json.dumps({"group": hyper, "state": plain}, default=list)
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    out[f"{OPTIM_PREFIX}{name}/{k}"] = storable(v)
    return out


def save_pipeline(directory: str | Path, tensors: Mapping[str, torch.Tensor],
                  optimizer: torch.optim.Optimizer | None, param_names: Mapping[int, str],
                  scaler_state: Mapping[str, float | int] | None = None, *, step: int | None = None,
                  device: torch.device = torch.device("cpu")) -> None:
    """Every rank writes its own tensors (and optimizer state) to one DCP checkpoint, in parallel; the checkpoint
    appears under ``directory`` only once whole (runtime/resume.py).

    ``tensors``: this rank's state by original name; ``param_names``: id of each local
    parameter -> its name. A tensor several ranks hold (a tied weight) is written once.
    ``scaler_state``: the fp16 loss scaler's, the same on every rank (its decisions are global).
    ``step``: the training step reached, recorded for the resume. Each rank's random
    generators (the CPU one and ``device``'s) go with it, so that dropout draws on as it would have.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    single = not (dist.is_available() and dist.is_initialized())
    rank, world_size = (0, 1) if single else (dist.get_rank(), dist.get_world_size())
    state: dict[str, Any] = {MODEL_PREFIX + n: t for n, t in tensors.items()}
    if optimizer is not None:
        state.update(_optimizer_entries(optimizer, param_names))
    if scaler_state is not None:
        state[SCALER_KEY] = json.dumps(dict(scaler_state))
    state.update(rng_state(rank, device))
    staging = staging_dir(directory)
    if rank == 0:  # what a save cut short left behind
        shutil.rmtree(staging, ignore_errors=True)
    if not single:
        dist.barrier()  # nobody writes into the staging directory before it is cleared
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: intended
        dcp.save(state, checkpoint_id=str(staging), no_dist=single)  # returns once the metadata is written
    if rank == 0:
        publish(staging, directory, step, world_size)
    if not single:
        dist.barrier()  # every rank returns once the checkpoint is under its name (a load may follow)


@dataclass(frozen=True)
class Restored:
    """What ``load_pipeline`` read besides tensors: the step saved (None when not recorded) and the fp16 loss
    scaler's state (None when the checkpoint has none)."""

    step: int | None
    scaler_state: dict[str, float | int] | None


def load_pipeline(directory: str | Path, tensors: Mapping[str, torch.Tensor],
                  optimizer: torch.optim.Optimizer | None, param_names: Mapping[int, str], *, rank: int = 0,
                  world_size: int = 1, device: torch.device = torch.device("cpu")) -> Restored:
    """Read this rank's tensors (and its parameters' optimizer state) from a checkpoint written by any stage count.

    Where it was written by as many ranks as there are now, rank ``rank``'s random generators
    are put back as they were when it saved (another world size draws differently anyway).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source = open_weights(directory)
    if source.kind != "dcp":
        raise CheckpointError(f"{directory} is not an smp checkpoint (no .metadata); load plain weights with "
                              "smp.partition(model, checkpoint=...)")
    source.read(tensors)
    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    scaler_state = None
    if SCALER_KEY in metadata:
        staged_scaler: dict[str, Any] = {SCALER_KEY: ""}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(staged_scaler, checkpoint_id=str(directory), no_dist=True)
        scaler_state = json.loads(staged_scaler[SCALER_KEY])
    progress = read_progress(directory)
    if progress is not None and progress["world_size"] == world_size:
        _restore_rng(directory, metadata, rank, device)
    restored = Restored(progress["step"] if progress is not None else None, scaler_state)
    if optimizer is None:
        return restored
    params = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    for pid, name in param_names.items():
        p = params.get(pid)
        if p is None:
            continue
        prefix = f"{OPTIM_PREFIX}{name}/"
        keys = [k for k in metadata if k.startswith(prefix)]
        if not keys:
            raise CheckpointError(f"{directory} has no optimizer state for {name!r}: it was saved without an "
                                  "optimizer (pipe.save_checkpoint(dir, optimizer=opt)) or for another model")
        staged: dict[str, Any] = {}
        for k in keys:
            md = metadata[k]
            staged[k] = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) \
                else ""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(staged, checkpoint_id=str(directory), no_dist=True)
        extra = json.loads(staged.pop(prefix + _HYPER))
        # a state tensor shaped like its parameter is cut as the parameter is (sharded over the replicas)
        state = {k[len(prefix):]: v if k[len(prefix):] == "step" else
                 shard_like(v, p) if tuple(v.shape) == tuple(p.shape) else v.to(p.device) for k, v in staged.items()}
        state.update(extra["state"])
        optimizer.state[p] = state
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        for k, v in extra["group"].items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
    return restored


def _restore_rng(directory: str | Path, metadata: Mapping[str, Any], rank: int, device: torch.device) -> None:
    """Put back rank ``rank``'s random generators from the checkpoint's ``rng/<rank>/...`` entries."""
    import torch.distributed.checkpoint as dcp

    staged = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in metadata.items()
              if k.startswith(f"{RNG_PREFIX}{rank}/")}
    if not staged:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(staged, checkpoint_id=str(directory), no_dist=True)
    set_rng_state(staged, rank, device)


def consolidate(directory: str | Path, path: str | Path) -> Path:
    """An smp checkpoint's weights as one file that loads into the unpartitioned model.

    ``.safetensors`` (tied tensors written once, as safetensors requires) or anything else
    for ``torch.save``; ``model.load_state_dict(...)`` takes either.
    """
    source = open_weights(directory)
    if source.kind != "dcp":
        raise CheckpointError(f"{directory} is not an smp checkpoint (no .metadata)")
    state = {n: torch.empty(source._shapes[n], dtype=source._dtypes[n]) for n in sorted(source.names())}
    source.read(state)
    out = Path(path)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(out))
    else:
        torch.save(state, out)
    return out

