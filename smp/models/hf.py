"""Hugging Face GPT-2, BERT and T5 built offline from their config classes with random weights (never downloaded)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

from partitioner.trace import untangle_return_dict
from smp.models.common import token_cross_entropy
from smp.models.registry import BuildContext, Built, Option, SpecError, register_model

__all__ = ["require_transformers"]


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Run with the Hugging Face offline switches on, then restore the caller's environment.

    Defensive: nothing here downloads, but a transformers helper touched by accident must
    not either. Scoped rather than set at import so `import smp` does not turn a user's own
    `from_pretrained` calls offline. (If transformers is first imported in here, the hub
    library may keep the offline setting it read at import time.)
    """
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update({k: "1" for k in saved})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def require_transformers(model: str) -> Any:
    """The ``transformers`` module, or a SpecError that says how to install it."""
    try:
        with _offline():
            import transformers
    except ImportError as exc:
        raise SpecError(
            f"model {model!r} needs the 'transformers' package, which is not importable ({exc}); "
            "install it with `pip install transformers` (or `pip install smp[dev]`)"
        ) from None
    return transformers


# Config keys shared by all three: no KV cache keeps the graphs free of cache objects,
# "eager" attention avoids SDPA/flash dispatch that torch.export handles less well, and the
# top-level model returns a tuple (logits, ...) (made to work under transformers 5 by
# untangle_return_dict, as for any user's model).
_COMMON = {"use_cache": False, "attn_implementation": "eager", "return_dict": False}


def _check_heads(model: str, d_model: int, heads: int) -> None:
    if d_model % heads:
        raise SpecError(
            f"bad value {heads!r} for option 'heads' of model {model!r}: d_model={d_model} is not divisible by heads={heads}"
        )


_SIZE_OPTIONS = [
    Option("layers", 2, int, "transformer layers", min=1),
    Option("d_model", 64, int, "hidden size", min=1),
    Option("heads", 4, int, "attention heads", min=1),
    Option("vocab", 256, int, "vocabulary size", min=2),
    Option("seq_len", 32, int, "sample sequence length", min=2),
    Option("batch", 2, int, "sample batch size", min=1),
    Option("dropout", 0.0, float, "dropout probability (all dropouts)", min=0.0),
]


