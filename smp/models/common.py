"""Pieces shared by the zoo models: fx-traceable attention and picklable loss functions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp.models.registry import SpecError

__all__ = [
    "Attention",
    "token_cross_entropy",
    "class_cross_entropy",
    "mse_loss",
    "check_heads",
    "output_logits",
]


class Attention(nn.Module):
    """Multi-head attention on ``F.scaled_dot_product_attention``.

    Written by hand rather than with ``nn.MultiheadAttention`` because the latter has
    Python branches on tensor properties that plain ``torch.fx.symbolic_trace`` cannot
    follow. Self-attention when ``memory`` is None, cross-attention otherwise.
    """

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = d_model // heads
        self.dropout = dropout
        self.q = nn.Linear(d_model, d_model, bias=bias)
        self.kv = nn.Linear(d_model, 2 * d_model, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, D) -> (B, H, T, D/H); shapes are read only as view arguments, which fx allows.
        return x.view(x.size(0), x.size(1), self.heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        source = x if memory is None else memory  # `memory is None` is a Python fact, not a tensor test
        k, v = self.kv(source).chunk(2, dim=-1)
        q, k, v = self._split_heads(self.q(x)), self._split_heads(k), self._split_heads(v)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal
        )
        y = y.transpose(1, 2).reshape(x.size(0), x.size(1), self.heads * self.head_dim)
        return self.out(y)


def check_heads(model: str, cfg: dict[str, Any]) -> None:
    """SpecError unless d_model splits evenly into heads."""
    if cfg["d_model"] % cfg["heads"]:
        raise SpecError(
            f"bad value {cfg['heads']!r} for option 'heads' of model {model!r}: "
            f"d_model={cfg['d_model']} is not divisible by heads={cfg['heads']}"
        )


# Loss functions are module-level so a bundle's loss_fn pickles (the runtime ships it to ranks).


def output_logits(output: Any) -> torch.Tensor:
    """The logits tensor inside a model's output (a tensor, a tuple/list, or a dict)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if "logits" in output:
            return output["logits"]
        return next(iter(output.values()))
    if isinstance(output, (tuple, list)):
        return output[0]
    # transformers ModelOutput is a Mapping subclass in practice; attribute is the fallback.
    logits = getattr(output, "logits", None)
    if logits is None:
        raise TypeError(f"cannot find the logits in a model output of type {type(output).__name__}")
    return logits


def token_cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of (B, T, V) logits against (B, T) token ids; -100 marks ignored positions."""
    logits = output_logits(output)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1), ignore_index=-100)


def class_cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of (B, C) or per-pixel (B, C, H, W) logits against class ids."""
    return F.cross_entropy(output_logits(output).float(), target)


def mse_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error, computed in fp32."""
    return F.mse_loss(output_logits(output).float(), target.float())
