"""Tests for the model zoo (smp.models): build, run, fx-trace, presets on meta, spec strings, file specs, HF builders."""

from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import smp.models as models
from partitioner.trace import UserCodeError
from smp.models import ModelBundle, SpecError, build, list_models, parse_spec

ZOO_SPECS = [
    "gpt",
    "bert",
    "bert:head=cls",
    "t5",
    "t5:rel_pos=false,dec_layers=3,dec_seq_len=16",
    "resnet",
    "resnet:depth=26,width=4,image=16",
    "resnet:depth=10,width=4,image=72",  # ImageNet-style stem (7x7 conv + max-pool)
    "unet",
    "mlp",
    "mlp:task=classify",
]


def _run(bundle: ModelBundle) -> tuple[object, torch.Tensor]:
    out = bundle.model(*bundle.example_args, **bundle.example_kwargs)
    return out, bundle.loss_fn(out, bundle.target)


# --------------------------------------------------------------------------- zoo models


@pytest.mark.parametrize("spec", ZOO_SPECS)
def test_zoo_model_runs_and_traces(spec: str) -> None:
    start = time.perf_counter()
    bundle = build(spec)
    out, loss = _run(bundle)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in bundle.model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing[:5]}"
    assert time.perf_counter() - start < 10.0  # generous: a guard against a non-tiny default, not a benchmark

    # Plain fx traces it, and the traced module computes the same thing.
    traced = fx.symbolic_trace(bundle.model)
    torch.testing.assert_close(traced(*bundle.example_args, **bundle.example_kwargs), out)
    # The loss fn pickles: the runtime ships it to other ranks.
    assert pickle.loads(pickle.dumps(bundle.loss_fn)) is bundle.loss_fn


def test_gpt_lm_head_is_tied_and_counted_once() -> None:
    bundle = build("gpt:layers=1,d_model=32,heads=2,vocab=100,seq_len=8")
    model = bundle.model
    assert model.lm_head.weight is model.tok_emb.weight
    naive = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert bundle.num_params() == naive - 100 * 32
    assert bundle.param_bytes() == 4 * bundle.num_params()


def test_gpt_next_token_target() -> None:
    bundle = build("gpt", batch_size=3, seq_len=10)
    (idx,) = bundle.example_args
    assert idx.shape == (3, 10) and bundle.target.shape == (3, 10)
    assert torch.equal(idx[:, 1:], bundle.target[:, :-1])  # the target is the input shifted by one


def test_t5_every_decoder_layer_consumes_encoder_output() -> None:
    bundle = build("t5:layers=2,dec_layers=3")
    graph = fx.symbolic_trace(bundle.model).graph
    enc_norm = next(n for n in graph.nodes if n.op == "call_module" and n.target == "enc_norm")
    (memory,) = enc_norm.users  # enc_norm -> dropout -> every cross-attention
    consumers = {str(u.target) for u in memory.users}
    assert consumers == {f"decoder.{i}.cross_attn.kv" for i in range(3)}


def test_unet_encoder_levels_concatenated_into_decoder() -> None:
    levels = 3
    bundle = build(f"unet:levels={levels}")
    graph = fx.symbolic_trace(bundle.model).graph
    cats = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.cat]
    assert len(cats) == levels
    for j, cat in enumerate(cats):
        upsampled, skip = cat.args[0]
        assert str(upsampled.target) == f"up.{j}"
        # The skip is the last op of encoder level levels-1-j: the first level feeds the last cat.
        assert str(skip.target).startswith(f"down.{levels - 1 - j}.")
    out, _ = _run(bundle)
    assert out.shape == (2, 2, 32, 32)


def test_resnet_has_batchnorm_and_bottlenecks() -> None:
    model = build("resnet:depth=50,width=4,image=32", meta=True).model
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert sum(isinstance(m, models.resnet.Bottleneck) for m in model.modules()) == 16


