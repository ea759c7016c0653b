"""Device and link profiles (profiles/*.json): load them by name or path, and read their figures."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["DeviceSpec", "load_profile", "profiles_dir", "list_profiles", "dtype_key", "PROFILE_SCHEMA_VERSION"]

PROFILE_SCHEMA_VERSION = 1


def profiles_dir() -> Path:
    """The repository's profiles/ directory (profiles that ship with smp)."""
    return Path(__file__).resolve().parent.parent / "profiles"


def list_profiles() -> list[str]:
    """Names of the profiles that ship with smp."""
    return sorted(p.stem for p in profiles_dir().glob("*.json"))


def load_profile(name_or_path: str | Path | dict) -> dict[str, Any]:
    """A profile as a dict, from a path to a JSON file or the name of one in profiles/."""
    if isinstance(name_or_path, dict):
        data = name_or_path
        source = "<dict>"
    else:
        path = Path(name_or_path)
        if not path.suffix and not path.exists():
            path = profiles_dir() / f"{name_or_path}.json"
        if not path.exists():
            known = ", ".join(list_profiles())
            raise FileNotFoundError(
                f"no device profile {str(name_or_path)!r}: give a path to a profile JSON or one of "
                f"the built-in names ({known}); `smp calibrate -o profiles/NAME.json` measures this machine")
        source = str(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"device profile {source} is not valid JSON: {err}") from None
    if data.get("kind") != "smp.profile":
        raise ValueError(f"{source} is not an smp device profile (it lacks \"kind\": \"smp.profile\")")
    if data.get("schema", 0) > PROFILE_SCHEMA_VERSION:
        raise ValueError(f"{source} uses profile schema {data['schema']}, newer than this smp understands "
                         f"({PROFILE_SCHEMA_VERSION}); upgrade smp")
    for key in ("device", "links"):
        if key not in data:
            raise ValueError(f"device profile {source} has no {key!r} section")
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
