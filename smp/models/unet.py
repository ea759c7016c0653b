"""U-Net: a conv encoder whose every level is concatenated into the matching decoder level (long skip connections)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smp.models.common import class_cross_entropy
from smp.models.registry import BuildContext, Built, Option, SpecError, register_model

__all__ = ["UNet", "DoubleConv"]


class DoubleConv(nn.Module):
    """(3x3 conv, BatchNorm, ReLU) twice."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class UNet(nn.Module):
    """``forward(images)`` on (B, C, H, W) returns (B, classes, H, W) per-pixel logits.

    Level i of the encoder (``down[i]``) feeds both the next level and, via ``torch.cat``,
    decoder level ``up_conv[levels-1-i]``: the first encoder output is consumed by the
    very last decoder block, the longest edge a pipeline partitioner has to carry.
    """

    def __init__(self, levels: int, base: int, channels: int, classes: int) -> None:
        super().__init__()
        widths = [base * 2**i for i in range(levels + 1)]
        self.down = nn.ModuleList()
        c_in = channels
        for w in widths[:-1]:
            self.down.append(DoubleConv(c_in, w))
            c_in = w
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = DoubleConv(widths[-2], widths[-1])
        self.up = nn.ModuleList()
        self.up_conv = nn.ModuleList()
        for w in reversed(widths[:-1]):
            self.up.append(nn.ConvTranspose2d(2 * w, w, 2, stride=2))
            self.up_conv.append(DoubleConv(2 * w, w))  # 2w in: upsampled path + skip
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips: list[torch.Tensor] = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, conv, skip in zip(self.up, self.up_conv, reversed(skips)):
            x = conv(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def _validate(cfg: dict[str, Any]) -> None:
    if cfg["image"] % (2 ** cfg["levels"]):
        raise SpecError(
            f"bad value {cfg['image']!r} for option 'image' of model 'unet': must be divisible by "
            f"2**levels = {2 ** cfg['levels']} (levels={cfg['levels']})"
        )


@register_model(
    "unet",
    "U-Net with BatchNorm and long skip connections (encoder levels concatenated into the decoder); "
    "input (B, C, image, image), per-pixel class CE loss",
    options=[
        Option("levels", 3, int, "down/up-sampling levels", min=1),
        Option("base", 8, int, "channels of the first level (64 in the paper)", min=1),
        Option("image", 32, int, "image height and width (divisible by 2**levels)", min=2),
        Option("channels", 3, int, "input channels", min=1),
        Option("classes", 2, int, "segmentation classes", min=2),
        Option("batch", 2, int, "sample batch size", min=1),
    ],
    presets={
        "tiny": {"levels": 3, "base": 8, "image": 32},
        "small": {"levels": 4, "base": 32, "image": 128},
        "base": {"levels": 4, "base": 64, "image": 256},
        "large": {"levels": 5, "base": 64, "image": 256},
        "1b": {"levels": 5, "base": 192, "image": 256},
    },
    validate=_validate,
)
def build_unet(cfg: dict[str, Any], ctx: BuildContext) -> Built:
    model = UNet(cfg["levels"], cfg["base"], cfg["channels"], cfg["classes"])
    b, s = cfg["batch"], cfg["image"]
    images = ctx.randn((b, cfg["channels"], s, s))
    mask = ctx.randint(cfg["classes"], (b, s, s))
    return Built(model, (images,), {}, mask, class_cross_entropy)
