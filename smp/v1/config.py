"""The v1 parameters (a dict, or SageMaker's SM_HP_MP_PARAMETERS JSON) checked, and mapped onto smp's options."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import permutations
from typing import Any

from partitioner.request import PlanRequest
from smp.v1.errors import V1Error

__all__ = ["ENV_VAR", "V1Config", "load_config", "HONOURED", "NO_EFFECT", "REFUSED", "SCHEDULES",
           "MEMORY_WEIGHT_OF", "PLACEMENTS"]

#: Where SageMaker put the ``mp_parameters`` hyperparameter (JSON) for the training script.
ENV_VAR = "SM_HP_MP_PARAMETERS"

#: v1 pipeline names -> smp schedules. v1's "interleaved" is its backward-first schedule (1F1B);
#: smp's own "interleaved" (virtual stages) is another schedule and is not what v1 meant.
SCHEDULES = {"interleaved": "1f1b", "simple": "gpipe"}

#: v1's documented ``memory_weight`` for each ``optimize`` value.
MEMORY_WEIGHT_OF = {"speed": 0.2, "memory": 0.8}

#: ``placement_strategy`` names -> the order of the D(ata), P(ipeline), T(ensor) axes, slowest first
#: (v1: "cluster" is "DPT": one model replica on neighbouring ranks; "spread" is "TPD"). Without tensor
#: parallelism (T has size 1) only the order of D and P matters: D before P is smp's "cluster" placement
#: (each pipeline on consecutive ranks), P before D its "spread" (each stage's replicas on consecutive ranks).
PLACEMENTS = {"cluster": "DPT", "spread": "TPD", **{"".join(p): "".join(p) for p in permutations("DPT")}}

#: Keys v1 accepted that change nothing here, and why.
NO_EFFECT = {
    "deterministic_server": "smp's engine runs a fixed schedule, so execution is always deterministic",
    "ddp_port": "the process group rendezvous uses MASTER_ADDR / MASTER_PORT",
    "ddp_dist_backend": "smp uses NCCL for GPU tensors and gloo for CPU tensors",
    "activation_loading_horizon": "it only tunes offload_activations, which smp does not do",
}

_MIXED = ("fp16 training through the v1 configuration is not supported: wrap model(...) in torch.autocast inside "
          "the smp.step function and scale the loss with smp.amp.GradScaler")

#: Keys that ask for a feature smp does not have: key -> (the value that asks for nothing, why).
REFUSED: dict[str, tuple[Any, str]] = {
    "tensor_parallel_degree": (1, "tensor parallelism is not part of smp (it partitions a model into pipeline "
                                  "stages); use partitions / pipeline_parallel_degree"),
    "offload_activations": (False, "activation offloading is not part of smp"),
    "prescaled_batch": (False, "it applies to tensor parallelism, which smp does not do"),
    "skip_tracing": (False, "smp plans from a trace of the model; build a model too large for one device under "
                            "smp.delay_param_initialization() instead"),
    "fp16": (False, _MIXED),
    "bf16": (False, _MIXED.replace("fp16", "bf16", 1)),
    "fp16_params": (False, _MIXED.replace("fp16 training", "fp16 parameters", 1)),
}

_SHARDED_PREFIX = "sdp_"  # the sharded-data-parallel tuning keys
_SDP_TUNING = ("tunes v1's own sharded data parallelism, which smp runs with torch FSDP2's defaults (one unit per "
               "stage); remove the key")

#: Keys that change what smp does (``timeout`` is smp's own).
HONOURED = ("partitions", "pipeline_parallel_degree", "microbatches", "pipeline", "ddp", "placement_strategy",
            "auto_partition", "default_partition", "memory_weight", "optimize", "active_microbatches",
            "shard_optimizer_state", "sharded_data_parallel_degree", "timeout")

DEFAULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class V1Config:
    """The configuration a v1 script runs with, in smp's terms.

    ``memory_weight`` is None when neither it nor ``optimize`` was given: smp's planner
    then returns its fastest plan that fits (docs/smp-v1.md). ``active_microbatches`` (the
    most microbatches a partition holds in flight) is None when not given: the schedule's own. ``timeout`` (seconds, smp's own key) bounds every wait on a peer.
    ``sharding`` (partitioner/sharding.py): "none" unless ``shard_optimizer_state`` (-> "shard_grad_op") or
    ``sharded_data_parallel_degree`` > 1 (-> "full_shard") asked for it, as v1 sharded nothing unasked;
    ``sharded_degree`` is that degree (1: not given), checked against the replicas by :meth:`request`.
    """

    partitions: int
    microbatches: int = 1
    pipeline: str = "interleaved"
    ddp: bool = False
    placement_strategy: str = "cluster"
    auto_partition: bool = True
    default_partition: int = 0
    memory_weight: float | None = None
    active_microbatches: int | None = None
    timeout: float = DEFAULT_TIMEOUT
    sharding: str = "none"
    sharded_degree: int = 1

    def request(self, data_parallel: int) -> PlanRequest:
        """What the planner is asked for this configuration with ``data_parallel`` replicas of the pipeline.

        v1's own defaults stay: one microbatch unless ``microbatches`` says otherwise (not
        smp's :func:`~partitioner.request.default_microbatches`).
        """
        self.check_replicas(data_parallel)
        return PlanRequest(stages=self.partitions, microbatches=self.microbatches, schedule=self.schedule,
                           placement=self.placement, active_microbatches=self.active_microbatches,
                           data_parallel=data_parallel, sharding=self.sharding)

    def check_replicas(self, data_parallel: int) -> None:
        """V1Error unless the sharding asked for fits ``data_parallel`` replicas of the partitions: smp shards a
        partition over all its replicas (v1 could shard over sub-groups of them), and needs two or more."""
        if self.sharded_degree > 1 and self.sharded_degree != data_parallel:
            raise V1Error(f"v1 parameter sharded_data_parallel_degree={self.sharded_degree}, but this run has "
                          f"{data_parallel} data-parallel replicas (world size / partitions): smp shards each "
                          f"partition over all its replicas, so set sharded_data_parallel_degree to {data_parallel}, "
                          f"or launch {self.sharded_degree * self.partitions} processes")
        if self.sharding != "none" and data_parallel < 2:
            asked = ("shard_optimizer_state" if self.sharded_degree == 1 else
                     f"sharded_data_parallel_degree={self.sharded_degree}")
            raise V1Error(f"v1 parameter {asked} shards over the data-parallel replicas, and this run has one "
                          f"({self.partitions} partitions on {self.partitions * data_parallel} processes): launch "
                          f"more processes than partitions with \"ddp\": true, or remove the key")

    @property
    def schedule(self) -> str:
        """smp's schedule for v1's ``pipeline``."""
        return SCHEDULES[self.pipeline]

    @property
    def axis_order(self) -> str:
        """The placement as an order of the D, P, T axes, slowest-varying first."""
        return PLACEMENTS[self.placement_strategy]

    @property
    def placement(self) -> str:
        """smp's placement of the replicas for ``placement_strategy`` ("cluster" or "spread")."""
        order = self.axis_order
        return "cluster" if order.index("D") < order.index("P") else "spread"


