"""A model of your own for the `smp` CLI: `smp plan examples/my_model.py:make --stages 3` (docs/cli.md)."""

from __future__ import annotations

import torch
from torch import nn


class Tagger(nn.Module):
    """Token embedding, residual MLP blocks, a per-token classifier."""

    def __init__(self, vocab: int = 1000, dim: int = 64, layers: int = 4, tags: int = 12):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers))
        self.head = nn.Linear(dim, tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def make(layers: int = 4, seq_len: int = 32):
    """The model and a sample of 8 sequences: one microbatch of a step (docs/cli.md, "Batch").

    No target and no loss: smp trains it on the mean of the output (docs/models.md).
    """
    return Tagger(layers=layers), (torch.randint(0, 1000, (8, seq_len)),)
