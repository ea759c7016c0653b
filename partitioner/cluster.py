"""Cluster: the devices pipeline stages run on (stage j on device j) and the links between them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from partitioner.devices import find_profile, load_profile
from partitioner.errors import ClusterError, ProfileError, StageCountError

__all__ = ["Device", "Link", "Cluster"]


def _num_or_none(x: float | None) -> float | None:
    """JSON has no infinity: an infinite bandwidth or memory is written as null."""
    return None if x is None or math.isinf(x) else x


@dataclass(frozen=True)
class Link:
    """A point-to-point link: ``bandwidth`` in bytes/s (inf = free), ``latency`` in seconds."""

    name: str = "link"
    bandwidth: float = math.inf
    latency: float = 0.0

    def seconds(self, nbytes: float) -> float:
        """Time to move one tensor of ``nbytes`` over this link (0 bytes costs nothing)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / self.bandwidth + self.latency

    def allreduce_seconds(self, nbytes: float, participants: int) -> float:
        """A ring all-reduce of ``nbytes`` among ``participants`` over this link (Patarasuk & Yuan, 2009).

        Each rank sends and receives 2 (n - 1) / n of the data in 2 (n - 1) steps, each
        paying the link's latency.
        """
        if participants < 2 or nbytes <= 0:
            return 0.0
        n = participants
        return 2 * (n - 1) / n * nbytes / self.bandwidth + 2 * (n - 1) * self.latency

    def allgather_seconds(self, nbytes: float, participants: int) -> float:
        """A ring all-gather of ``nbytes`` in all (each of the ``participants`` holds 1/n) over this link: each rank
        sends and receives (n - 1) / n of the data in n - 1 steps, half an all-reduce. A ring reduce-scatter
        moves the same (:meth:`reduce_scatter_seconds`); an all-reduce is one of each."""
        if participants < 2 or nbytes <= 0:
            return 0.0
        n = participants
        return (n - 1) / n * nbytes / self.bandwidth + (n - 1) * self.latency

    def reduce_scatter_seconds(self, nbytes: float, participants: int) -> float:
        """A ring reduce-scatter of ``nbytes`` (each of the ``participants`` ends with its reduced 1/n): as long as
        :meth:`allgather_seconds`."""
        return self.allgather_seconds(nbytes, participants)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bandwidth": _num_or_none(self.bandwidth), "latency": self.latency}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Link:
        bw = d.get("bandwidth")
        return cls(str(d.get("name", "link")), math.inf if bw is None else float(bw),
                   float(d.get("latency", 0.0)))


@dataclass(frozen=True)
class Device:
    """One accelerator: relative ``speed`` (graph times are divided by it) and ``memory`` in bytes.

    ``host_link``: the link to host memory that activation offloading copies over (PCIe on a
    GPU); None where the device's memory is host memory already (a CPU), so offloading moves
    nothing off it (docs/memory.md#activation-offloading)."""

    name: str = "device"
    speed: float = 1.0
    memory: float | None = None
    node: int = 0
    host_link: Link | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "speed": self.speed, "memory": _num_or_none(self.memory), "node": self.node}
        if self.host_link is not None:
            out["host_link"] = self.host_link.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Device:
        host = d.get("host_link")
        return cls(d.get("name", "device"), float(d.get("speed", 1.0)),
                   None if d.get("memory") is None else float(d["memory"]), int(d.get("node", 0)),
                   None if host is None else Link.from_dict(host))


