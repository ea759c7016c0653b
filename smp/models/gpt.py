"""GPT-style decoder: token + learned position embeddings, pre-LN blocks, LM head tied to the embedding."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp.models.common import Attention, check_heads, token_cross_entropy
from smp.models.registry import BuildContext, Built, Option, register_model

__all__ = ["GPT", "GPTBlock"]


class GPTBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), causal=True))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """Decoder-only language model; ``forward(idx)`` returns (B, T, vocab) logits.

    ``tp_plan``: how tensor parallelism splits it (Megatron's pairs: attention's projections colwise by heads,
    its output rowwise; the MLP's up colwise, down rowwise). The k/v projection is one Linear of both side by
    side, so each rank holds its share of each ("fused_colwise:2"); embeddings and the tied head stay whole.
    """

    tp_plan = {"blocks.*.attn.q": "colwise", "blocks.*.attn.kv": "fused_colwise:2", "blocks.*.attn.out": "rowwise",
               "blocks.*.fc": "colwise", "blocks.*.proj": "rowwise"}

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, max_seq_len: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(d_model, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one parameter, counted once
        # Position ids as a buffer, narrowed to the input length in forward.
        self.register_buffer("pos_ids", torch.arange(max_seq_len), persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # torch.narrow, not [:T]: fx leaves buffers as real tensors, which a Proxy cannot slice.
        pos = torch.narrow(self.pos_ids, 0, 0, idx.size(1))
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@register_model(
    "gpt",
    "GPT-style decoder (pre-LN, learned positions, tied LM head); input (B, T) token ids, next-token CE loss",
    options=[
        Option("layers", 2, int, "transformer blocks", min=1),
        Option("d_model", 64, int, "hidden size", min=1),
        Option("heads", 4, int, "attention heads", min=1),
        Option("vocab", 256, int, "vocabulary size", min=2),
        Option("seq_len", 32, int, "sample sequence length (and position table size)", min=1),
        Option("batch", 2, int, "sample batch size", min=1),
        Option("dropout", 0.0, float, "dropout probability", min=0.0),
    ],
    presets={
        "tiny": {"layers": 2, "d_model": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "small": {"layers": 6, "d_model": 512, "heads": 8, "vocab": 50304, "seq_len": 512},
        "base": {"layers": 12, "d_model": 768, "heads": 12, "vocab": 50304, "seq_len": 1024},
        "large": {"layers": 24, "d_model": 1024, "heads": 16, "vocab": 50304, "seq_len": 1024},
        "1b": {"layers": 20, "d_model": 2048, "heads": 16, "vocab": 50304, "seq_len": 1024},
    },
    validate=lambda cfg: check_heads("gpt", cfg),
)
def build_gpt(cfg: dict[str, Any], ctx: BuildContext) -> Built:
    model = GPT(cfg["vocab"], cfg["d_model"], cfg["layers"], cfg["heads"], cfg["seq_len"], cfg["dropout"])
    # One extra token so input and next-token target are two views of one sequence.
    tokens = ctx.randint(cfg["vocab"], (cfg["batch"], cfg["seq_len"] + 1))
    idx, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return Built(model, (idx,), {}, target, token_cross_entropy)
