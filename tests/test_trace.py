"""Tracer: every zoo model and HF GPT-2/BERT/T5 trace to a program that reproduces the model."""

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from partitioner import TraceError, flatten_inputs, trace
from smp.models import build

ZOO = ["gpt", "bert", "t5", "resnet", "unet", "mlp"]
HF = ["hf-gpt2", "hf-bert", "hf-t5"]


def _assert_same(a, b):
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_models_trace_with_fx_and_match(name):
    bundle = build(f"{name}:size=tiny")
    gm = trace(bundle.model, bundle.example_args, bundle.example_kwargs)
    assert gm.meta["smp_trace"].frontend == "fx"
    with torch.no_grad():
        _assert_same(gm(*bundle.example_args, **bundle.example_kwargs),
                     bundle.model(*bundle.example_args, **bundle.example_kwargs))


@pytest.mark.parametrize("name", ZOO)
def test_zoo_models_trace_with_export_too(name):
    bundle = build(f"{name}:size=tiny")
    gm = trace(bundle.model, bundle.example_args, bundle.example_kwargs, frontend="export")
    assert gm.meta["smp_trace"].frontend == "export"
    with torch.no_grad():
        _assert_same(gm(*bundle.example_args, **bundle.example_kwargs),
                     bundle.model(*bundle.example_args, **bundle.example_kwargs))
    params = {p for n in gm.graph.nodes for p in n.meta.get("smp_params", ())}
    names = dict(bundle.model.named_parameters(remove_duplicate=False))
    assert params <= set(names) and {id(names[p]) for p in params} == {id(p) for p in bundle.model.parameters()}


@pytest.mark.parametrize("name", HF)
def test_hugging_face_models_fall_back_to_export(name):
    pytest.importorskip("transformers")
    bundle = build(name)
    with pytest.raises(TraceError, match="torch.fx could not trace"):
        trace(bundle.model, bundle.example_args, bundle.example_kwargs, frontend="fx")
    gm = trace(bundle.model, bundle.example_args, bundle.example_kwargs)
    info = gm.meta["smp_trace"]
    assert info.frontend == "export"
    assert info.fx_error  # why fx was not used is kept for the user
    with torch.no_grad():
        _assert_same(gm(*bundle.example_args, **bundle.example_kwargs),
                     bundle.model(*bundle.example_args, **bundle.example_kwargs))
    modules = {n.meta["smp_module"] for n in gm.graph.nodes if "smp_module" in n.meta}
    assert any(".0." in m or m.endswith(".0") for m in modules), modules  # per-layer paths survive export
    used = {p for n in gm.graph.nodes for p in n.meta.get("smp_params", ())}
    all_names = dict(bundle.model.named_parameters(remove_duplicate=False))
    assert used <= set(all_names)  # the model's own names, tied ones included
    # every parameter tensor is read by some op, under one of its names
    assert {id(all_names[u]) for u in used} == {id(p) for p in bundle.model.parameters()}


def test_zoo_gpt_node_metadata():
    bundle = build("gpt:size=tiny")
    gm = trace(bundle.model, bundle.example_args)
    by_module = {n.meta["smp_module"]: n for n in gm.graph.nodes if n.op == "call_module"}
    assert "blocks.0.attn.q" in by_module
    assert by_module["blocks.0.attn.q"].meta["smp_params"][0] == "blocks.0.attn.q.weight"
    # The tied LM head reads the embedding's tensor; both names are the model's own.
    params = {p for n in gm.graph.nodes for p in n.meta.get("smp_params", ())}
    assert "tok_emb.weight" in params
    assert bundle.model.lm_head.weight is bundle.model.tok_emb.weight


class _Kitchen(nn.Module):
    """Several inputs (args and kwargs), a dict output, BatchNorm buffers, in-place ops, a tied weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens, mask=None, scale: float = 1.0):
        h = self.emb(tokens).mean(1)
        h = self.body(h)
        h = self.norm(h)
        h += 1.0
        if mask is not None:
            h = h * mask
        return {"logits": self.head(h) * scale, "hidden": (h, h.sum())}


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_many_inputs_outputs_buffers_inplace_and_tied(frontend):
    model = _Kitchen().train()
    tokens = torch.randint(0, 20, (4, 3))
    mask = torch.rand(8)
    gm = trace(model, (tokens,), {"mask": mask, "scale": 2.0}, frontend=frontend)
    assert gm.meta["smp_trace"].frontend == frontend
    before = model.norm.running_mean.clone()
    with torch.no_grad():
        got = gm(tokens, mask=mask, scale=2.0)
    assert not torch.equal(before, model.norm.running_mean)  # train-mode BN updates its stats
    model.norm.running_mean.copy_(before)
    model.norm.running_var.fill_(1.0)
    model.norm.num_batches_tracked.zero_()
    with torch.no_grad():
        model.norm.running_var.fill_(1.0)
        expected = model(tokens, mask=mask, scale=2.0)
    _assert_same(got, expected)
    buffers = {b for n in gm.graph.nodes for b in n.meta.get("smp_buffers", ())}
    assert {"norm.running_mean", "norm.running_var"} <= buffers
    values = flatten_inputs(gm, (tokens,), {"mask": mask, "scale": 2.0})
    assert any(v is tokens for v in values) and any(v is mask for v in values)


def test_trace_does_not_change_model_state():
    model = _Kitchen().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    trace(model, (torch.randint(0, 20, (4, 3)),))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


class _Custom(nn.Module):
    def forward(self, x):
        return x.relu() * 2


class _WithCustom(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Custom()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(self.lin(x))


def test_leaf_modules_are_configurable():
    model = _WithCustom()
    x = torch.randn(2, 4)
    default = trace(model, (x,))
    assert not any(n.op == "call_module" and n.target == "inner" for n in default.graph.nodes)
    for leaf in (_Custom, "inner"):
        gm = trace(model, (x,), leaf_modules=[leaf])
        assert any(n.op == "call_module" and n.target == "inner" for n in gm.graph.nodes)


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # data-dependent control flow: neither front end can follow it
            return h.nonzero()
        return h


def test_untraceable_model_gets_a_clear_error():
    with pytest.raises(TraceError) as info:
        trace(_Untraceable(), (torch.randn(2, 3),))
    message = str(info.value)
    assert "torch.fx failed" in message and "torch.export (non-strict) failed" in message
    assert "if h.sum() > 0" in message  # the offending line of the model
    assert "What to try" in message
    assert "Traceback" not in message


def test_sample_inputs_that_do_not_fit_the_model():
    bundle = build("mlp:size=tiny")
    with pytest.raises(TraceError, match="do not match"):
        trace(bundle.model, (bundle.example_args[0], bundle.example_args[0]))
    with pytest.raises(TraceError, match="do not match"):
        trace(bundle.model, (), {"nonsense": 1})
    with pytest.raises(TraceError):  # right arity, wrong shape: both front ends fail
        trace(bundle.model, (torch.randn(2, 7, 3),))


class _WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


def test_a_model_that_writes_into_its_input_traces_and_the_sample_is_left_alone():
    x = torch.randn(3, 4)
    before = x.clone()
    gm = trace(_WritesItsInput(), (x,))
    assert torch.equal(x, before)
    assert gm.meta["smp_trace"].frontend in ("fx", "export")
