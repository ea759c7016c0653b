"""Errors raised by the user's own code (a factory, a model's forward, wrong input shapes) are reported as theirs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from partitioner.trace import TraceError, UserCodeError, trace
from smp.cli import app

runner = CliRunner()

_MODELS = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def good():
    return Net(), (torch.randn(8, 16),)


def wrong_shape():
    return Net(), (torch.randn(8, 12),)


def broken():
    raise RuntimeError("my factory is broken")


class Picky(Net):
    def forward(self, x):
        table = {"known": 1}
        return self.a(x) * table["unknown"]


def picky():
    return Picky(), (torch.randn(8, 16),)
'''


@pytest.fixture(scope="module")
def models_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "models.py"
    path.write_text(_MODELS)
    return path


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _one_line_error(*args: str) -> str:
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 1, f"exit {res.exit_code}:\n{res.output}"
    err = res.stderr
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in res.output and "bug in smp" not in err
    return err.strip()


def test_a_factory_that_raises(models_file):
    err = _one_line_error("plan", f"{models_file}:broken", "--stages", 2)
    line = _line_of(models_file, 'raise RuntimeError("my factory is broken")')
    assert err == (f"error: factory 'broken' in '{models_file}' raised RuntimeError: my factory is broken; at "
                   f"{models_file}:{line} in broken: `raise RuntimeError(\"my factory is broken\")`")


def test_a_forward_that_raises(models_file):
    err = _one_line_error("profile", f"{models_file}:picky", "--repeats", 1)
    line = _line_of(models_file, 'table["unknown"]')
    assert err.startswith("error: Picky raised KeyError: 'unknown'")
    assert f"at {models_file}:{line} in forward: `return self.a(x) * table[\"unknown\"]`" in err
    assert "sample inputs: x 8x16" in err


@pytest.mark.parametrize("meta", [False, True])
def test_inputs_of_the_wrong_shape_name_the_input_and_the_op(models_file, meta, capfd):
    # Was ~19 lines of fake_tensor traceback on stderr, then a message blaming tracing and control flow.
    extra = ["--meta"] if meta else []
    err = _one_line_error("plan", f"{models_file}:wrong_shape", "--stages", 2, "-m", 2, *extra)
    assert "Net raised RuntimeError" in err
    assert "in module 'a' = Linear(in_features=16, out_features=32, bias=True) given input 8x12" in err
    assert "sample inputs: x 8x12" in err  # one microbatch (the factory's 8 rows): what is traced
    assert f"at {models_file}:{_line_of(models_file, 'return self.b(torch.relu')} in forward" in err
    assert "control flow" not in err
    assert capfd.readouterr().err == ""  # nothing from torch's loggers on the real stderr


def test_debug_shows_the_users_traceback(models_file):
    res = runner.invoke(app, ["--debug", "plan", f"{models_file}:broken", "--stages", "2"])
    assert isinstance(res.exception, UserCodeError)
    assert isinstance(res.exception.__cause__, RuntimeError)  # the user's own exception, with its frames


def test_a_model_that_runs_is_still_a_tracing_problem():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            h = self.lin(x)
            return h.nonzero() if h.sum() > 0 else h

    with pytest.raises(TraceError) as info:
        trace(DataDependent(), (torch.randn(2, 3),))
    assert not isinstance(info.value, UserCodeError) and "What to try" in str(info.value)


def test_trace_leaves_the_model_alone_when_it_raises():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(5, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserCodeError, match=r"in module '2' = Linear\(in_features=5.* given input 3x4"):
        trace(model, (torch.randn(3, 4),))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm stats restored


# ------------------------------------------------------------------ Hugging Face return_dict=False


def _tiny_gpt2(tf, **extra):
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                            use_cache=False, attn_implementation="eager", bos_token_id=None,
                                            eos_token_id=None, **extra))


def _tiny_t5(tf, **extra):
    return tf.T5ForConditionalGeneration(tf.T5Config(
        num_layers=1, num_decoder_layers=1, d_model=32, num_heads=2, d_kv=16, d_ff=64, vocab_size=64,
        use_cache=False, pad_token_id=0, decoder_start_token_id=0, attn_implementation="eager", **extra))


@pytest.mark.parametrize("make", [_tiny_gpt2, _tiny_t5])
def test_hugging_face_models_with_return_dict_false_in_their_config(make):
    # transformers 5 passed return_dict=False on to the inner models, whose tuples the heads cannot read:
    # "'tuple' object has no attribute 'last_hidden_state'", even when run eagerly.
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = make(tf, return_dict=False).eval()  # no dropout: outputs compare exactly
    ids = torch.randint(0, 64, (2, 8))
    kwargs = {"input_ids": ids} if make is _tiny_gpt2 else {"input_ids": ids, "decoder_input_ids": ids}
    gm = trace(model, (), kwargs)
    with torch.no_grad():
        got, want = gm(**kwargs), model(**kwargs)
    assert isinstance(want, tuple) and isinstance(got, tuple)  # what the config asks for
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    reference = make(tf).eval()  # the same weights returning a ModelOutput
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(reference(**kwargs).logits, want[0], rtol=0, atol=0)


# ------------------------------------------------------------------ a loss without a target


def test_step_without_a_target_uses_the_loss_of_the_output_alone():
    import smp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(6, 4)
    want = model(x).mean()
    pipe = smp.partition(model, stages=2, microbatches=3, loss_fn=lambda out, target: out.mean(),
                         timing="analytic")
    loss = pipe.step(x)  # was: RuntimeConfigError "step() needs the target of the batch"
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
