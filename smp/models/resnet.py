"""ResNet-style CNN with BatchNorm: basic or bottleneck residual blocks, configurable depth, width and image size."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp.models.common import class_cross_entropy
from smp.models.registry import BuildContext, Built, Option, SpecError, register_model

__all__ = ["ResNet", "BasicBlock", "Bottleneck", "RESNET_DEPTHS"]

# depth -> (block kind, blocks per stage). 10 and 26 are small extras for tests and demos.
RESNET_DEPTHS: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    10: ("basic", (1, 1, 1, 1)),
    18: ("basic", (2, 2, 2, 2)),
    26: ("bottleneck", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
    200: ("bottleneck", (3, 24, 36, 3)),
}


def _downsample(c_in: int, c_out: int, stride: int) -> nn.Module | None:
    if stride == 1 and c_in == c_out:
        return None
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and an identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = _downsample(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a shortcut; stride on the 3x3 as in ResNet v1.5."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.downsample = _downsample(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """``forward(images)`` on (B, C, H, W) returns (B, classes) logits.

    Images of 64 pixels or less get a CIFAR-style stem (3x3 conv, no max-pool) so that
    small test images are not reduced to nothing before the last stage.
    """

    def __init__(self, depth: int, width: int, image: int, classes: int, channels: int = 3) -> None:
        super().__init__()
        kind, counts = RESNET_DEPTHS[depth]
        block = BasicBlock if kind == "basic" else Bottleneck
        if image > 64:
            self.stem = nn.Sequential(
                nn.Conv2d(channels, width, 7, 2, 3, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=False),
                nn.MaxPool2d(3, 2, 1),
            )
        else:
            self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages: list[nn.Module] = []
        c_in = width
        for i, n in enumerate(counts):
            w = width * 2**i
            blocks = []
            for j in range(n):
                blocks.append(block(c_in, w, 2 if (j == 0 and i > 0) else 1))
                c_in = w * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(c_in, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _validate(cfg: dict[str, Any]) -> None:
    if cfg["depth"] not in RESNET_DEPTHS:
        raise SpecError(
            f"bad value {cfg['depth']!r} for option 'depth' of model 'resnet'; accepted depths: "
            f"{', '.join(map(str, RESNET_DEPTHS))}"
        )


@register_model(
    "resnet",
    "ResNet-style CNN with BatchNorm (basic blocks for depth 10/18/34, bottleneck for 26/50/101/152/200); "
    "input (B, 3, image, image), class CE loss",
    options=[
        Option("depth", 10, int, "ResNet depth: " + "/".join(map(str, RESNET_DEPTHS)), min=1),
        Option("width", 8, int, "channels of the first stage (64 in the paper)", min=1),
        Option("image", 32, int, "image height and width", min=8),
        Option("channels", 3, int, "input channels", min=1),
        Option("classes", 10, int, "output classes", min=2),
        Option("batch", 2, int, "sample batch size", min=1),
    ],
    presets={
        "tiny": {"depth": 10, "width": 8, "image": 32, "classes": 10},
        "small": {"depth": 18, "width": 64, "image": 224, "classes": 1000},
        "base": {"depth": 50, "width": 64, "image": 224, "classes": 1000},
        "large": {"depth": 152, "width": 64, "image": 224, "classes": 1000},
        "1b": {"depth": 200, "width": 256, "image": 224, "classes": 1000},
    },
    validate=_validate,
)
def build_resnet(cfg: dict[str, Any], ctx: BuildContext) -> Built:
    model = ResNet(cfg["depth"], cfg["width"], cfg["image"], cfg["classes"], cfg["channels"])
    images = ctx.randn((cfg["batch"], cfg["channels"], cfg["image"], cfg["image"]))
    target = ctx.randint(cfg["classes"], (cfg["batch"],))
    return Built(model, (images,), {}, target, class_cross_entropy)