@register_model(
    "hf-gpt2",
    "Hugging Face GPT2LMHeadModel from GPT2Config, random weights; input input_ids (B, T); needs transformers",
    options=_SIZE_OPTIONS,
    presets={
        "tiny": {"layers": 2, "d_model": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "base": {"layers": 12, "d_model": 768, "heads": 12, "vocab": 50257, "seq_len": 1024},
    },
    validate=lambda cfg: _check_heads("hf-gpt2", cfg["d_model"], cfg["heads"]),
)
def build_hf_gpt2(cfg: dict[str, Any], ctx: BuildContext) -> Built:
    tf = require_transformers("hf-gpt2")
    p = cfg["dropout"]
    config = tf.GPT2Config(
        n_layer=cfg["layers"],
        n_embd=cfg["d_model"],
        n_head=cfg["heads"],
        vocab_size=cfg["vocab"],
        n_positions=cfg["seq_len"],
        resid_pdrop=p,
        embd_pdrop=p,
        attn_pdrop=p,
        # The default ids (50256) lie outside a small vocabulary; nothing here generates text.
        bos_token_id=None,
        eos_token_id=None,
        **_COMMON,
    )
    with _offline():
        model = tf.GPT2LMHeadModel(config)
        untangle_return_dict(model)
    tokens = ctx.randint(cfg["vocab"], (cfg["batch"], cfg["seq_len"] + 1))
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    # Labels go to our loss_fn, not to the model: the model returns (logits,) only.
    return Built(model, (input_ids,), {}, labels, token_cross_entropy)


@register_model(
    "hf-bert",
    "Hugging Face BertForMaskedLM from BertConfig, random weights; kwargs input_ids, attention_mask; needs transformers",
    options=_SIZE_OPTIONS,
    presets={
        "tiny": {"layers": 2, "d_model": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "base": {"layers": 12, "d_model": 768, "heads": 12, "vocab": 30522, "seq_len": 512},
    },
    validate=lambda cfg: _check_heads("hf-bert", cfg["d_model"], cfg["heads"]),
)
def build_hf_bert(cfg: dict[str, Any], ctx: BuildContext) -> Built:
    tf = require_transformers("hf-bert")
    p = cfg["dropout"]
    config = tf.BertConfig(
        num_hidden_layers=cfg["layers"],
        hidden_size=cfg["d_model"],
        num_attention_heads=cfg["heads"],
        intermediate_size=4 * cfg["d_model"],
        vocab_size=cfg["vocab"],
        max_position_embeddings=cfg["seq_len"],
        hidden_dropout_prob=p,
        attention_probs_dropout_prob=p,
        pad_token_id=0,
        **_COMMON,
    )
    with _offline():
        model = tf.BertForMaskedLM(config)
        untangle_return_dict(model)
    batch, seq = cfg["batch"], cfg["seq_len"]
    input_ids = ctx.randint(cfg["vocab"], (batch, seq))
    attention_mask = torch.ones(batch, seq, dtype=torch.long, device=ctx.input_device)
    target = ctx.randint(cfg["vocab"], (batch, seq))
    if not ctx.meta:
        if batch > 1:
            attention_mask[-1, seq - seq // 4 :] = 0
        keep = ctx.rand((batch, seq)) < 0.15
        keep[:, 1] = True
        target = torch.where(keep, input_ids, torch.full_like(input_ids, -100))
    return Built(model, (), {"input_ids": input_ids, "attention_mask": attention_mask}, target, token_cross_entropy)


@register_model(
    "hf-t5",
    "Hugging Face T5ForConditionalGeneration from T5Config, random weights; "
    "kwargs input_ids, attention_mask, decoder_input_ids; needs transformers",
    options=_SIZE_OPTIONS + [Option("dec_seq_len", None, int, "sample decoder length (default: seq_len)", min=1)],
    presets={
        "tiny": {"layers": 2, "d_model": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "base": {"layers": 12, "d_model": 768, "heads": 12, "vocab": 32128, "seq_len": 512},
    },
    validate=lambda cfg: _check_heads("hf-t5", cfg["d_model"], cfg["heads"]),
)
def build_hf_t5(cfg: dict[str, Any], ctx: BuildContext) -> Built:
    tf = require_transformers("hf-t5")
    config = tf.T5Config(
        num_layers=cfg["layers"],
        num_decoder_layers=cfg["layers"],
        d_model=cfg["d_model"],
        num_heads=cfg["heads"],
        d_kv=cfg["d_model"] // cfg["heads"],
        d_ff=4 * cfg["d_model"],
        vocab_size=cfg["vocab"],
        dropout_rate=cfg["dropout"],
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        **_COMMON,
    )
    with _offline():
        model = tf.T5ForConditionalGeneration(config)
        untangle_return_dict(model)
    batch, seq = cfg["batch"], cfg["seq_len"]
    dec_seq = cfg["dec_seq_len"] or seq
    input_ids = ctx.randint(cfg["vocab"], (batch, seq))
    attention_mask = torch.ones(batch, seq, dtype=torch.long, device=ctx.input_device)
    target = ctx.randint(cfg["vocab"], (batch, dec_seq))
    start = torch.zeros(batch, 1, dtype=torch.long, device=ctx.input_device)
    decoder_input_ids = torch.cat([start, target[:, :-1]], dim=1)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids}
    return Built(model, (), kwargs, target, token_cross_entropy)


@register_model(
    "hf-llama",
    "Hugging Face LlamaForCausalLM from LlamaConfig (RMSNorm, rotary positions, SwiGLU, grouped KV heads), "
    "random weights; input input_ids (B, T); needs transformers",
    options=_SIZE_OPTIONS + [Option("kv_heads", None, int, "key/value heads (default: heads)", min=1),
                             Option("ffn", None, int, "MLP hidden size (default: 8 d_model / 3)", min=1),
                             Option("attention", "eager", str, "attention kernel: eager (matmuls and softmax) or "
                                    "sdpa (torch's fused scaled_dot_product_attention)", choices=("eager", "sdpa"))],
    presets={
        "tiny": {"layers": 2, "d_model": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "1b": {"layers": 16, "d_model": 2048, "heads": 32, "kv_heads": 8, "vocab": 128256, "seq_len": 2048},
        # Llama 3's published shapes (Grattafiori et al., 2024, table 3); build them with meta=True
        "70b": {"layers": 80, "d_model": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "vocab": 128256,
                "seq_len": 4096, "attention": "sdpa"},
        "405b": {"layers": 126, "d_model": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248, "vocab": 128256,
                 "seq_len": 4096, "attention": "sdpa"},
    },
    validate=lambda cfg: _check_heads("hf-llama", cfg["d_model"], cfg["heads"]),
)
def build_hf_llama(cfg: dict[str, Any], ctx: BuildContext) -> Built:
    tf = require_transformers("hf-llama")
    config = tf.LlamaConfig(
        num_hidden_layers=cfg["layers"],
        hidden_size=cfg["d_model"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"] or cfg["heads"],
        intermediate_size=cfg["ffn"] or (8 * cfg["d_model"]) // 3,
        vocab_size=cfg["vocab"],
        max_position_embeddings=cfg["seq_len"],
        attention_dropout=cfg["dropout"],
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **{**_COMMON, "attn_implementation": cfg["attention"]},
    )
    with _offline():
        model = tf.LlamaForCausalLM(config)
        untangle_return_dict(model)
    tokens = ctx.randint(cfg["vocab"], (cfg["batch"], cfg["seq_len"] + 1))
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return Built(model, (input_ids,), {}, labels, token_cross_entropy)
