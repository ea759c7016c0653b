"""Device and link profiles (profiles/*.json): load them by name or path, and read their figures."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from partitioner.errors import ProfileError

__all__ = ["DeviceSpec", "load_profile", "find_profile", "list_profiles", "dtype_key", "PROFILE_SCHEMA_VERSION",
           "PROFILES_DIR"]

PROFILE_SCHEMA_VERSION = 1

#: The profiles that ship with smp: package data of the ``profiles`` package, found the
#: same way in a checkout and in an installed wheel.
PROFILES_DIR = Path(str(resources.files("profiles")))


def list_profiles() -> list[str]:
    """Names of the profiles that ship with smp."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def find_profile(name_or_path: str | Path) -> Path:
    """The profile file: a path, a built-in name (``h100-sxm``), or the unique built-in name it begins."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidates = [PROFILES_DIR / f"{name_or_path}.json", PROFILES_DIR / str(name_or_path)]
    candidates += sorted(PROFILES_DIR.glob(f"{name_or_path}*.json"))
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise ProfileError(
            f"no device profile {str(name_or_path)!r}: give a path to a profile JSON or one of the built-in "
            f"names ({', '.join(list_profiles()) or 'none'}); `smp calibrate -o my-machine.json` measures this one")
    return found


def load_profile(name_or_path: str | Path | dict) -> dict[str, Any]:
    """A profile as a dict, from a path to a JSON file or a built-in name (see :func:`find_profile`)."""
    if isinstance(name_or_path, dict):
        data = name_or_path
        source = "<dict>"
    else:
        path = find_profile(name_or_path)
        source = str(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ProfileError(f"device profile {source} is not valid JSON ({err}); fix or regenerate it") from None
    if data.get("kind") != "smp.profile":
        raise ProfileError(f"{source} is not an smp device profile (no \"kind\": \"smp.profile\")")
    if data.get("schema", 0) > PROFILE_SCHEMA_VERSION:
        raise ProfileError(f"{source} uses profile schema {data['schema']}, newer than this smp understands "
                         f"({PROFILE_SCHEMA_VERSION}); upgrade smp")
    for key in ("device", "links"):
        if key not in data:
            raise ProfileError(f"device profile {source} has no {key!r} section")
    return data


def dtype_key(dtype: torch.dtype) -> str:
    """The key of ``peak_flops`` that a tensor of ``dtype`` computes at."""
    return {
        torch.float64: "fp64",
        torch.float32: "fp32",
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float8_e4m3fn: "fp8",
        torch.float8_e5m2: "fp8",
    }.get(dtype, "fp32")


@dataclass(frozen=True)
class DeviceSpec:
    """The compute figures of one device: peak FLOP/s per dtype, memory, bandwidth, efficiency."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    efficiency: float = 0.5

    @classmethod
    def from_profile(cls, profile: str | Path | dict) -> DeviceSpec:
        device = load_profile(profile)["device"]
        return cls(
            name=device.get("name", "device"),
            peak_flops=dict(device["peak_flops"]),
            memory_bytes=float(device.get("memory_bytes", 0)),
            memory_bandwidth=float(device["memory_bandwidth"]),
            efficiency=float(device.get("efficiency", 0.5)),
        )

    def flops_per_second(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype``: peak times efficiency (fp32 peak when unknown)."""
        peak = self.peak_flops.get(dtype, self.peak_flops.get("fp32"))
        if peak is None:
            raise ValueError(f"device profile {self.name!r} gives no peak FLOP/s for {dtype} or fp32")
        return peak * self.efficiency

    def op_time(self, flops: float, bytes_moved: float, dtype: str) -> float:
        """Roofline time of an op: bound by compute or by memory traffic, whichever is slower."""
        return max(flops / self.flops_per_second(dtype), bytes_moved / self.memory_bandwidth)
