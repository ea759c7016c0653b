"""Models written the way users write them (not the zoo), for the runtime tests: several outputs, dropout."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn


class TwoTowers(nn.Module):
    """Returns a dict: a score from the end of the network and an embedding made at its very start.

    ``emb_a`` is computed by the first op and read only by the output, so on any plan with
    more than one stage it must travel from an early stage to the one returning the output.
    """

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed_a = nn.Linear(width, width)
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)))
        self.head = nn.Linear(width, 1)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        ha = self.embed_a(a)
        m = self.body(b)
        return {"score": self.head(m), "emb_a": ha}


def two_towers_loss(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out["score"].squeeze(-1), target) + out["emb_a"].pow(2).mean()


class Dropping(nn.Module):
    """Dropout between linear layers: its traced program differs between train and eval."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(width, width) for _ in range(4))
        self.out = nn.Linear(width, 4)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.tanh(self.a(x)))
        x = self.drop(torch.tanh(self.b(x)))
        x = torch.tanh(self.c(x))
        return self.out(torch.tanh(self.d(x)))


class RandomDag(nn.Module):
    """A random DAG of small ops over one input; several outputs taken from any op (a dict).

    Built from a seed so every rank builds the same model. Node i reads one or two earlier
    nodes (or the input), applies a linear layer or an elementwise op; ``outputs`` are
    arbitrary nodes, so some are made early and read only by the output.
    """

    def __init__(self, seed: int, nodes: int = 10, width: int = 8, outputs: int = 3) -> None:
        super().__init__()
        rng = random.Random(seed)
        self.width = width
        self.spec: list[tuple[str, tuple[int, ...]]] = []
        self.layers = nn.ModuleDict()
        for i in range(nodes):
            reads = tuple(sorted(rng.sample(range(-1, i), k=min(i + 1, rng.choice([1, 2])))))
            kind = rng.choice(["linear", "linear", "tanh", "mul", "add"]) if len(reads) == 2 else \
                rng.choice(["linear", "linear", "tanh", "sigmoid"])
            if (kind in ("mul", "add") and len(reads) < 2) or i == nodes - 1:
                kind = "linear"  # the last node, always returned, trains something
            if kind == "linear":
                self.layers[f"n{i}"] = nn.Linear(width, width)
            self.spec.append((kind, reads))
        self.returned = sorted(set(rng.sample(range(nodes), k=min(outputs, nodes))) | {nodes - 1})

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        values: list[torch.Tensor] = []

        def value(j: int) -> torch.Tensor:
            return x if j < 0 else values[j]

        for i, (kind, reads) in enumerate(self.spec):
            first = value(reads[0])
            if kind == "linear":
                y = self.layers[f"n{i}"](sum(value(j) for j in reads[1:]) + first if len(reads) > 1 else first)
            elif kind == "tanh":
                y = torch.tanh(first)
            elif kind == "sigmoid":
                y = torch.sigmoid(first)
            elif kind == "mul":
                y = first * value(reads[1])
            else:
                y = first + value(reads[1])
            values.append(y)
        return {f"out{i}": values[i] for i in self.returned}


def dict_mean_loss(out: dict[str, torch.Tensor], target: torch.Tensor | None) -> torch.Tensor:
    """A loss touching every returned value (so each one's gradient flows back through the pipeline)."""
    return sum((v * (k + 1)).pow(2).mean() for k, v in enumerate(out.values()))  # type: ignore[return-value]


class WithSpare(nn.Module):
    """A layer with a parameter its forward reads but no gradient reaches (detached: frozen by the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).relu() * self.spare.detach().mean()