def test_build_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a, b, c = build("gpt"), build("gpt"), build("gpt", seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert torch.equal(a.example_args[0], b.example_args[0]) and torch.equal(a.target, b.target)
    assert not torch.equal(a.model.tok_emb.weight, c.model.tok_emb.weight)
    assert not torch.equal(a.example_args[0], c.example_args[0])


def test_dropout_defaults_to_zero() -> None:
    for info in list_models():
        opt = info.option("dropout")
        assert opt is None or opt.default == 0.0, info.name


def test_overrides_dtype_and_batch() -> None:
    bundle = build("bert:batch=4,seq_len=16", batch_size=3, seq_len=8, dtype=torch.bfloat16)
    ids, mask = bundle.example_args
    assert ids.shape == (3, 8) and mask.shape == (3, 8) and ids.dtype == torch.long
    assert bundle.config["batch"] == 3 and bundle.config["seq_len"] == 8
    assert next(bundle.model.parameters()).dtype == torch.bfloat16
    _, loss = _run(bundle)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    img = build("resnet", dtype=torch.float64).example_args[0]
    assert img.dtype == torch.float64
    with pytest.raises(SpecError, match="seq_len"):
        build("resnet", seq_len=16)


# --------------------------------------------------------------------------- presets on meta


def _gpt_params(layers: int, d: int, vocab: int, seq: int) -> int:
    block = 2 * 2 * d + (d * d + d) + (d * 2 * d + 2 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return vocab * d + seq * d + layers * block + 2 * d  # tied head adds nothing


@pytest.mark.parametrize("name", ["gpt", "bert", "t5", "resnet", "unet", "mlp"])
def test_1b_preset_on_meta(name: str) -> None:
    start = time.perf_counter()
    bundle = build(f"{name}:size=1b", meta=True)
    assert time.perf_counter() - start < 10.0  # meta: no allocation, no init work
    assert 1.0e9 <= bundle.num_params() <= 1.3e9, bundle.num_params()
    assert all(p.is_meta for p in bundle.model.parameters())
    tensors = [*bundle.example_args, *bundle.example_kwargs.values(), bundle.target]
    assert all(t.is_meta for t in tensors)
    if name == "gpt":
        cfg = bundle.config
        assert bundle.num_params() == _gpt_params(cfg["layers"], cfg["d_model"], cfg["vocab"], cfg["seq_len"])
    if name in ("gpt", "mlp", "resnet"):  # shapes propagate on meta: planning can run the model there
        out = bundle.model(*bundle.example_args)
        assert out.is_meta and bundle.loss_fn(out, bundle.target).is_meta


def test_gpt_param_formula_on_tiny() -> None:
    bundle = build("gpt")
    assert bundle.num_params() == _gpt_params(2, 64, 256, 32)


def test_alias_and_preset_override() -> None:
    bundle = build("gpt-1b:layers=2", meta=True)
    assert bundle.name == "gpt" and bundle.config["size"] == "1b"
    assert bundle.config["layers"] == 2 and bundle.config["d_model"] == 2048


def test_preset_table_main(capsys: pytest.CaptureFixture[str]) -> None:
    from smp.models.__main__ import main

    assert main([]) == 0
    text = capsys.readouterr().out
    assert "| gpt | 1b |" in text and "| unet | tiny |" in text


# --------------------------------------------------------------------------- spec strings


def test_parse_spec() -> None:
    assert parse_spec("gpt:layers=24,d_model=1024") == ("gpt", {"layers": 24, "d_model": 1024})
    assert parse_spec("t5:rel_pos=false,dropout=0.1,head=mlm") == ("t5", {"rel_pos": False, "dropout": 0.1, "head": "mlm"})
    assert parse_spec("mlp") == ("mlp", {})
    assert parse_spec(" resnet : depth = 50 ") == ("resnet", {"depth": 50})
    assert parse_spec("dir/my_model.py:make:n=3") == ("dir/my_model.py", {"factory": "make", "n": 3})


def test_list_models() -> None:
    infos = {i.name: i for i in list_models()}
    assert {"gpt", "bert", "t5", "resnet", "unet", "mlp", "hf-gpt2", "hf-bert", "hf-t5"} <= set(infos)
    gpt = infos["gpt"]
    assert gpt.defaults["layers"] == 2 and set(gpt.presets) == {"tiny", "small", "base", "large", "1b"}
    assert "gpt-1b" in gpt.aliases and gpt.description


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        (
            "gpt:layer=4",
            r"unknown option 'layer' for model 'gpt'; accepted: layers, d_model, heads, vocab, seq_len, batch, size, "
            r"dropout \(did you mean 'layers'\?\)",
        ),
        ("gpt:layers=abc", r"bad value 'abc' for option 'layers' of model 'gpt': expected an integer"),
        ("gpt:layers=2.5", r"option 'layers' of model 'gpt': expected an integer"),
        ("gpt:layers=0", r"option 'layers' .* must be >= 1"),
        ("gpt:dropout=lots", r"option 'dropout' of model 'gpt': expected a number"),
        ("t5:rel_pos=maybe", r"option 'rel_pos' of model 't5': expected true or false"),
        ("gpt:size=huge", r"option 'size' of model 'gpt'.*tiny, small, base, large, 1b"),
        ("gpt:heads=5", r"not divisible by heads=5"),
        ("bert:head=foo", r"choices: mlm, cls"),
        ("resnet:depth=20", r"accepted depths: 10, 18"),
        ("unet:image=30", r"divisible by 2\*\*levels"),
        ("gptt", r"unknown model 'gptt'; known models: gpt, bert, .*\(did you mean 'gpt'\?\)"),
        ("gpt:layers", r"expected name=value"),
        ("gpt:layers=2,layers=3", r"'layers' given twice"),
        ("", r"empty model spec"),
    ],
)
def test_bad_specs(spec: str, pattern: str) -> None:
    with pytest.raises(SpecError, match=pattern):
        build(spec)


