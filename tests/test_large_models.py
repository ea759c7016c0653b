"""Models that need not fit: built without weights, materialized per stage, loaded from and saved to checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file, save_model
from torch import nn

import smp
from runtime.checkpoint import CheckpointError, consolidate, open_weights, save_sharded
from runtime.errors import RuntimeConfigError
from smp.deferred import delay_param_initialization
from smp.models.gpt import GPT

from _runtime_common import make_optimizer

VOCAB, D, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16


def gpt(meta: bool = False) -> GPT:
    torch.manual_seed(0)
    with delay_param_initialization(meta):
        return GPT(VOCAB, D, LAYERS, HEADS, SEQ)


def batch(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def reference_steps(model: nn.Module, steps: int, m: int = 2) -> tuple[list[torch.Tensor], dict]:
    x, y = batch()
    opt = make_optimizer(model.parameters())
    losses = []
    for _ in range(steps):
        step_losses = []
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            loss = loss_fn(model(xs), ys)
            (loss / m).backward()
            step_losses.append(loss.detach())
        losses.append(torch.stack(step_losses).mean())
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def pipeline_steps(pipe: smp.PipelinedModel, steps: int) -> tuple[list[torch.Tensor], dict]:
    x, y = batch()
    pipe.prepare(x)
    opt = make_optimizer(pipe.parameters())
    losses = []
    for _ in range(steps):
        losses.append(pipe.step(x, target=y))
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in pipe.named_parameters()}


def plan_for(model: nn.Module, stages: int = 2) -> smp.Plan:
    return smp.plan(model, (batch()[0],), stages=stages, microbatches=2, timing="analytic")


def test_delay_param_initialization_puts_parameters_on_meta_and_keeps_buffers() -> None:
    model = gpt(meta=True)
    assert all(p.is_meta for p in model.parameters())
    assert not model.pos_ids.is_meta and torch.equal(model.pos_ids, torch.arange(SEQ))
    assert model.lm_head.weight is model.tok_emb.weight  # the tie survives
    with delay_param_initialization(enabled=False):
        assert not nn.Linear(2, 2).weight.is_meta


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "torch", "smp"])
def test_a_meta_model_loads_its_stages_from_any_checkpoint_and_trains_as_the_reference(fmt, tmp_path) -> None:
    real = gpt()
    path = _write_checkpoint(real, fmt, tmp_path)
    want_losses, want_params = reference_steps(copy.deepcopy(real), 3)
    meta = gpt(meta=True)
    pipe = smp.partition(meta, plan=plan_for(meta), loss_fn=loss_fn, checkpoint=path)
    losses, params = pipeline_steps(pipe, 3)
    for got, want in zip(losses, want_losses):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    for name, p in params.items():
        assert torch.allclose(p, want_params[name], rtol=1e-5, atol=1e-6), name


def _write_checkpoint(model: nn.Module, fmt: str, tmp_path):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight")  # the tied head: checkpoints keep one copy, the loader finds it by its other name
    if fmt == "safetensors":
        save_model(model, str(tmp_path / "model.safetensors"))
        return tmp_path / "model.safetensors"
    if fmt == "sharded":  # a Hugging Face style directory: shards and an index
        save_sharded(state, tmp_path, shard_bytes=20_000)
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
        return tmp_path
    if fmt == "torch":
        torch.save(state, tmp_path / "model.pt")
        return tmp_path / "model.pt"
    pipe = smp.partition(copy.deepcopy(model), plan=plan_for(model, 3), loss_fn=loss_fn)
    pipe.prepare(batch()[0])
    pipe.save_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_reset_parameters_initializes_a_meta_model_the_same_under_every_partition() -> None:
    weights = []
    for stages in (1, 2, 3):
        meta = gpt(meta=True)
        pipe = smp.partition(meta, plan=plan_for(meta, stages), loss_fn=loss_fn, init_seed=7)
        pipe.prepare(batch()[0])
        weights.append({n: p.detach().clone() for n, p in pipe.named_parameters()})
        assert all(not p.is_meta for p in meta.parameters())
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        assert all(torch.equal(other[n], weights[0][n]) for n in other)


def test_what_cannot_be_materialized_is_named() -> None:
    class Scaled(nn.Module):
        """A parameter of the root module, which has no reset_parameters."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return self.lin(x) * self.scale

    with torch.device("meta"):
        model = Scaled()
    x = torch.randn(4, 8)
    plan = smp.plan(model, (x,), stages=1, microbatches=2, timing="analytic")
    with pytest.raises(RuntimeConfigError, match=r"module '\(root\)' \(Scaled\) holds \['scale'\].*init_fn"):
        smp.partition(model, plan=plan, loss_fn=lambda o, t: o.sum()).prepare(x)
    # an init_fn fills it
    done = []
    pipe = smp.partition(model, plan=plan, loss_fn=lambda o, t: o.sum(),
                         init_fn=lambda m: (done.append(type(m).__name__),
                                            [nn.init.ones_(p) for p in m.parameters(recurse=False)]))
    pipe.prepare(x)
    assert torch.equal(model.scale, torch.ones(8)) and "Scaled" in done


