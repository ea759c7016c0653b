"""Cluster: uniform and profile-built clusters, links across node boundaries, errors."""

import json
import math

import pytest

import partitioner.devices as devices_mod
from partitioner.cluster import Cluster
from partitioner.errors import ClusterError, ProfileError, StageCountError

PROFILE = {
    "kind": "smp.profile", "schema": 1, "name": "tiny-2x2",
    "device": {"name": "Tiny GPU", "type": "cuda", "peak_flops": {"bf16": 1e14},
               "memory_bytes": 1_000_000, "memory_bandwidth": 1e12, "efficiency": 0.5},
    "topology": {"nodes": 2, "devices_per_node": 2},
    "links": {"intra_node": {"name": "NVLink", "bandwidth": 4e11, "latency": 2e-6},
              "inter_node": {"name": "IB", "bandwidth": 5e10, "latency": 5e-6}},
    "sources": {"device.memory_bytes": "made up for tests"},
}


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "tiny-2x2.json"
    path.write_text(json.dumps(PROFILE))
    return path


def test_uniform():
    c = Cluster.uniform(4, bandwidth=1e10, latency=1e-6, memory=2e9, speed=2.0)
    assert len(c) == 4 and c.speeds == [2.0] * 4
    assert c.link(0, 3).bandwidth == 1e10 and c.link(1, 2).latency == 1e-6
    assert c.links[0].seconds(1e10) == pytest.approx(1.0 + 1e-6)
    assert c.links[0].seconds(0) == 0.0


def test_load_profile_topology(profile_path):
    c = Cluster.load(profile_path)
    assert len(c) == 4 and [d.node for d in c.devices] == [0, 0, 1, 1]
    assert [lk.name for lk in c.links] == ["NVLink", "IB", "NVLink"]
    assert c.link(0, 1).name == "NVLink" and c.link(0, 2).name == "IB" and c.link(2, 3).name == "NVLink"
    assert c.link(1, 3).bandwidth == 5e10
    assert all(d.speed == 1.0 and d.memory == 1_000_000 for d in c.devices)
    assert len(Cluster.load(profile_path, devices=3)) == 3
    assert len(Cluster.load(profile_path, devices=6).links) == 5


def test_load_bare_name(profile_path, monkeypatch):
    monkeypatch.setattr(devices_mod, "PROFILES_DIR", profile_path.parent)
    assert Cluster.load("tiny-2x2").name == "tiny-2x2"
    assert Cluster.load("tiny").name == "tiny-2x2"
    with pytest.raises(ProfileError, match="no device profile"):
        Cluster.load("nonexistent-gpu")


def test_bad_profile(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        Cluster.load(p)
    p.write_text(json.dumps({"kind": "other"}))
    with pytest.raises(ProfileError, match="not an smp device profile"):
        Cluster.load(p)


def test_round_trip_and_infinite_bandwidth():
    c = Cluster.heterogeneous([1.0, 2.0, 0.5], bandwidths=[1e9, math.inf], latencies=[1e-6, 0.0],
                              memories=[1e9, None, 2e9])
    d = json.loads(json.dumps(c.to_dict()))
    assert Cluster.from_dict(d) == c


def test_errors():
    with pytest.raises(ClusterError):
        Cluster.uniform(0, bandwidth=1e9)
    with pytest.raises(ClusterError, match="bandwidth"):
        Cluster.uniform(2, bandwidth=0)
    with pytest.raises(ClusterError, match="speed"):
        Cluster.uniform(2, bandwidth=1e9, speed=0)
    with pytest.raises(StageCountError, match="fewer stages"):
        Cluster.uniform(2, bandwidth=1e9).for_stages(3)