@dataclass(frozen=True)
class Cluster:
    """Devices in pipeline order and the links between consecutive devices.

    ``links[j]`` joins device ``j`` and ``j + 1``. A tensor sent from stage ``a`` to a
    later stage ``b`` goes point to point; its cost uses :meth:`link` ``(a, b)``, the
    slowest consecutive link between them (lowest bandwidth, highest latency). For a
    node-major topology this is exactly the intra-node link when both devices share a
    node and the inter-node link otherwise.
    """

    devices: tuple[Device, ...]
    links: tuple[Link, ...]
    name: str = "cluster"
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.devices:
            raise ClusterError("a cluster needs at least one device; pass devices >= 1")
        if len(self.links) != len(self.devices) - 1:
            raise ClusterError(
                f"a cluster of {len(self.devices)} devices needs {len(self.devices) - 1} links "
                f"(one between each consecutive pair), got {len(self.links)}")
        for d in self.devices:
            if not d.speed > 0:
                raise ClusterError(f"device {d.name!r} has speed {d.speed}; speeds must be > 0")
            if d.memory is not None and not d.memory > 0:
                raise ClusterError(f"device {d.name!r} has memory {d.memory}; give bytes > 0 or None")
        for lk in self.links:
            if not lk.bandwidth > 0 or lk.latency < 0:
                raise ClusterError(f"link {lk.name!r} has bandwidth {lk.bandwidth} and latency "
                                   f"{lk.latency}; need bandwidth > 0 bytes/s and latency >= 0 s")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def uniform(cls, devices: int, *, bandwidth: float, latency: float = 0.0,
                memory: float | None = None, speed: float = 1.0, name: str | None = None) -> Cluster:
        """``devices`` identical devices in a line, every link the same."""
        if devices < 1:
            raise ClusterError(f"Cluster.uniform needs devices >= 1, got {devices}")
        devs = tuple(Device(f"dev{i}", float(speed), memory, 0) for i in range(devices))
        links = tuple(Link("link", float(bandwidth), float(latency)) for _ in range(devices - 1))
        return cls(devs, links, name or f"uniform-{devices}")

    @classmethod
    def free(cls, devices: int) -> Cluster:
        """Identical devices with free communication and no memory limit (the default when none given)."""
        return cls.uniform(devices, bandwidth=math.inf, name=f"ideal-{devices}")

    @classmethod
    def heterogeneous(cls, speeds: Sequence[float], *, bandwidths: Sequence[float],
                      latencies: Sequence[float] | None = None,
                      memories: Sequence[float | None] | None = None) -> Cluster:
        """Devices with their own speeds and memories, links with their own bandwidths."""
        n = len(speeds)
        lat = list(latencies) if latencies is not None else [0.0] * (n - 1)
        mem = list(memories) if memories is not None else [None] * n
        devs = tuple(Device(f"dev{i}", float(s), mem[i], i) for i, s in enumerate(speeds))
        links = tuple(Link(f"link{i}", float(b), float(lat[i])) for i, b in enumerate(bandwidths))
        return cls(devs, links, "heterogeneous")

    @classmethod
    def load(cls, path: str | Path, *, devices: int | None = None) -> Cluster:
        """A cluster from an ``smp.profile`` JSON file, or a built-in profile name (``h100-sxm``).

        Devices fill nodes in order (``devices_per_node`` per node); the link between
        device j and j+1 is the intra-node link when both are on one node, else the
        inter-node link. Profile devices have speed 1.0: graph times are taken to be
        measured (or estimated) for that device type already.
        """
        found = find_profile(path)
        return cls.from_profile(load_profile(found), devices=devices, source=str(found))

    @classmethod
    def from_profile(cls, data: Mapping[str, Any], *, devices: int | None = None,
                     source: str = "<dict>") -> Cluster:
        """A cluster from a parsed ``smp.profile`` document (see :meth:`load`)."""
        if data.get("kind") != "smp.profile":
            raise ProfileError(f"{source} is not an smp device profile (no \"kind\": \"smp.profile\")")
        try:
            dev = data["device"]
            topo = data.get("topology", {})
            per_node = int(topo.get("devices_per_node", 1))
            nodes = int(topo.get("nodes", 1))
            links = data.get("links", {})
            intra = Link.from_dict(links.get("intra_node", links.get("inter_node", {})))
            inter = Link.from_dict(links.get("inter_node", links.get("intra_node", {})))
        except (KeyError, TypeError, ValueError) as err:
            raise ProfileError(f"profile {source} is missing or mangles a field ({err!r}); "
                               "see profiles/README or docs/cost-model.md for the format") from None
        count = devices if devices is not None else nodes * per_node
        if count < 1 or per_node < 1:
            raise ProfileError(f"profile {source} describes {count} devices; need at least one")
        memory = dev.get("memory_bytes")
        host = Link.from_dict({"name": "host", **dev["host_link"]}) if dev.get("host_link") else None
        devs = tuple(Device(f"{dev.get('name', 'device')}#{i}", 1.0,
                            float(memory) if memory else None, i // per_node, host) for i in range(count))
        lks = tuple(intra if devs[j].node == devs[j + 1].node else inter for j in range(count - 1))
        return cls(devs, lks, str(data.get("name", Path(source).stem)), {"profile": dict(data)})

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self.devices)

    @property
    def speeds(self) -> list[float]:
        return [d.speed for d in self.devices]

    def link(self, a: int, b: int) -> Link:
        """The link a tensor from device ``a`` to device ``b`` (a < b) uses: the slowest in between."""
        if not 0 <= a < b < len(self.devices):
            raise IndexError(f"no link from device {a} to device {b} in a cluster of {len(self)}")
        if b == a + 1:
            return self.links[a]
        span = self.links[a:b]
        bw = min(lk.bandwidth for lk in span)
        lat = max(lk.latency for lk in span)
        name = next(lk.name for lk in span if lk.bandwidth == bw)
        return Link(name, bw, lat)

    def for_stages(self, stages: int) -> Cluster:
        """The first ``stages`` devices (stage j runs on device j)."""
        if stages > len(self.devices):
            raise StageCountError(
                f"{stages} stages need {stages} devices but the cluster {self.name!r} has "
                f"{len(self.devices)}; use fewer stages or a larger cluster (Cluster.load(..., devices=N))")
        if stages == len(self.devices):
            return self
        return Cluster(self.devices[:stages], self.links[:stages - 1], self.name, self.meta)

    def subset(self, indices: Sequence[int]) -> Cluster:
        """The devices at ``indices`` (in that order) as a cluster: each link the slowest between its two devices."""
        idx = list(indices)
        if not idx or any(not 0 <= i < len(self.devices) for i in idx):
            raise ClusterError(f"devices {idx} are not all in the cluster's 0..{len(self.devices) - 1}")
        links = tuple(self.link(min(a, b), max(a, b)) for a, b in zip(idx, idx[1:]))
        return Cluster(tuple(self.devices[i] for i in idx), links, self.name, self.meta)

    def interleaved(self, ranks: int, virtual_stages: int) -> Cluster:
        """The stages' view of an interleaved pipeline: stage s runs on device s mod ``ranks``, with
        1/``virtual_stages`` of its memory (a rank's stages share it, as a ``memory_limit`` is shared: each stage
        had the whole device, so a rank's two stages could plan for twice its memory).

        Links follow the devices; the link from the last rank back to the first (between
        two chunks) is taken to be the slowest link of the cluster.
        """
        if virtual_stages == 1:
            return self
        devices = tuple(replace(d, memory=None if d.memory is None else d.memory / virtual_stages)
                        for d in (self.devices[s % ranks] for s in range(ranks * virtual_stages)))
        wrap = min(self.links, key=lambda lk: (lk.bandwidth, -lk.latency)) if self.links else Link("local", math.inf, 0.0)
        links = tuple(self.links[s % ranks] if (s % ranks) < ranks - 1 else wrap
                      for s in range(ranks * virtual_stages - 1))
        return Cluster(devices, links, f"{self.name} x{virtual_stages} virtual")

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "smp.cluster", "name": self.name,
                "devices": [d.to_dict() for d in self.devices],
                "links": [lk.to_dict() for lk in self.links]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cluster:
        devs = tuple(Device.from_dict(x) for x in d["devices"])
        links = tuple(Link.from_dict(x) for x in d["links"])
        return cls(devs, links, d.get("name", "cluster"))