# --------------------------------------------------------------------------- file specs

_FACTORY_FILE = '''
import torch
from torch import nn
from smp.models import ModelBundle


def _net():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def pair():
    return _net(), (torch.randn(3, 4),)


def triple(width=8):
    return nn.Linear(4, width), (torch.randn(3, 4),), {}


def as_dict():
    return {"model": _net(), "args": torch.randn(3, 4), "target": torch.zeros(3, 2)}


def as_bundle():
    m = _net()
    return ModelBundle("mine", "", m, (torch.randn(3, 4),), {}, torch.zeros(3, 2),
                       lambda out, t: (out - t).pow(2).mean())


def wrong():
    return 42


def not_a_module():
    return "model", (torch.randn(3, 4),)


NOT_CALLABLE = 3
'''


@pytest.fixture()
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_model.py"
    path.write_text(_FACTORY_FILE)
    return path


@pytest.mark.parametrize("factory", ["pair", "triple", "as_dict", "as_bundle"])
def test_file_spec_factories(factory_file: Path, factory: str) -> None:
    spec = f"{factory_file}:{factory}"
    bundle = build(spec)
    assert isinstance(bundle.model, torch.nn.Module) and bundle.spec == spec
    assert isinstance(bundle.example_args, tuple) and len(bundle.example_args) == 1
    _, loss = _run(bundle)
    assert loss.dim() == 0
    again = build(spec)  # seeded: the same weights and inputs twice
    assert torch.equal(bundle.example_args[0], again.example_args[0])


def test_file_spec_options_and_meta(factory_file: Path) -> None:
    bundle = build(f"{factory_file}:triple:width=5", meta=True)
    assert bundle.model.weight.shape == (5, 4) and bundle.model.weight.is_meta
    assert bundle.config == {"width": 5}
    with pytest.raises(SpecError, match="does not accept options"):
        build(f"{factory_file}:triple:depth=5")


@pytest.mark.parametrize(
    ("suffix", "pattern"),
    [
        ("missing", r"factory 'missing' not found in .*functions there: .*pair"),
        ("NOT_CALLABLE", r"factory 'NOT_CALLABLE' is not callable"),
        ("wrong", r"factory 'wrong' .* returned int; expected \(model, args\)"),
        ("not_a_module", r"returned a model of type str, not a torch.nn.Module"),
        ("", r"names no factory"),
    ],
)
def test_file_spec_errors(factory_file: Path, suffix: str, pattern: str) -> None:
    with pytest.raises(SpecError, match=pattern):
        build(f"{factory_file}:{suffix}")


def test_file_spec_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"model file .*nope.py' not found"):
        build(f"{tmp_path}/nope.py:make")