def test_checkpoint_errors_name_the_tensor(tmp_path) -> None:
    real = gpt()
    state = {k: v.clone() for k, v in real.state_dict().items() if k != "lm_head.weight"}
    missing = dict(state)
    missing.pop("blocks.1.mlp.0.weight", None) if "blocks.1.mlp.0.weight" in missing else missing.pop(
        sorted(k for k in missing if k.startswith("blocks.1"))[0])
    dropped = sorted(set(state) - set(missing))[0]
    save_file(missing, str(tmp_path / "missing.safetensors"))
    meta = gpt(meta=True)
    with pytest.raises(RuntimeConfigError, match=f"no tensor '{dropped}'"):
        smp.partition(meta, plan=plan_for(meta), loss_fn=loss_fn,
                      checkpoint=tmp_path / "missing.safetensors").prepare(batch()[0])
    wrong = dict(state, **{"ln_f.weight": torch.ones(D + 1)})
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    meta = gpt(meta=True)
    with pytest.raises(RuntimeConfigError, match=r"ln_f.weight .* shape \(33,\), the model's is \(32,\)"):
        smp.partition(meta, plan=plan_for(meta), loss_fn=loss_fn,
                      checkpoint=tmp_path / "wrong.safetensors").prepare(batch()[0])
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        open_weights(tmp_path / "nothing-here")


def test_a_checkpoint_reloads_into_another_stage_count_and_consolidates(tmp_path) -> None:
    model = gpt()
    pipe = smp.partition(model, plan=plan_for(model, 3), loss_fn=loss_fn)
    pipeline_steps(pipe, 2)
    pipe.save_checkpoint(tmp_path / "ckpt")
    x = batch()[0]
    with torch.no_grad():
        want = pipe(x)
    meta = gpt(meta=True)
    two = smp.partition(meta, plan=plan_for(meta, 2), loss_fn=loss_fn, checkpoint=tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.allclose(two(x), want, rtol=1e-6, atol=1e-6)
    for suffix in (".safetensors", ".pt"):
        single = consolidate(tmp_path / "ckpt", tmp_path / f"full{suffix}")
        fresh = GPT(VOCAB, D, LAYERS, HEADS, SEQ)
        state = open_weights(single)
        targets = dict(fresh.state_dict())
        targets.pop("pos_ids", None)
        state.read({k: v for k, v in targets.items() if k in state.names()})
        assert state.names() >= set(targets) - {"lm_head.weight"}
        with torch.no_grad():
            assert torch.allclose(fresh(x), want, rtol=1e-6, atol=1e-6)


def test_resuming_from_a_checkpoint_is_exact(tmp_path) -> None:
    model = gpt()
    straight = smp.partition(copy.deepcopy(model), plan=plan_for(model), loss_fn=loss_fn)
    want_losses, want_params = pipeline_steps(straight, 4)

    first = smp.partition(copy.deepcopy(model), plan=plan_for(model), loss_fn=loss_fn)
    x, y = batch()
    first.prepare(x)
    opt = make_optimizer(first.parameters())
    losses = []
    for _ in range(2):
        losses.append(first.step(x, target=y))
        opt.step()
        opt.zero_grad()
    first.save_checkpoint(tmp_path / "ckpt", optimizer=opt)

    meta = gpt(meta=True)
    second = smp.partition(meta, plan=plan_for(meta), loss_fn=loss_fn, checkpoint=tmp_path / "ckpt")
    second.prepare(x)
    opt2 = make_optimizer(second.parameters())
    second.load_checkpoint(tmp_path / "ckpt", optimizer=opt2)
    for _ in range(2):
        losses.append(second.step(x, target=y))
        opt2.step()
        opt2.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses)), (losses, want_losses)
    for name, p in second.named_parameters():
        assert torch.equal(p, want_params[name]), name


def test_an_fp16_resume_restores_the_loss_scale(tmp_path) -> None:
    """The loss scaler's state goes into the checkpoint: resumed, the scale and the steps go on as in one run.
    Was: save_checkpoint left it out, and the resumed run started again from the initial scale."""
    def run(pipe: smp.PipelinedModel, opt, steps: int) -> list[float]:
        x, y = batch()
        out = []
        for _ in range(steps):
            out.append(float(pipe.step(x, target=y)))
            opt.step()
            opt.zero_grad()
        return out

    def fp16(model, **kw) -> smp.PipelinedModel:  # the scale grows every step: a state that matters
        pipe = smp.partition(model, plan=plan_for(model), loss_fn=loss_fn, precision="fp16",
                             grad_scaler=smp.PipelineGradScaler(init_scale=2.0 ** 8, growth_interval=1), **kw)
        pipe.prepare(batch()[0])
        return pipe

    model = gpt()
    straight = fp16(copy.deepcopy(model))
    want = run(straight, make_optimizer(straight.parameters()), 4)
    first = fp16(copy.deepcopy(model))
    opt = make_optimizer(first.parameters())
    got = run(first, opt, 2)
    first.save_checkpoint(tmp_path / "ckpt", optimizer=opt)
    second = fp16(gpt(meta=True), checkpoint=tmp_path / "ckpt")
    opt2 = make_optimizer(second.parameters())
    second.load_checkpoint(tmp_path / "ckpt", optimizer=opt2)
    assert second.grad_scaler.state_dict() == first.grad_scaler.state_dict()
    got += run(second, opt2, 2)
    assert got == want and second.grad_scaler.scale == straight.grad_scaler.scale == 2.0 ** 12


def test_clip_grad_norm_matches_the_unpartitioned_model() -> None:
    model = gpt()
    reference = copy.deepcopy(model)
    x, y = batch()
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        (loss_fn(reference(xs), ys) / 2).backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    pipe = smp.partition(model, plan=plan_for(model, 3), loss_fn=loss_fn)
    pipe.step(x, target=y)
    got = pipe.clip_grad_norm_(0.5)
    assert torch.allclose(got, want, rtol=1e-5)
    for name, p in pipe.named_parameters():
        assert torch.allclose(p.grad, dict(reference.named_parameters())[name].grad, rtol=1e-5, atol=1e-7), name
