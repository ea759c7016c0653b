"""BERT-style encoder: word/position/type embeddings, post-LN blocks, and an MLM or classification head."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp.models.common import Attention, check_heads, class_cross_entropy, token_cross_entropy
from smp.models.registry import BuildContext, Built, Option, register_model

__all__ = ["BERT", "BERTBlock"]


class BERTBlock(nn.Module):
    """Post-LN encoder block: ln(x + attn(x)), then ln(x + ffn(x))."""

    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.attn = Attention(d_model, heads, dropout)
        self.ln1 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.drop(self.attn(x, mask=mask)))
        return self.ln2(x + self.drop(self.proj(F.gelu(self.fc(x)))))


class BERT(nn.Module):
    """Bidirectional encoder.

    ``forward(input_ids, attention_mask)`` returns (B, T, vocab) MLM logits for
    ``head="mlm"`` or (B, classes) logits from the [CLS] position for ``head="cls"``.
    ``attention_mask`` is (B, T), 1 for real tokens and 0 for padding; it is a required
    argument so the traced graph has no ``is None`` branch to specialise on.
    """

    def __init__(
        self,
        vocab: int,
        d_model: int,
        layers: int,
        heads: int,
        d_ff: int,
        max_seq_len: int,
        head: str = "mlm",
        classes: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.head = head
        self.word_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        self.type_emb = nn.Embedding(2, d_model)
        self.emb_ln = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(BERTBlock(d_model, heads, d_ff, dropout) for _ in range(layers))
        self.register_buffer("pos_ids", torch.arange(max_seq_len), persistent=False)
        if head == "mlm":
            self.mlm_dense = nn.Linear(d_model, d_model)
            self.mlm_ln = nn.LayerNorm(d_model)
            self.mlm_decoder = nn.Linear(d_model, vocab)
            self.mlm_decoder.weight = self.word_emb.weight  # tied, as in BERT
        else:
            self.pooler = nn.Linear(d_model, d_model)
            self.classifier = nn.Linear(d_model, classes)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pos = torch.narrow(self.pos_ids, 0, 0, input_ids.size(1))  # fx cannot slice a buffer by a Proxy
        # Segment ids are all zero: one-segment inputs, so type_emb row 0 is added everywhere.
        x = self.word_emb(input_ids) + self.pos_emb(pos) + self.type_emb.weight[0]
        x = self.drop(self.emb_ln(x))
        # (B, T) -> (B, 1, 1, T) boolean "may attend" mask, broadcast over heads and queries.
        mask = attention_mask[:, None, None, :].bool()
        for block in self.blocks:
            x = block(x, mask)
        if self.head == "mlm":
            return self.mlm_decoder(self.mlm_ln(F.gelu(self.mlm_dense(x))))
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


def _validate(cfg: dict[str, Any]) -> None:
    check_heads("bert", cfg)


@register_model(
    "bert",
    "BERT-style encoder (post-LN) with an MLM or classification head; "
    "inputs (input_ids, attention_mask), both (B, T)",
    options=[
        Option("layers", 2, int, "encoder blocks", min=1),
        Option("d_model", 64, int, "hidden size", min=1),
        Option("heads", 4, int, "attention heads", min=1),
        Option("d_ff", None, int, "feed-forward size (default 4 * d_model)", min=1),
        Option("vocab", 256, int, "vocabulary size", min=2),
        Option("seq_len", 32, int, "sample sequence length (and position table size)", min=2),
        Option("batch", 2, int, "sample batch size", min=1),
        Option("head", "mlm", str, "output head", choices=("mlm", "cls")),
        Option("classes", 2, int, "classes for head=cls", min=2),
        Option("dropout", 0.0, float, "dropout probability", min=0.0),
    ],
    presets={
        "tiny": {"layers": 2, "d_model": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "small": {"layers": 4, "d_model": 512, "heads": 8, "vocab": 30522, "seq_len": 512},
        "base": {"layers": 12, "d_model": 768, "heads": 12, "vocab": 30522, "seq_len": 512},
        "large": {"layers": 24, "d_model": 1024, "heads": 16, "vocab": 30522, "seq_len": 512},
        "1b": {"layers": 20, "d_model": 2048, "heads": 16, "vocab": 30522, "seq_len": 512},
    },
    validate=_validate,
)
def build_bert(cfg: dict[str, Any], ctx: BuildContext) -> Built:
    d_ff = cfg["d_ff"] or 4 * cfg["d_model"]
    model = BERT(
        cfg["vocab"], cfg["d_model"], cfg["layers"], cfg["heads"], d_ff, cfg["seq_len"], cfg["head"], cfg["classes"], cfg["dropout"]
    )
    batch, seq = cfg["batch"], cfg["seq_len"]
    input_ids = ctx.randint(cfg["vocab"], (batch, seq))
    attention_mask = torch.ones(batch, seq, dtype=torch.long, device=ctx.input_device)
    if batch > 1 and not ctx.meta:
        # Pad the tail of the last sequence so the mask actually masks something.
        attention_mask[-1, seq - seq // 4 :] = 0
    if cfg["head"] == "cls":
        return Built(model, (input_ids, attention_mask), {}, ctx.randint(cfg["classes"], (batch,)), class_cross_entropy)
    # MLM target: the original token at ~15% of positions, -100 (ignored) elsewhere;
    # position 1 is always predicted so the loss is never an average over nothing.
    target = ctx.randint(cfg["vocab"], (batch, seq))
    if not ctx.meta:
        keep = ctx.rand((batch, seq)) < 0.15
        keep[:, 1] = True
        target = torch.where(keep, input_ids, torch.full_like(input_ids, -100))
    return Built(model, (input_ids, attention_mask), {}, target, token_cross_entropy)
