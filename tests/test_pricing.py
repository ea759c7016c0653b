"""Analytic pricing: efficiency by kernel size and kind, achieved bandwidth, and the host's dispatch per op."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from partitioner import profile
from partitioner.devices import DeviceSpec, EfficiencyCurve, Kernel, list_profiles, load_profile
from partitioner.errors import ProfileError
from partitioner.profile_ops import count_kernels


def _profile(device_type: str = "cuda", **device: object) -> dict:
    base = {"name": "test", "type": device_type, "peak_flops": {"fp32": 1e12, "bf16": 4e12},
            "memory_bandwidth": 1e11, "efficiency": 0.5}
    return {"kind": "smp.profile", "schema": 1, "device": {**base, **device}, "links": {}}


def test_a_profile_without_the_new_figures_prices_as_the_flat_roofline() -> None:
    spec = DeviceSpec.from_profile(_profile())
    kernels = [Kernel("gemm", 3_000_000), Kernel("conv", 5_000_000), Kernel("gemm", 7)]
    total = sum(k.flops for k in kernels)
    assert spec.kernel_time(kernels, 10.0, "fp32") == max(total / (1e12 * 0.5), 10.0 / 1e11)
    assert spec.kernel_time([], 4e6, "bf16") == 4e6 / 1e11
    assert spec.op_time(1e-6, "fwd") == 1e-6 and spec.op_time(1e-6, "bwd") == 1e-6


def test_efficiency_curve_interpolates_in_log2_flops_and_is_flat_beyond_its_points() -> None:
    curve = EfficiencyCurve.parse([[30, 0.6], [20, 0.1]], "t")
    assert curve.at(2 ** 20) == pytest.approx(0.1)
    assert curve.at(2 ** 25) == pytest.approx(0.35)
    assert curve.at(2 ** 10) == pytest.approx(0.1) and curve.at(2 ** 40) == pytest.approx(0.6)
    assert curve.at(0) == pytest.approx(0.1)


def test_gemm_and_conv_tables_by_dtype_with_fallbacks() -> None:
    spec = DeviceSpec.from_profile(_profile(
        gemm_efficiency={"bf16": [[20, 0.1], [30, 0.8]], "*": [[20, 0.4]]},
        conv_efficiency={"bf16": [[20, 0.05]]}))
    assert spec.kernel_efficiency("gemm", 2 ** 30, "bf16") == pytest.approx(0.8)
    assert spec.kernel_efficiency("gemm", 2 ** 30, "fp32") == pytest.approx(0.4)  # "*": any other dtype
    assert spec.kernel_efficiency("conv", 2 ** 30, "bf16") == pytest.approx(0.05)
    assert spec.kernel_efficiency("conv", 2 ** 30, "fp32") == pytest.approx(0.4)  # no conv table: the GEMM one
    small, large = Kernel("gemm", 2 ** 20), Kernel("gemm", 2 ** 30)
    assert spec.kernel_time([small, large], 0.0, "bf16") == pytest.approx(
        2 ** 20 / (4e12 * 0.1) + 2 ** 30 / (4e12 * 0.8))
    flat = DeviceSpec.from_profile(_profile(conv_efficiency={"*": [[10, 0.2]]}))
    assert flat.kernel_efficiency("gemm", 2 ** 30, "fp32") == 0.5  # no GEMM table: the flat efficiency


def test_memory_bound_ops_at_the_achieved_bandwidth() -> None:
    spec = DeviceSpec.from_profile(_profile(memory_efficiency=0.8))
    assert spec.kernel_time([], 8e6, "fp32") == pytest.approx(8e6 / 0.8e11)


def test_dispatch_is_the_larger_on_an_asynchronous_device_and_added_on_a_synchronous_one() -> None:
    gpu = DeviceSpec.from_profile(_profile("cuda", dispatch={"fwd": 2e-5, "bwd": 3e-5}))
    assert gpu.op_time(1e-6, "fwd") == 2e-5 and gpu.op_time(1e-3, "fwd") == 1e-3
    assert gpu.op_time(1e-6, "bwd") == 3e-5
    cpu = DeviceSpec.from_profile(_profile("cpu", dispatch={"fwd": 2e-5, "bwd": 3e-5}))
    assert cpu.op_time(1e-6, "fwd") == pytest.approx(2.1e-5) and cpu.op_time(1e-3, "bwd") == pytest.approx(1.03e-3)


@pytest.mark.parametrize("points", [[], [[20, 0.0]], [[20, 0.5], [20, 0.6]]])
def test_a_bad_efficiency_table_is_refused(points: list) -> None:
    with pytest.raises(ProfileError, match="gemm_efficiency"):
        DeviceSpec.from_profile(_profile(gemm_efficiency={"bf16": points}))


def test_kernels_are_counted_one_by_one_with_their_kind() -> None:
    x = torch.randn(2, 3, 8, 8)
    conv, lin = nn.Conv2d(3, 4, 3), nn.Linear(6, 5)
    kernels = count_kernels(lambda: lin(conv(x)))
    assert [k.kind for k in kernels] == ["conv", "gemm"]
    assert kernels[0].flops == 2 * 2 * 4 * 6 * 6 * 3 * 9 and kernels[1].flops == 2 * (2 * 4 * 6) * 6 * 5


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)).view(-1).sum()


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_analytic_profile_prices_every_op_with_its_dispatch(device_type: str) -> None:
    plain = _profile(device_type)
    dispatched = copy.deepcopy(plain)
    dispatched["device"]["dispatch"] = {"fwd": 1e-3, "bwd": 2e-3}  # far above any kernel here
    x = torch.randn(4, 16)
    model = _Chain()
    base = profile(model, (x,), timing="analytic", device_profile=plain)
    priced = profile(model, (x,), timing="analytic", device_profile=dispatched)
    for name in base:
        if base[name]["op"] == "output":
            continue
        kernel, price = base[name], priced[name]
        if device_type == "cuda":
            assert price["fwd"] == 1e-3
            assert price["bwd"] == (2e-3 if kernel["bwd"] > 0 else 0.0)
        else:
            assert price["fwd"] == pytest.approx(kernel["fwd"] + 1e-3)
            assert price["bwd"] == (pytest.approx(kernel["bwd"] + 2e-3) if kernel["bwd"] > 0 else 0.0)


@pytest.mark.parametrize("name", list_profiles())
def test_every_figure_of_a_shipped_device_has_its_source(name: str) -> None:
    prof = load_profile(name)
    sources = prof["sources"]
    missing = [key for key in prof["device"] if key not in ("name", "type") and f"device.{key}" not in sources]
    assert not missing, f"{name}: no source for {missing}"
    DeviceSpec.from_profile(prof)  # and its tables parse
