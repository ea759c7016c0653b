"""T5-style encoder-decoder: every decoder layer cross-attends to the encoder output; optional relative position bias."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp.models.common import Attention, check_heads, token_cross_entropy
from smp.models.registry import BuildContext, Built, Option, SpecError, register_model

__all__ = ["T5", "T5EncoderLayer", "T5DecoderLayer", "RelativePositionBias"]


class RelativePositionBias(nn.Module):
    """A learned per-head bias for each clipped relative distance (key - query), as an additive attention mask.

    Simpler than T5's log-spaced buckets: distances are clipped to ``max_distance``. The
    decoder variant also carries the causal mask (-inf above the diagonal), because SDPA
    does not accept an additive mask and ``is_causal`` together.
    """

    def __init__(self, heads: int, max_len: int, causal: bool, max_distance: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(2 * max_distance + 1, heads)
        pos = torch.arange(max_len)
        rel = (pos[None, :] - pos[:, None]).clamp(-max_distance, max_distance) + max_distance
        self.register_buffer("rel_idx", rel, persistent=False)
        causal_mask = torch.zeros(max_len, max_len)
        if causal:
            causal_mask = causal_mask.masked_fill(torch.ones(max_len, max_len).triu(1).bool(), float("-inf"))
        self.register_buffer("causal_mask", causal_mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        # torch.narrow, not [:t, :t]: under fx the buffers are real tensors, which a Proxy cannot slice.
        rel = torch.narrow(torch.narrow(self.rel_idx, 0, 0, t), 1, 0, t)
        causal = torch.narrow(torch.narrow(self.causal_mask, 0, 0, t), 1, 0, t)
        bias = self.emb(rel).permute(2, 0, 1)  # (H, T, T)
        return (bias + causal.to(bias.dtype)).unsqueeze(0)  # (1, H, T, T)


class _FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.drop(F.relu(self.wi(x))))


class T5EncoderLayer(nn.Module):
    """Pre-RMSNorm self-attention + feed-forward."""

    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model, eps=1e-6)
        self.attn = Attention(d_model, heads, dropout, bias=False)
        self.norm2 = nn.RMSNorm(d_model, eps=1e-6)
        self.ff = _FeedForward(d_model, d_ff, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), mask=bias))
        return x + self.drop(self.ff(self.norm2(x)))


class T5DecoderLayer(nn.Module):
    """Pre-RMSNorm causal self-attention, cross-attention to the encoder output, feed-forward."""

    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model, eps=1e-6)
        self.self_attn = Attention(d_model, heads, dropout, bias=False)
        self.norm2 = nn.RMSNorm(d_model, eps=1e-6)
        self.cross_attn = Attention(d_model, heads, dropout, bias=False)
        self.norm3 = nn.RMSNorm(d_model, eps=1e-6)
        self.ff = _FeedForward(d_model, d_ff, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # bias is None only when relative positions are off; then plain is_causal does the masking.
        x = x + self.drop(self.self_attn(self.norm1(x), mask=bias, causal=bias is None))
        x = x + self.drop(self.cross_attn(self.norm2(x), memory=memory))
        return x + self.drop(self.ff(self.norm3(x)))


class T5(nn.Module):
    """Encoder-decoder; ``forward(input_ids, decoder_input_ids)`` returns (B, T_dec, vocab) logits.

    The encoder output feeds the cross-attention of every decoder layer: in a pipeline
    it is a long edge from the last encoder stage to every decoder stage.
    """

    def __init__(
        self,
        vocab: int,
        d_model: int,
        layers: int,
        dec_layers: int,
        heads: int,
        d_ff: int,
        max_seq_len: int,
        rel_pos: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.rel_pos = rel_pos
        self.shared = nn.Embedding(vocab, d_model)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.ModuleList(T5EncoderLayer(d_model, heads, d_ff, dropout) for _ in range(layers))
        self.enc_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.decoder = nn.ModuleList(T5DecoderLayer(d_model, heads, d_ff, dropout) for _ in range(dec_layers))
        self.dec_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        if rel_pos:
            self.enc_bias = RelativePositionBias(heads, max_seq_len, causal=False)
            self.dec_bias = RelativePositionBias(heads, max_seq_len, causal=True)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.shared(input_ids))
        # Computed once per stack and handed to every layer, as in T5.
        enc_bias = self.enc_bias(x) if self.rel_pos else None
        for layer in self.encoder:
            x = layer(x, enc_bias)
        memory = self.drop(self.enc_norm(x))
        y = self.drop(self.shared(decoder_input_ids))
        dec_bias = self.dec_bias(y) if self.rel_pos else None
        for layer in self.decoder:
            y = layer(y, memory, dec_bias)
        return self.lm_head(self.drop(self.dec_norm(y)))


def _validate(cfg: dict[str, Any]) -> None:
    check_heads("t5", cfg)
    dec_seq = cfg["dec_seq_len"] or cfg["seq_len"]
    if dec_seq < 1:
        raise SpecError(f"bad value {dec_seq!r} for option 'dec_seq_len' of model 't5': must be >= 1")


@register_model(
    "t5",
    "T5-style encoder-decoder (pre-RMSNorm, cross-attention in every decoder layer, relative position bias); "
    "inputs (input_ids, decoder_input_ids)",
    options=[
        Option("layers", 2, int, "encoder layers", min=1),
        Option("dec_layers", None, int, "decoder layers (default: layers)", min=1),
        Option("d_model", 64, int, "hidden size", min=1),
        Option("heads", 4, int, "attention heads", min=1),
        Option("d_ff", None, int, "feed-forward size (default 4 * d_model)", min=1),
        Option("vocab", 256, int, "vocabulary size", min=2),
        Option("seq_len", 32, int, "sample encoder sequence length", min=1),
        Option("dec_seq_len", None, int, "sample decoder sequence length (default: seq_len)", min=1),
        Option("batch", 2, int, "sample batch size", min=1),
        Option("rel_pos", True, bool, "learned relative position bias"),
        Option("dropout", 0.0, float, "dropout probability", min=0.0),
    ],
    presets={
        "tiny": {"layers": 2, "d_model": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "small": {"layers": 6, "d_model": 512, "heads": 8, "d_ff": 2048, "vocab": 32128, "seq_len": 512},
        "base": {"layers": 12, "d_model": 768, "heads": 12, "d_ff": 3072, "vocab": 32128, "seq_len": 512},
        "large": {"layers": 24, "d_model": 1024, "heads": 16, "d_ff": 4096, "vocab": 32128, "seq_len": 512},
        "1b": {"layers": 24, "d_model": 1280, "heads": 16, "d_ff": 5120, "vocab": 32128, "seq_len": 512},
    },
    validate=_validate,
)
def build_t5(cfg: dict[str, Any], ctx: BuildContext) -> Built:
    enc_seq = cfg["seq_len"]
    dec_seq = cfg["dec_seq_len"] or enc_seq
    model = T5(
        cfg["vocab"],
        cfg["d_model"],
        cfg["layers"],
        cfg["dec_layers"] or cfg["layers"],
        cfg["heads"],
        cfg["d_ff"] or 4 * cfg["d_model"],
        max(enc_seq, dec_seq),
        cfg["rel_pos"],
        cfg["dropout"],
    )
    batch = cfg["batch"]
    input_ids = ctx.randint(cfg["vocab"], (batch, enc_seq))
    target = ctx.randint(cfg["vocab"], (batch, dec_seq))
    # Teacher forcing: the decoder sees the target shifted right behind a start token (id 0).
    start = torch.zeros(batch, 1, dtype=torch.long, device=ctx.input_device)
    decoder_input_ids = torch.cat([start, target[:, :-1]], dim=1)
    return Built(model, (input_ids, decoder_input_ids), {}, target, token_cross_entropy)
