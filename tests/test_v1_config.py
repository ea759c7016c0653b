"""smp.v1's configuration (v1 keys, SM_HP_MP_PARAMETERS, refusals) and rank placement (torchrun, mpirun; cluster,
spread)."""

from __future__ import annotations

import json

import pytest
import torch

import smp.v1 as smp
from smp.v1.config import ENV_VAR, NO_EFFECT, REFUSED, load_config
from smp.v1.ranks import Launch, export_for_torch, from_environment, topology


def test_keys_map_onto_smp() -> None:
    cfg = load_config({"pipeline_parallel_degree": 4, "microbatches": 8, "pipeline": "simple", "ddp": True,
                       "placement_strategy": "spread", "auto_partition": False, "default_partition": 3,
                       "optimize": "memory", "active_microbatches": 8, "deterministic_server": True})
    assert (cfg.partitions, cfg.microbatches, cfg.schedule, cfg.ddp) == (4, 8, "gpipe", True)
    assert (cfg.axis_order, cfg.auto_partition, cfg.default_partition) == ("TPD", False, 3)
    assert cfg.memory_weight == 0.8  # v1's documented weight for optimize="memory"
    assert load_config({"partitions": 2}).schedule == "1f1b"  # v1's "interleaved" (its default) is 1F1B
    assert load_config({"partitions": 2}).memory_weight is None  # nothing asked: smp's fastest plan that fits
    assert load_config({"partitions": 2, "optimize": "speed", "memory_weight": 0.5}).memory_weight == 0.5
    assert load_config({"partitions": 4, "microbatches": 8, "active_microbatches": 2}).active_microbatches == 2


def test_the_configuration_is_one_planning_request() -> None:
    cfg = load_config({"partitions": 4, "microbatches": 8, "pipeline": "simple", "placement_strategy": "spread",
                       "active_microbatches": 2, "ddp": True})
    request = cfg.request(data_parallel=2)
    assert (request.stages, request.microbatches, request.schedule, request.placement) == (4, 8, "gpipe", "spread")
    assert (request.active_microbatches, request.data_parallel) == (2, 2)
    assert load_config({"partitions": 4}).request(data_parallel=1).microbatches == 1  # v1's default, not smp's


def test_configuration_from_sagemakers_environment_variable() -> None:
    env = {ENV_VAR: json.dumps({"partitions": 2, "microbatches": 4, "pipeline": "interleaved", "ddp": True})}
    cfg = load_config(None, env)
    assert (cfg.partitions, cfg.microbatches, cfg.ddp) == (2, 4, True)
    with pytest.raises(smp.V1Error, match=f"no configuration.*{ENV_VAR}"):
        load_config(None, {})
    with pytest.raises(smp.V1Error, match=f"{ENV_VAR} is not valid JSON"):
        load_config(None, {ENV_VAR: "{partitions: 2"})


@pytest.mark.parametrize("key,value", [("tensor_parallel_degree", 2), ("fp16", True), ("sdp_max_live_parameters", 1),
                                       ("skip_tracing", True)])
def test_unsupported_features_are_refused_by_name(key: str, value: object) -> None:
    with pytest.raises(smp.V1Error, match=key):
        load_config({"partitions": 2, key: value})


def test_v1_sharding_keys_map_onto_smps_modes() -> None:
    def cfg(**keys: object):
        return load_config({"partitions": 2, "ddp": True, **keys})

    assert (cfg().sharding, cfg(shard_optimizer_state=False).sharding) == ("none", "none")  # v1: nothing unasked
    assert cfg(shard_optimizer_state=True).sharding == "shard_grad_op"
    assert cfg(sharded_data_parallel_degree=1).sharding == "none"
    full = cfg(sharded_data_parallel_degree=4)
    assert full.sharding == "full_shard" and full.request(data_parallel=4).sharding == "full_shard"
    assert cfg(shard_optimizer_state=True).request(data_parallel=2).sharding == "shard_grad_op"
    assert cfg().request(data_parallel=2).sharding == "none"


@pytest.mark.parametrize(("keys", "replicas", "match"), [
    ({"sharded_data_parallel_degree": 4}, 2, "sharded_data_parallel_degree=4.*2 data-parallel replicas.*all its"),
    ({"sharded_data_parallel_degree": 2}, 4, "sharded_data_parallel_degree=2.*4 data-parallel replicas"),
    ({"shard_optimizer_state": True}, 1, "shard_optimizer_state shards over the data-parallel replicas.*has one"),
])
def test_v1_sharding_must_fit_the_replicas(keys: dict, replicas: int, match: str) -> None:
    with pytest.raises(smp.V1Error, match=match):
        load_config({"partitions": 2, "ddp": True, **keys}).request(data_parallel=replicas)


@pytest.mark.parametrize(("keys", "match"), [
    ({"shard_optimizer_state": True, "sharded_data_parallel_degree": 2, "ddp": True}, "two kinds of sharding"),
    ({"shard_optimizer_state": True}, "set \"ddp\": true"),
    ({"sharded_data_parallel_degree": 2, "ddp": False}, "set \"ddp\": true"),
    ({"shard_optimizer_state": "yes", "ddp": True}, "shard_optimizer_state='yes': true or false"),
    ({"sharded_data_parallel_degree": 0, "ddp": True}, "sharded_data_parallel_degree=0: an integer >= 1"),
])
def test_bad_v1_sharding_says_what_to_fix(keys: dict, match: str) -> None:
    with pytest.raises(smp.V1Error, match=match):
        load_config({"partitions": 2, **keys})


def test_keys_that_ask_for_nothing_are_accepted() -> None:
    off = {key: value for key, (value, _) in REFUSED.items()}
    cfg = load_config({"partitions": 2, **off, **{key: True for key in NO_EFFECT}})
    assert cfg.partitions == 2