def test_file_spec_import_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("import torch\n\nraise RuntimeError('boom')\n")
    with pytest.raises(UserCodeError, match=rf"importing .* raised RuntimeError: boom; at {path}:3 in <module>"):
        build(f"{path}:make")
    path.write_text("def make(:\n    pass\n")
    with pytest.raises(UserCodeError, match=rf"raised SyntaxError: .*; at {path}:1 .*`def make\(:`"):
        build(f"{path}:make")


def test_a_factory_that_raises_is_reported_as_the_users_error(tmp_path: Path) -> None:
    # Was a bare RuntimeError, which the CLI called "internal error ...; this is a bug in smp".
    path = tmp_path / "mine.py"
    path.write_text("def helper():\n    return {}['width']\n\n\ndef make():\n    return helper()\n")
    with pytest.raises(UserCodeError) as info:
        build(f"{path}:make")
    message = str(info.value)
    assert message.startswith(f"factory 'make' in '{path}' raised KeyError: 'width'")
    assert f"at {path}:2 in helper: `return {{}}['width']`" in message  # the deepest line of the user's file
    assert isinstance(info.value.__cause__, KeyError)


# --------------------------------------------------------------------------- batches of file models


def test_with_batch_repeats_or_cuts_the_rows_of_every_batched_tensor(factory_file: Path) -> None:
    bundle = build(f"{factory_file}:as_dict")  # args (3, 4), target (3, 2)
    big = models.with_batch(bundle, 7)
    x, = big.example_args
    assert x.shape == (7, 4) and big.target.shape == (7, 2)
    assert torch.equal(x[:3], bundle.example_args[0]) and torch.equal(x[3:6], bundle.example_args[0])
    small = models.with_batch(bundle, 2)
    assert torch.equal(small.example_args[0], bundle.example_args[0][:2]) and small.target.shape == (2, 2)
    assert models.with_batch(bundle, 3) is bundle


def test_file_models_take_batch_size_and_refuse_seq_len(factory_file: Path) -> None:
    # batch_size was silently ignored for file specs: the factory's batch of 3 came back.
    assert build(f"{factory_file}:pair", batch_size=12).example_args[0].shape == (12, 4)
    assert build(f"{factory_file}:pair", batch_size=12, meta=True).example_args[0].shape == (12, 4)
    with pytest.raises(SpecError, match=r"file model.*:pair:seq_len=16"):
        build(f"{factory_file}:pair", seq_len=16)


def test_build_step_one_rule_for_zoo_and_file_models(factory_file: Path) -> None:
    """The spec's sample batch is one microbatch; a step is `microbatches` of them unless batch_size says."""
    step = models.build_step(f"{factory_file}:pair", microbatches=4)
    assert step.example_args[0].shape == (12, 4)  # 4 microbatches of the factory's 3 rows
    assert models.build_step(f"{factory_file}:pair", microbatches=4, batch_size=8).example_args[0].shape == (8, 4)
    zoo = models.build_step("gpt:batch=2", microbatches=3)
    assert zoo.example_args[0].shape[0] == 6 and zoo.config["batch"] == 6


# --------------------------------------------------------------------------- Hugging Face builders


@pytest.mark.parametrize("spec", ["hf-gpt2", "hf-bert", "hf-t5"])
def test_hf_models_build_and_run(spec: str) -> None:
    pytest.importorskip("transformers")
    bundle = build(spec)
    out, loss = _run(bundle)
    assert isinstance(out, tuple)  # return_dict=False on the top-level model
    assert out[0].shape[-1] == 256 and torch.isfinite(loss)
    loss.backward()
    assert bundle.model.config._attn_implementation == "eager"
    assert build(spec, meta=True).num_params() == bundle.num_params()


def test_hf_inputs() -> None:
    pytest.importorskip("transformers")
    assert set(build("hf-bert").example_kwargs) == {"input_ids", "attention_mask"}
    assert set(build("hf-t5").example_kwargs) == {"input_ids", "attention_mask", "decoder_input_ids"}
    assert len(build("hf-gpt2").example_args) == 1


def test_hf_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(SpecError, match=r"pip install transformers"):
        build("hf-gpt2")
