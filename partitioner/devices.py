"""Device and link profiles (profiles/*.json): load them by name or path, and read their figures."""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import torch

from partitioner.errors import ProfileError

__all__ = ["DeviceSpec", "EfficiencyCurve", "Kernel", "KERNEL_KINDS", "load_profile", "find_profile",
           "list_profiles", "dtype_key", "dtype_name", "DTYPE_NAMES", "DTYPE_ALIASES", "PROFILE_SCHEMA_VERSION",
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


_DTYPE_KEYS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8"}
#: The dtype names a price is asked in (``dtype=``, ``--dtype``), each a key of a profile's ``peak_flops``.
DTYPE_NAMES: tuple[str, ...] = tuple(dict.fromkeys(_DTYPE_KEYS.values()))
#: Other spellings of those names (torch's), taken as them.
DTYPE_ALIASES = {"float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32", "bfloat16": "bf16",
                 "float16": "fp16", "half": "fp16"}


def dtype_key(dtype: torch.dtype) -> str:
    """The key of ``peak_flops`` that a tensor of ``dtype`` computes at."""
    return _DTYPE_KEYS.get(dtype, "fp32")


def dtype_name(value: str) -> str:
    """``value`` as one of :data:`DTYPE_NAMES` (``"bfloat16"`` -> ``"bf16"``, any case); a ValueError naming them
    when it is none."""
    key = str(value).strip().lower()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {value!r}; choose one of {', '.join(DTYPE_NAMES)} (bf16 and fp16 price a "
                         "mixed-precision run, as torch.autocast makes it)")
    return key


#: What a counted FLOP runs in: a matrix product (mm, bmm, addmm, attention) or a convolution.
KERNEL_KINDS = ("gemm", "conv")


class Kernel(NamedTuple):
    """One FLOP-counted kernel of an op: its kind (``KERNEL_KINDS``) and FLOPs."""

    kind: str
    flops: int


@dataclass(frozen=True)
class EfficiencyCurve:
    """Fraction of peak FLOP/s a kernel reaches, by log2 of its FLOPs: linear between points, flat beyond them."""

    points: tuple[tuple[float, float], ...]

    @classmethod
    def parse(cls, points: Iterable[Iterable[float]], where: str) -> EfficiencyCurve:
        pairs = tuple(sorted((float(x), float(y)) for x, y in points))
        if not pairs or any(y <= 0 for _, y in pairs) or len({x for x, _ in pairs}) != len(pairs):
            raise ProfileError(f"{where}: give [log2 FLOPs, efficiency] points with distinct log2 FLOPs and "
                               "efficiencies above 0")
        return cls(pairs)

    def at(self, flops: float) -> float:
        x = _log2(flops)
        xs = [p[0] for p in self.points]
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return self.points[0][1]
        if i == len(xs):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _log2(value: float) -> float:
    return math.log2(value) if value > 0 else float("-inf")


def _curves(tables: Mapping[str, Any] | None, where: str) -> dict[str, EfficiencyCurve]:
    """A profile's efficiency tables: dtype (or "*", any other dtype) -> curve."""
    return {dtype: EfficiencyCurve.parse(points, f"{where}.{dtype}") for dtype, points in (tables or {}).items()}


@dataclass(frozen=True)
class DeviceSpec:
    """The compute figures of one device: peak FLOP/s per dtype, memory, bandwidth, and how much of them ops reach.

    An op's price (docs/cost-model.md#what-an-op-costs) is its kernel time, a roofline of its counted
    FLOPs at the efficiency its kernels' kind and size reach (``gemm_efficiency``/``conv_efficiency``
    tables, else the flat ``efficiency``) against the bytes it moves at ``memory_efficiency`` of the
    bandwidth, combined with the host's ``dispatch_fwd``/``dispatch_bwd`` seconds per op: the larger
    of the two on an asynchronous device (cuda), their sum on a synchronous one (cpu). A profile
    without the newer figures prices as it always did: flat efficiency, full bandwidth, no dispatch.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    efficiency: float = 0.5
    gemm_efficiency: dict[str, EfficiencyCurve] = field(default_factory=dict)
    conv_efficiency: dict[str, EfficiencyCurve] = field(default_factory=dict)
    memory_efficiency: float = 1.0
    dispatch_fwd: float = 0.0
    dispatch_bwd: float = 0.0
    asynchronous: bool = False

    @classmethod
    def from_profile(cls, profile: str | Path | dict) -> DeviceSpec:
        device = load_profile(profile)["device"]
        dispatch = device.get("dispatch", {})
        return cls(
            name=device.get("name", "device"),
            peak_flops=dict(device["peak_flops"]),
            memory_bytes=float(device.get("memory_bytes", 0)),
            memory_bandwidth=float(device["memory_bandwidth"]),
            efficiency=float(device.get("efficiency", 0.5)),
            gemm_efficiency=_curves(device.get("gemm_efficiency"), "device.gemm_efficiency"),
            conv_efficiency=_curves(device.get("conv_efficiency"), "device.conv_efficiency"),
            memory_efficiency=float(device.get("memory_efficiency", 1.0)),
            dispatch_fwd=float(dispatch.get("fwd", 0.0)),
            dispatch_bwd=float(dispatch.get("bwd", 0.0)),
            asynchronous=device.get("type") == "cuda",
        )

    def _peak(self, dtype: str) -> float:
        peak = self.peak_flops.get(dtype, self.peak_flops.get("fp32"))
        if peak is None:
            raise ValueError(f"device profile {self.name!r} gives no peak FLOP/s for {dtype} or fp32")
        return peak

    def flops_per_second(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype``: peak times the flat efficiency (fp32 peak when unknown)."""
        return self._peak(dtype) * self.efficiency

    def kernel_efficiency(self, kind: str, flops: float, dtype: str) -> float:
        """The fraction of peak a ``kind`` kernel of ``flops`` reaches in ``dtype``: its table, the GEMM
        table for a convolution without one, else the flat ``efficiency``."""
        for tables in ((self.conv_efficiency,) if kind == "conv" else ()) + (self.gemm_efficiency,):
            curve = tables.get(dtype, tables.get("*"))
            if curve is not None:
                return curve.at(flops)
        return self.efficiency

    def kernel_time(self, kernels: Iterable[Kernel], bytes_moved: float, dtype: str) -> float:
        """Roofline time of an op's kernels: its FLOPs at the efficiency each kernel reaches, or its memory
        traffic at the achieved bandwidth, whichever is slower."""
        flops_by_rate: dict[float, int] = {}  # summed before dividing: the flat case is total / rate, as it was
        peak = self._peak(dtype)
        for kind, flops in kernels:
            rate = peak * self.kernel_efficiency(kind, flops, dtype)
            flops_by_rate[rate] = flops_by_rate.get(rate, 0) + flops
        compute = sum(flops / rate for rate, flops in flops_by_rate.items())
        return max(compute, bytes_moved / (self.memory_bandwidth * self.memory_efficiency))

    def compiled(self) -> DeviceSpec:
        """This device running compiled stages (``torch.compile``): an op costs its kernels alone, no dispatch.

        A compiled stage is one graph call per microbatch and phase: the host no longer runs
        each op through Python and the dispatcher (docs/cost-model.md#compiled-stages).
        """
        return replace(self, dispatch_fwd=0.0, dispatch_bwd=0.0)

    def op_time(self, kernel_seconds: float, phase: str) -> float:
        """An op's price in ``phase`` ("fwd" or "bwd"): its kernels and the host's dispatch of it, the larger
        on an asynchronous device (the host runs ahead while kernels run), their sum on a synchronous one."""
        dispatch = self.dispatch_fwd if phase == "fwd" else self.dispatch_bwd
        return max(kernel_seconds, dispatch) if self.asynchronous else kernel_seconds + dispatch
