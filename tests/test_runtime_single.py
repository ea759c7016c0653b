"""The pipeline engine in one process (no process group): every stage runs here, through the same engine."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

import smp
from partitioner.trace import trace
from runtime.checkpoint import MissingStateError, merge_partial_states
from runtime.errors import RuntimeConfigError
from runtime.layout import ReplicaLayout
from runtime.split import split_program
from smp.models import build
from smp.partition import partition

from _runtime_common import check_against_reference, make_plan, pipeline_run, reference_run

STEPS = 5


@lru_cache(maxsize=None)
def _plan(spec: str, stages: int, microbatches: int, schedule: str) -> smp.Plan:
    return make_plan(spec, stages, microbatches, schedule)


def _run(spec: str, plan: smp.Plan, steps: int = STEPS) -> None:
    b = build(spec, seed=0)
    pipe = partition(b.model, plan=plan, loss_fn=b.loss_fn)
    got = pipeline_run(pipe, spec, steps)
    ref = reference_run(spec, plan.microbatches, steps)
    check_against_reference([got], ref, f"{spec} {plan.schedule_name}")


GPT = "gpt:size=tiny,batch=4"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_gpt_tied_head_matches_single_model(schedule: str) -> None:
    base = _plan(GPT, 2, 4, "1f1b")
    _run(GPT, base.resimulate(schedule=schedule))


def test_gpt_interleaved_matches_single_model() -> None:
    plan = _plan(GPT, 2, 4, "interleaved")
    assert plan.num_stages == 4
    _run(GPT, plan)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_unet_skips_across_stages(schedule: str) -> None:
    spec = "unet:size=tiny,batch=4"
    plan = _plan(spec, 3, 2, "1f1b").resimulate(schedule=schedule)
    long_skips = [e for e in plan.schedule.graph.edges if e.dst - e.src >= 2]
    assert long_skips, "the U-Net plan should have a skip connection across 2+ stages"
    _run(spec, plan)


def test_t5_cross_attention_edges() -> None:
    _run("t5:size=tiny,batch=4", _plan("t5:size=tiny,batch=4", 2, 2, "1f1b"))


def test_resnet_batchnorm_buffers_train_mode() -> None:
    spec = "resnet:size=tiny,batch=4"
    plan = _plan(spec, 2, 2, "1f1b")
    b = build(spec, seed=0)
    pipe = partition(b.model, plan=plan, loss_fn=b.loss_fn)
    got = pipeline_run(pipe, spec, 2)
    ref = reference_run(spec, 2, 2)
    check_against_reference([got], ref, "resnet")
    state = pipe.state_dict()
    for k, v in ref["state"].items():
        if "running" in k:
            assert torch.allclose(state[k], v, rtol=1e-5, atol=1e-6), k


@pytest.mark.parametrize("spec", ["hf-gpt2:size=tiny,batch=4",
                                  pytest.param("hf-t5:size=tiny,batch=4", marks=pytest.mark.slow)])
def test_hugging_face_models(spec: str) -> None:
    pytest.importorskip("transformers")
    _run(spec, _plan(spec, 2, 2, "1f1b"), steps=2)


def test_partial_states_merge_first_value_wins_in_the_given_order() -> None:
    """The one merge of the ranks' partial states (PipelinedModel.state_dict, SMP v1's model and optimizer)."""
    parts = [{"b": 1, "tied": "rank0"}, {"tied": "rank1", "a": 2, "extra": 3}]
    merged = merge_partial_states(parts, ["a", "tied", "b"])
    assert merged == {"a": 2, "tied": "rank0", "b": 1, "extra": 3}
    assert list(merged) == ["a", "tied", "b", "extra"]  # the given order, then others as first seen
    with pytest.raises(MissingStateError, match=r"no rank holds \['c', 'd'\] \(2 entries\)") as err:
        merge_partial_states(parts, ["a", "c", "b", "d"])
    assert err.value.missing == ["c", "d"]
    assert merge_partial_states(parts, ["a", "c"], require_all=False) == {"a": 2, "b": 1, "tied": "rank0", "extra": 3}


def test_forward_and_state_dict_round_trip() -> None:
    plan = _plan(GPT, 2, 4, "1f1b")
    b = build(GPT, seed=0)
    pipe = partition(b.model, plan=plan, loss_fn=b.loss_fn)
    pipeline_run(pipe, GPT, 2)
    fresh = build(GPT, seed=1).model  # other weights, same architecture
    fresh.load_state_dict(pipe.state_dict())
    with torch.no_grad():
        expected = fresh(*b.example_args)
    got = pipe(*b.example_args)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    # and back: a full state dict loads onto the stages
    other = build(GPT, seed=2)
    pipe2 = partition(other.model, plan=plan, loss_fn=b.loss_fn)
    pipe2(*b.example_args)
    pipe2.load_state_dict(pipe.state_dict())
    assert torch.allclose(pipe2(*b.example_args), expected, rtol=1e-5, atol=1e-6)


def test_timeline_has_every_compute_action() -> None:
    plan = _plan(GPT, 2, 4, "1f1b").resimulate(schedule="zb-h1")
    b = build(GPT, seed=0)
    pipe = partition(b.model, plan=plan, loss_fn=b.loss_fn)
    pipe.step(*b.example_args, target=b.target)
    tl = pipe.timeline()
    kinds = sorted((e.kind, e.stage, e.mb) for e in tl.events)
    expected = sorted((a.kind.value, a.stage, a.mb) for r in range(plan.pipeline_ranks)
                      for a in plan.schedule.compute_actions(r))
    assert kinds == expected
    assert tl.step_time > 0 and all(0 <= e.start <= e.end <= tl.step_time for e in tl.events)


def test_lazy_plan_in_one_process() -> None:
    b = build(GPT, seed=0)
    pipe = partition(b.model, stages=2, microbatches=2, loss_fn=b.loss_fn,
                     timing="analytic")
    assert pipe.plan is None
    loss = pipe.step(*b.example_args, target=b.target)
    assert pipe.plan is not None and pipe.plan.num_stages == 2
    ref = reference_run(GPT, 2, 1)
    assert torch.allclose(loss, ref["losses"][0], rtol=1e-5)


def test_other_batch_shape_is_rederived() -> None:
    plan = _plan(GPT, 2, 4, "1f1b")
    b = build(GPT, seed=0)
    pipe = partition(b.model, plan=plan, loss_fn=b.loss_fn)
    pipe.step(*b.example_args, target=b.target)
    short = b.example_args[0][:, :16]  # a shorter sequence: the cut shapes are derived again
    model = build(GPT, seed=3).model
    model.load_state_dict(pipe.state_dict())
    with torch.no_grad():
        assert torch.allclose(pipe(short), model(short), rtol=1e-5, atol=1e-6)
    loss = pipe.step(short, target=b.target[:, :16])
    assert torch.isfinite(loss)


def test_errors_before_any_work() -> None:
    plan = _plan(GPT, 2, 4, "1f1b")
    other = build("gpt:size=tiny,batch=4,layers=3", seed=0)
    with pytest.raises(RuntimeConfigError, match="another model"):
        partition(other.model, plan=plan, loss_fn=other.loss_fn).step(*other.example_args, target=other.target)
    b = build(GPT, seed=0)
    with pytest.raises(RuntimeConfigError, match="loss_fn"):
        partition(b.model, plan=plan).step(*b.example_args, target=b.target)
    with pytest.raises(RuntimeConfigError, match="not a multiple"):
        ReplicaLayout.replicas(3, plan.pipeline_ranks)
    assert ReplicaLayout.replicas(4, plan.pipeline_ranks) == 2  # two replicas of the 2-rank pipeline
    with pytest.raises(RuntimeConfigError, match="plan is for 3 replicas"):
        ReplicaLayout.replicas(4, plan.pipeline_ranks, planned_replicas=3)
    with pytest.raises(RuntimeConfigError, match="divide"):
        partition(b.model, plan=plan, loss_fn=b.loss_fn).step(b.example_args[0][:3], target=b.target[:3])


def test_split_keeps_only_stage_ops_and_names_cut_values() -> None:
    plan = _plan(GPT, 2, 4, "1f1b")
    b = build(GPT, seed=0)
    gm = trace(b.model, b.example_args)
    edges = [e.key for e in plan.schedule.graph.edges]
    prog = split_program(gm, plan.fx_stage_of, plan.num_stages, edges, [0, 1])
    for s, sp in prog.stages.items():
        ops = [n.name for n in sp.gm.graph.nodes if n.op.startswith("call")]
        assert all(plan.fx_stage_of[n] == s for n in ops)
    assert prog.stages[1].has_output and not prog.stages[0].has_output
    for key, values in prog.edge_values.items():
        assert values, f"edge {key} carries nothing"
        assert set(values) <= set(prog.stages[0].produces)


def test_eval_after_training_steps_uses_eval_behaviour() -> None:
    """A trace records train/eval (F.dropout(x, p, self.training)): each mode gets its own stages."""
    import torch.nn.functional as F
    from torch import nn

    class Dropping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            x = F.dropout(self.a(x), 0.5, self.training)
            return self.c(torch.tanh(self.b(x)))

    torch.manual_seed(0)
    model, x = Dropping(), torch.randn(8, 16)
    plan = smp.plan(model, (x,), stages=2, microbatches=2, timing="analytic")
    pipe = smp.partition(model, plan=plan, loss_fn=lambda out, target: F.mse_loss(out, target))
    pipe.step(x, target=torch.zeros(8, 4))
    pipe.eval()
    first, second = pipe(x), pipe(x)
    assert torch.equal(first, second)
    with torch.no_grad():
        assert torch.allclose(first, model(x), rtol=1e-5, atol=1e-6)
    pipe.train()
    assert pipe.step(x, target=torch.zeros(8, 4)).isfinite()


def test_in_place_activations_run_through_the_pipeline() -> None:
    import torch.nn.functional as F
    from torch import nn

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.act, self.b = nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)

        def forward(self, x):
            return self.b(F.relu(self.act(self.a(x)), inplace=True))

    torch.manual_seed(0)
    model, x, y = InPlace(), torch.randn(8, 8), torch.randn(8, 4)
    reference = InPlace()
    reference.load_state_dict(model.state_dict())
    plan = smp.plan(model, (x,), stages=2, microbatches=2, timing="analytic")
    pipe = smp.partition(model, plan=plan, loss_fn=F.mse_loss)
    loss = pipe.step(x, target=y)
    expected = torch.stack([F.mse_loss(reference(xs), ys) for xs, ys in zip(x.chunk(2), y.chunk(2))]).mean()
    assert torch.allclose(loss, expected, rtol=1e-5)
