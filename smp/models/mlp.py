"""MLP: a stack of Linear + activation layers, the simplest chain-shaped model for partitioner tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smp.models.common import class_cross_entropy, mse_loss
from smp.models.registry import BuildContext, Built, Option, register_model

__all__ = ["MLP"]

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class MLP(nn.Module):
    """``layers`` hidden Linear layers of width ``hidden`` (each followed by the activation), then an output Linear."""

    def __init__(self, d_in: int, hidden: int, d_out: int, layers: int, activation: str = "gelu") -> None:
        super().__init__()
        act = _ACTIVATIONS[activation]
        dims = [d_in] + [hidden] * layers
        body: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            body += [nn.Linear(a, b), act()]
        self.body = nn.Sequential(*body)
        self.out = nn.Linear(dims[-1], d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


@register_model(
    "mlp",
    "MLP (Linear + activation stack); input (B, d_in), MSE loss (or CE with task=classify)",
    options=[
        Option("layers", 4, int, "hidden layers", min=1),
        Option("d_in", 32, int, "input features", min=1),
        Option("hidden", 64, int, "hidden width", min=1),
        Option("d_out", 10, int, "outputs (classes for task=classify)", min=1),
        Option("activation", "gelu", str, "activation", choices=tuple(_ACTIVATIONS)),
        Option("task", "regress", str, "loss: regress (MSE) or classify (CE)", choices=("regress", "classify")),
        Option("batch", 4, int, "sample batch size", min=1),
    ],
    presets={
        "tiny": {"layers": 4, "d_in": 32, "hidden": 64, "d_out": 10},
        "small": {"layers": 8, "d_in": 1024, "hidden": 1024, "d_out": 1024},
        "base": {"layers": 16, "d_in": 2048, "hidden": 2048, "d_out": 2048},
        "large": {"layers": 16, "d_in": 4096, "hidden": 4096, "d_out": 4096},
        "1b": {"layers": 16, "d_in": 8192, "hidden": 8192, "d_out": 8192},
    },
)
def build_mlp(cfg: dict[str, Any], ctx: BuildContext) -> Built:
    model = MLP(cfg["d_in"], cfg["hidden"], cfg["d_out"], cfg["layers"], cfg["activation"])
    x = ctx.randn((cfg["batch"], cfg["d_in"]))
    if cfg["task"] == "classify":
        return Built(model, (x,), {}, ctx.randint(cfg["d_out"], (cfg["batch"],)), class_cross_entropy)
    return Built(model, (x,), {}, ctx.randn((cfg["batch"], cfg["d_out"])), mse_loss)
