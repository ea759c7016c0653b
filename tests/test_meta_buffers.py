"""Models built under ``torch.device("meta")``: buffers no checkpoint holds are recomputed, or refused by name."""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import save_model
from torch import nn

import smp
from partitioner.trace import untangle_return_dict
from runtime.errors import RuntimeConfigError
from smp.models.common import token_cross_entropy

from _runtime_common import make_optimizer

VOCAB, SEQ, BATCH, MICROBATCHES = 64, 16, 4, 2


def hf_causal_lm(family: str, meta: bool) -> nn.Module:
    """A tiny Hugging Face causal LM from its config, random weights seeded alike, on meta or real."""
    tf = pytest.importorskip("transformers")
    config_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                             "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                             "gpt-neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM)}[family]
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
                        attn_implementation="eager", return_dict=False)
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = model_cls(config)
    untangle_return_dict(model)
    return model


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def reference_losses(model: nn.Module, steps: int) -> list[torch.Tensor]:
    """The unpartitioned model's mean microbatch loss per step, as a pipeline with MICROBATCHES computes it."""
    x, y = tokens()
    opt = make_optimizer(model.parameters())
    losses = []
    for _ in range(steps):
        step = []
        for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            loss = token_cross_entropy(model(xs), ys)
            (loss / MICROBATCHES).backward()
            step.append(loss.detach())
        losses.append(torch.stack(step).mean())
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt-neox"])  # Mistral, Qwen2, Gemma, Phi: rotary as Llama
def test_a_meta_built_hf_model_recomputes_its_rotary_frequencies_and_trains_as_the_reference(family, tmp_path
                                                                                            ) -> None:
    real = hf_causal_lm(family, meta=False)
    rotary = {n: b.clone() for n, b in real.named_buffers() if n.endswith("inv_freq")}
    assert rotary, "the family has rotary frequencies (non-persistent buffers)"
    save_model(real, str(tmp_path / "model.safetensors"))  # holds no non-persistent buffer
    meta = hf_causal_lm(family, meta=True)
    assert all(t.is_meta for t in meta.state_dict().values())
    pipe = smp.partition(meta, stages=2, microbatches=MICROBATCHES, loss_fn=token_cross_entropy,
                         checkpoint=tmp_path / "model.safetensors", timing="analytic")
    x, y = tokens()
    pipe.prepare(x)
    opt = make_optimizer(pipe.parameters())
    losses = []
    for _ in range(2):
        losses.append(pipe.step(x, target=y))
        opt.step()
        opt.zero_grad()
    expected = reference_losses(real, 2)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=0, atol=1e-6)
    held = dict(meta.named_buffers())
    for name, value in rotary.items():
        if not held[name].is_meta:  # the stages hold it: the constructor's exact values
            assert torch.equal(held[name], value), name


def test_a_meta_built_hf_model_without_checkpoint_gets_its_rotary_frequencies() -> None:
    real = hf_causal_lm("llama", meta=False)
    meta = hf_causal_lm("llama", meta=True)
    pipe = smp.partition(meta, stages=2, microbatches=MICROBATCHES, loss_fn=token_cross_entropy, timing="analytic")
    pipe.prepare(tokens()[0])
    assert torch.equal(meta.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)


class Scaled(nn.Module):
    """A linear layer times a computed, non-persistent buffer that nothing but the constructor knows how to make."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(1, 2, 8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class ScaledWithReset(Scaled):
    """The same, whose own reset_parameters() re-creates the buffer."""

    def reset_parameters(self) -> None:
        self.scale = torch.linspace(1, 2, 8)


class Net(nn.Module):
    def __init__(self, body: type[Scaled]) -> None:
        super().__init__()
        self.body = body()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_a_buffer_smp_cannot_recompute_is_named_with_the_two_ways_that_work(tmp_path) -> None:
    torch.manual_seed(0)
    real = Net(Scaled)
    save_model(real, str(tmp_path / "net.safetensors"))
    x = torch.randn(4, 8)
    expected = real(x)
    with torch.device("meta"):
        model = Net(Scaled)
    plan = smp.plan(model, (x,), stages=1, microbatches=2, timing="analytic")
    for checkpoint in (tmp_path / "net.safetensors", None):
        with pytest.raises(RuntimeConfigError) as err:
            smp.partition(model, plan=plan, loss_fn=lambda o, t: o.sum(), checkpoint=checkpoint).prepare(x)
        message = str(err.value)
        for part in ("'body.scale'", "(Scaled)", "smp.delay_param_initialization()", "init_fn"):
            assert part in message, (part, message)
        assert model.body.scale.is_meta and model.body.lin.weight.is_meta  # a failure leaves the model as it was

    def give_scale(module: nn.Module) -> None:
        if isinstance(module, Scaled):
            module.scale.copy_(torch.linspace(1, 2, 8))

    pipe = smp.partition(model, plan=plan, loss_fn=lambda o, t: o.sum(), checkpoint=tmp_path / "net.safetensors",
                         init_fn=give_scale)
    pipe.prepare(x)
    assert torch.equal(model.body.scale, real.body.scale)
    torch.testing.assert_close(model(x), expected)  # one stage holds every tensor: the model itself now runs


def test_a_reset_parameters_that_recreates_the_buffer_recovers_it(tmp_path) -> None:
    torch.manual_seed(0)
    real = Net(ScaledWithReset)
    save_model(real, str(tmp_path / "net.safetensors"))
    with torch.device("meta"):
        model = Net(ScaledWithReset)
    x = torch.randn(4, 8)
    pipe = smp.partition(model, stages=1, microbatches=2, loss_fn=lambda o, t: o.sum(),
                         checkpoint=tmp_path / "net.safetensors", timing="analytic")
    pipe.prepare(x)
    assert torch.equal(model.body.scale, real.body.scale)
    assert torch.equal(model.body.lin.weight, real.body.lin.weight)  # the checkpoint's, not the reset's