def load_config(config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> V1Config:
    """The configuration from ``config``, else from the JSON in ``SM_HP_MP_PARAMETERS``; every key checked."""
    env = os.environ if environ is None else environ
    if config is None:
        text = env.get(ENV_VAR)
        if text is None:
            raise V1Error(f"smp.init(): no configuration. Pass one, smp.init({{\"partitions\": 2, \"microbatches\": "
                          f"4}}), or set {ENV_VAR}='{{\"partitions\": 2, \"microbatches\": 4}}' as SageMaker did")
        try:
            config = json.loads(text)
        except json.JSONDecodeError as err:
            raise V1Error(f"{ENV_VAR} is not valid JSON ({err}): {text[:200]!r}") from None
        if not isinstance(config, Mapping):
            raise V1Error(f"{ENV_VAR} must hold a JSON object of v1 parameters, got {text[:200]!r}")
    if not isinstance(config, Mapping):
        raise V1Error(f"smp.init(config) takes a dict of v1 parameters, got {type(config).__name__}")
    raw = dict(config)
    _refuse_unsupported(raw)
    return _parse(raw)


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    for key, value in raw.items():
        if key.startswith(_SHARDED_PREFIX):
            raise V1Error(f"v1 parameter {key!r} {_SDP_TUNING}")
        if key in REFUSED:
            off, why = REFUSED[key]
            if value != off:
                raise V1Error(f"v1 parameter {key}={value!r} is not supported: {why}. Remove the key or set it "
                              f"to {off!r}")
        elif key not in NO_EFFECT and key not in HONOURED:
            known = sorted([*HONOURED, *NO_EFFECT, *REFUSED])
            raise V1Error(f"unknown v1 parameter {key!r}; the parameters are {', '.join(known)} "
                          f"(the {_SHARDED_PREFIX}* keys of v1's sharded data parallelism are refused: each "
                          f"{_SDP_TUNING})")


def _parse(raw: dict[str, Any]) -> V1Config:
    partitions = _degree(raw)
    microbatches = _int(raw, "microbatches", 1)
    pipeline = raw.get("pipeline", "interleaved")
    if pipeline not in SCHEDULES:
        raise V1Error(f"v1 parameter pipeline={pipeline!r}: choose \"interleaved\" (1F1B) or \"simple\" (GPipe)")
    ddp = _bool(raw, "ddp", False)
    placement = raw.get("placement_strategy", "cluster")
    if placement not in PLACEMENTS:
        raise V1Error(f"v1 parameter placement_strategy={placement!r}: choose \"cluster\", \"spread\" or an order "
                      "of the letters D, P, T (e.g. \"DPT\")")
    auto = _bool(raw, "auto_partition", True)
    default = _int(raw, "default_partition", 0, low=0)
    if default >= partitions:
        raise V1Error(f"v1 parameter default_partition={default} is not a partition: there are {partitions} "
                      f"(0..{partitions - 1})")
    timeout = raw.get("timeout", DEFAULT_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise V1Error(f"parameter timeout={timeout!r}: seconds, a number > 0")
    cfg = V1Config(partitions=partitions, microbatches=microbatches, pipeline=pipeline, ddp=ddp,
                   placement_strategy=placement, auto_partition=auto, default_partition=default,
                   memory_weight=_memory_weight(raw), active_microbatches=_active(raw),
                   timeout=float(timeout), **_sharding(raw))
    return cfg


def _sharding(raw: dict[str, Any]) -> dict[str, Any]:
    """v1's two sharding keys as smp's mode: ``shard_optimizer_state`` (optimizer state and gradients) ->
    shard_grad_op, ``sharded_data_parallel_degree`` > 1 (parameters too) -> full_shard."""
    optimizer_only = _bool(raw, "shard_optimizer_state", False)
    degree = _int(raw, "sharded_data_parallel_degree", 1)
    if optimizer_only and degree > 1:
        raise V1Error(f"v1 parameters shard_optimizer_state=true and sharded_data_parallel_degree={degree} ask for "
                      "two kinds of sharding: keep sharded_data_parallel_degree (parameters, gradients and optimizer "
                      "state sharded: smp's full_shard) or shard_optimizer_state (optimizer state and gradients: "
                      "shard_grad_op)")
    if (optimizer_only or degree > 1) and not _bool(raw, "ddp", False):
        raise V1Error("v1 sharding (shard_optimizer_state, sharded_data_parallel_degree) splits state over the "
                      "data-parallel replicas: set \"ddp\": true")
    mode = "full_shard" if degree > 1 else "shard_grad_op" if optimizer_only else "none"
    return {"sharding": mode, "sharded_degree": degree}


def _degree(raw: dict[str, Any]) -> int:
    given = {k: raw[k] for k in ("partitions", "pipeline_parallel_degree") if k in raw}
    if not given:
        raise V1Error("the v1 configuration needs \"partitions\" (or \"pipeline_parallel_degree\"): the number of "
                      "pipeline stages to split the model into")
    values = {k: _int(raw, k, 1) for k in given}
    if len(set(values.values())) > 1:
        raise V1Error(f"partitions and pipeline_parallel_degree are two names of one setting and disagree: {values}")
    return next(iter(values.values()))


def _memory_weight(raw: dict[str, Any]) -> float | None:
    optimize = raw.get("optimize")
    if optimize is not None and optimize not in MEMORY_WEIGHT_OF:
        raise V1Error(f"v1 parameter optimize={optimize!r}: choose \"speed\" or \"memory\"")
    if "memory_weight" not in raw:
        return MEMORY_WEIGHT_OF[optimize] if optimize is not None else None
    w = raw["memory_weight"]
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0 or math.isnan(w):
        raise V1Error(f"v1 parameter memory_weight={w!r}: a number from 0.0 (balance compute) to 1.0 (balance "
                      "memory)")
    return float(w)


def _active(raw: dict[str, Any]) -> int | None:
    """v1's cap on microbatches in flight, which smp's gpipe and 1f1b schedules take as it is."""
    return _int(raw, "active_microbatches", 1) if "active_microbatches" in raw else None


def _int(raw: dict[str, Any], key: str, default: int, low: int = 1) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise V1Error(f"v1 parameter {key}={value!r}: an integer >= {low}")
    return value


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise V1Error(f"v1 parameter {key}={value!r}: true or false")
    return value