@pytest.mark.parametrize("config,match", [
    ({}, "needs \"partitions\""),
    ({"partitions": 2, "pipeline_parallel_degree": 4}, "disagree"),
    ({"partitions": 0}, "partitions=0"),
    ({"partitions": 2, "partition": 2}, "unknown v1 parameter 'partition'"),
    ({"partitions": 2, "pipeline": "1f1b"}, "interleaved.*simple"),
    ({"partitions": 2, "memory_weight": 1.5}, "memory_weight"),
    ({"partitions": 2, "default_partition": 2}, "default_partition=2"),
    ({"partitions": 2, "placement_strategy": "random"}, "placement_strategy"),
    ({"partitions": 2, "active_microbatches": 0}, "active_microbatches=0"),
])
def test_bad_configurations_say_what_to_fix(config: dict, match: str) -> None:
    with pytest.raises(smp.V1Error, match=match):
        load_config(config)


def test_ranks_from_torchrun_and_mpirun() -> None:
    assert from_environment({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == \
        Launch(3, 8, 1, 2, "torchrun")
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert from_environment(ompi) == Launch(5, 8, 1, 4, "Open MPI")
    assert from_environment({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}) == \
        Launch(1, 2, 1, 2, "MPICH / Intel MPI")
    assert from_environment({}) == Launch(0, 1, 0, 1, None)
    env: dict[str, str] = {}
    export_for_torch(Launch(1, 2, 1, 2, "Open MPI"), env)
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(smp.V1Error, match="MASTER_ADDR"):  # several machines: rank 0's host must be exported
        export_for_torch(Launch(5, 8, 1, 4, "Open MPI"), {})


def test_placement_follows_v1s_documented_groups() -> None:
    """v1's docs: 8 ranks, 2 partitions; spread: model replicas [0, 4], [1, 5], ..., cluster: [0, 1], [2, 3], ..."""
    spread = load_config({"partitions": 2, "ddp": True, "placement_strategy": "spread"})
    t = topology(6, 8, spread)
    assert (t.pp_rank, t.dp_rank, t.mp_group, t.dp_group) == (1, 2, (2, 6), (4, 5, 6, 7))
    cluster = load_config({"partitions": 2, "ddp": True})
    t = topology(6, 8, cluster)
    assert (t.pp_rank, t.dp_rank, t.mp_group, t.dp_group) == (0, 3, (6, 7), (0, 2, 4, 6))
    assert topology(0, 1, cluster).pp_size == 2  # a lone process runs every partition
    with pytest.raises(smp.V1Error, match="multiple of 2"):
        topology(0, 3, cluster)


def test_more_ranks_than_partitions_needs_ddp(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(smp.V1Error, match="set \"ddp\": true"):
        smp.init({"partitions": 2, "ddp": False})


@pytest.mark.parametrize(("strategy", "placement"), [("cluster", "cluster"), ("spread", "spread"), ("DPT", "cluster"),
                                                     ("DTP", "cluster"), ("TDP", "cluster"), ("PDT", "spread"),
                                                     ("PTD", "spread"), ("TPD", "spread")])
def test_placement_strategies_map_onto_smps_placements(strategy: str, placement: str) -> None:
    """Without tensor parallelism only the order of D and P matters: D first keeps each replica on neighbouring
    ranks (smp's "cluster"), P first each partition's replicas (smp's "spread"); the ranks are smp's layout's."""
    cfg = load_config({"partitions": 2, "ddp": True, "placement_strategy": strategy})
    assert cfg.placement == placement
    # runtime.layout.ReplicaLayout: a DeviceMesh of shape (dp, pp) for "cluster", (pp, dp) for "spread"
    mesh = torch.arange(8).reshape((4, 2) if placement == "cluster" else (2, 4))
    for r in range(8):
        t = topology(r, 8, cfg)
        pp_dim = mesh if placement == "cluster" else mesh.T
        assert pp_dim[t.dp_rank, t.pp_rank] == r
        assert t.mp_group == tuple(pp_dim[t.dp_rank].tolist())
        assert t.dp_group == tuple(pp_dim[:, t.pp_rank].tolist())


def test_helpers_need_init(monkeypatch: pytest.MonkeyPatch) -> None:
    import smp.v1.state as state

    monkeypatch.setattr(state, "_state", None)
    with pytest.raises(smp.V1Error, match="smp.init"):
        smp.rank()
    smp.init({"partitions": 2, "microbatches": 2})
    assert (smp.rank(), smp.size(), smp.pp_rank(), smp.pp_size(), smp.dp_rank(), smp.dp_size()) == (0, 1, 0, 2, 0, 1)
    assert (smp.mp_rank(), smp.mp_size(), smp.tp_size(), smp.is_initialized()) == (0, 2, 1, True)
    assert smp.allgather("x") == ["x"] and smp.get_mp_group() == [0]
    smp.barrier()  # alone: nothing to wait for


def test_the_migration_guide_covers_every_call_and_key() -> None:
    """docs/smp-v1.md's tables name every public name of smp.v1 and every configuration key it knows."""
    from pathlib import Path

    from smp.v1.config import HONOURED

    doc = (Path(__file__).resolve().parent.parent / "docs" / "smp-v1.md").read_text()
    names = [n for n in smp.__all__ if f"`smp.{n}" not in doc and f"`{n}" not in doc and f" {n}`" not in doc]
    assert not names, f"docs/smp-v1.md does not mention {names}"
    keys = [k for k in [*HONOURED, *NO_EFFECT, *REFUSED] if f"`{k}`" not in doc]
    assert not keys, f"docs/smp-v1.md does not mention the keys {keys}"
