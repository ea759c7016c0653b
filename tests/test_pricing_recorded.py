"""The pricing model against recorded GPU measurements: NVIDIA H200, 2026-11-26 (benchmarks/results/gpu.json).

What the recording holds per model: its op count n, the whole model's forward and backward W
(synchronised wall clock, eager bf16), the sum K of its ops timed one by one with CUDA events,
and the sum A of the analytic per-op prices on the profile calibrated there (no dispatch, flat
efficiency). It holds no per-op times, so the planner's price Σ max(kernel, dispatch) of a
model cannot be recomputed from it; what the sums do pin down is the queue model the price
rests on: the host dispatches the ops in order, d seconds each, the GPU runs each kernel once
it is dispatched and the one before is done. Then

    max(K, n d)  <=  W  <=  K + n d        (up to one op's dispatch)

and the price Σ max(k_i, d) lies in the same interval. The dispatch figure d comes from two
models; the others are held out and must land in the interval, widened by the issue's
target band (15%, docs/cost-model.md#dispatch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner.devices import DeviceSpec

RECORDED = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "gpu.json"
DERIVE_FROM = ("gpt:size=base,batch=8", "bert:size=base,batch=16")
BAND = 0.15  # the target for a calibrated price against the measured whole model (0.85-1.15)


def recording() -> dict:
    data = json.loads(RECORDED.read_text())
    assert data["env"]["device"] == "NVIDIA H200" and data["env"]["when"].startswith("2026-11-26")
    return data


def rows() -> dict[str, dict]:
    return {row["model"]: row for row in recording()["timing"]}


def bracket(row: dict, phase: str) -> tuple[float, float]:
    """The dispatch seconds per op that ``row`` allows in ``phase``: ((W - K) / n, W / n)."""
    whole, kernels, ops = row[f"whole_{phase}"], row["measured"][phase], row["ops"]
    return (whole - kernels) / ops, whole / ops


def derived_dispatch(phase: str) -> float:
    """The midpoint of what the models of ``DERIVE_FROM`` allow together (of the two bounds, when they cross)."""
    brackets = [bracket(rows()[model], phase) for model in DERIVE_FROM]
    low, high = max(b[0] for b in brackets), min(b[1] for b in brackets)
    return (low + high) / 2


def interval(kernels: float, ops: int, dispatch: float) -> tuple[float, float]:
    """The whole model's time the queue model allows: kernels and dispatch overlapped fully, or not at all."""
    return max(kernels, ops * dispatch), kernels + ops * dispatch


HELD_OUT = [m for m in rows() if m not in DERIVE_FROM]


def test_the_shipped_dispatch_is_the_one_the_recording_gives() -> None:
    spec = DeviceSpec.from_profile("h100-sxm")
    assert spec.asynchronous
    assert spec.dispatch_fwd == pytest.approx(derived_dispatch("fwd"), abs=0.5e-6)  # rounded to the microsecond
    assert spec.dispatch_bwd == pytest.approx(derived_dispatch("bwd"), abs=0.5e-6)


@pytest.mark.parametrize("phase", ["fwd", "bwd"])
@pytest.mark.parametrize("model", HELD_OUT)
def test_held_out_models_land_where_measured_kernels_and_dispatch_put_them(model: str, phase: str) -> None:
    row = rows()[model]
    low, high = interval(row["measured"][phase], row["ops"], derived_dispatch(phase))
    whole = row[f"whole_{phase}"]
    assert low * (1 - BAND) <= whole <= high * (1 + BAND), (model, phase, low, whole, high)


def test_without_dispatch_the_held_out_conv_nets_miss() -> None:
    """The test above can fail: with no dispatch (d = 0) the measured kernels alone miss ResNet-50 and U-Net."""
    for model in ("resnet:size=base,batch=32", "unet:size=small,batch=16"):
        row = rows()[model]
        low, high = interval(row["measured"]["fwd"], row["ops"], 0.0)
        assert row["whole_fwd"] > high * (1 + BAND), model


@pytest.mark.parametrize("phase", ["fwd", "bwd"])
@pytest.mark.parametrize("model", ["gpt:size=base,batch=8", "bert:size=base,batch=16", "t5:size=small,batch=16"])
def test_analytic_sums_with_dispatch_bracket_the_transformers(model: str, phase: str) -> None:
    """The analytic sums priced on the calibrated profile, with the dispatch, bracket the transformers."""
    row = rows()[model]
    low, high = interval(row["calibrated"][phase], row["ops"], derived_dispatch(phase))
    assert low * (1 - BAND) <= row[f"whole_{phase}"] <= high * (1 + BAND), (low, row[f"whole_{phase}"], high)


@pytest.mark.xfail(strict=True, reason="convolutions are priced far below what cuDNN takes (no conv efficiency "
                                       "was measured on the H200): the analytic kernels miss ResNet-50 and U-Net")
@pytest.mark.parametrize("model", ["resnet:size=base,batch=32", "unet:size=small,batch=16"])
def test_analytic_sums_with_dispatch_bracket_the_conv_nets(model: str) -> None:
    row = rows()[model]
    low, high = interval(row["calibrated"]["fwd"], row["ops"], derived_dispatch("fwd"))
    assert low * (1 - BAND) <= row["whole_fwd"] <= high * (1 + BAND)
