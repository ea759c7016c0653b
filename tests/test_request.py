"""The typed planning request: one place for each option's default and bounds, checked when it is built."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import smp
from partitioner.request import PlanRequest, Profiling, default_microbatches
from partitioner.plan import PlanError
from smp.partition import RuntimeConfigError


def test_default_microbatches_is_one_rule():
    assert default_microbatches(1, 64) == 1  # one rank: nothing to overlap
    assert default_microbatches(4, 64) == 8  # 2 x ranks when it divides the batch
    assert default_microbatches(4, 12) == 6  # else the largest divisor not above 2 x ranks
    assert default_microbatches(4, 7) == 7
    assert default_microbatches(3, 5) == 5
    assert default_microbatches(4, 1) == 1
    assert default_microbatches(4, None) == 8  # a batch built to fit the count (a zoo spec in the CLI)
    assert PlanRequest(stages=4).microbatches_for(12) == 6
    assert PlanRequest(stages=4, microbatches=3).microbatches_for(12) == 3


@pytest.mark.parametrize("options, match", [
    ({"stages": 0}, "stages must be a whole number >= 1"),
    ({"stages": 2.5}, "stages must be a whole number"),
    ({"microbatches": 0}, "microbatches must be a whole number >= 1"),
    ({"microbatches": "many"}, "a count, a list of counts or 'auto'"),
    ({"microbatches": [4, 0]}, "each microbatch count must be a whole number >= 1"),
    ({"schedule": "2f2b"}, "unknown schedule '2f2b'"),
    ({"recompute": "some"}, "unknown recompute 'some'"),
    ({"method": "magic"}, "unknown method 'magic'"),
    ({"objective": "speed"}, "unknown objective 'speed'"),
    ({"placement": "random"}, "unknown placement 'random'"),
    ({"memory_limit": -1}, "memory_limit must be more than 0 bytes"),
    ({"time_limit": 0}, "time_limit must be more than 0 seconds"),
    ({"data_parallel": 0}, "data_parallel must be a whole number >= 1"),
    ({"schedule": "zb-h1", "active_microbatches": 2}, "active_microbatches caps the warm-up of gpipe and 1f1b"),
    ({"devices": 8, "data_parallel": 2}, "devices= searches the data-parallel degree itself"),
    ({"devices": 8, "stages": 3}, "3 stages do not divide 8 devices"),
    ({"global_batch": 64}, "global_batch= goes with devices="),
    ({"microbatches": "auto"}, "a microbatch or schedule search is for a pipeline of stages= ranks"),
    ({"devices": 8, "active_microbatches": 2}, "a search weighs schedules and microbatch counts as they are"),
    ({"timing": "guessed"}, "unknown timing 'guessed'"),
    ({"repeats": 0}, "repeats must be a whole number >= 1"),
])
def test_bad_options_are_refused_when_the_request_is_built(options, match):
    with pytest.raises(PlanError, match=match):
        PlanRequest.build(**options)


def test_a_misspelt_option_names_the_nearest():
    with pytest.raises(PlanError, match=r"unknown planning option stage \(did you mean stages\?\)"):
        PlanRequest.build(stage=4)
    with pytest.raises(PlanError, match="unknown planning option"):
        smp.plan(nn.Linear(2, 2), torch.randn(4, 2), stages=1, microbatch=2)


def test_build_sorts_profiling_options_and_changes_keep_the_checks():
    request = PlanRequest.build(stages=2, timing="analytic", dtype="bf16", leaf_modules=[nn.Linear])
    assert request.profiling == Profiling(timing="analytic", dtype="bf16", leaf_modules=(nn.Linear,))
    assert request.with_(stages=4).profiling == request.profiling
    with pytest.raises(PlanError, match="stages must be"):
        request.with_(stages=-1)


def test_searching_schedules_and_counts_are_normalised():
    assert not PlanRequest(stages=4, schedule="1F1B").searching
    assert PlanRequest(stages=4, schedule="1F1B").schedule == "1f1b"
    search = PlanRequest(stages=4, schedule="auto", microbatches=[4, 8])
    assert search.searching and search.microbatch_counts == (4, 8)
    assert set(search.schedules) == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert PlanRequest(devices=8).searching and PlanRequest(devices=8).microbatch_counts is None
    assert PlanRequest(stages=2, schedule="interleaved", virtual_stages=3).stages_per_rank == 3
    assert PlanRequest(stages=2, schedule="gpipe", virtual_stages=3).stages_per_rank == 1


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_smp_plan_and_the_runtime_take_the_same_default_count():
    x = torch.randn(12, 4)
    made = smp.plan(_Two(), x, stages=2, timing="analytic")
    assert made.microbatches == default_microbatches(2, 12) == 4
    pipe = smp.partition(_Two(), stages=2, timing="analytic", loss_fn=lambda out, _: out.sum())
    pipe.step(x)
    assert pipe.plan.microbatches == made.microbatches


def test_a_made_plan_refuses_options_that_disagree_or_only_shape_a_new_plan():
    x = torch.randn(8, 4)
    made = smp.plan(_Two(), x, stages=2, microbatches=2, timing="analytic")
    smp.partition(_Two(), plan=made, stages=2, microbatches=2, schedule="1f1b", placement="cluster")
    with pytest.raises(RuntimeConfigError, match="microbatches=4 disagrees with the plan's 2"):
        smp.partition(_Two(), plan=made, microbatches=4)
    with pytest.raises(RuntimeConfigError, match="stages=3 disagrees with the plan's 2"):
        smp.partition(_Two(), plan=made, stages=3)
    with pytest.raises(RuntimeConfigError, match="cluster only shape a new plan"):
        smp.partition(_Two(), plan=made, cluster="h100-sxm")
    with pytest.raises(RuntimeConfigError, match="schedule='gpipe' disagrees"):
        smp.partition(_Two(), plan=made, request=PlanRequest(schedule="gpipe"))
    with pytest.raises(RuntimeConfigError, match="smp.partition runs one pipeline shape"):
        smp.partition(_Two(), devices=4)


def test_a_step_without_a_loss_is_refused_before_any_planning():
    pipe = smp.partition(_Two(), stages=1, timing="analytic")
    with pytest.raises(RuntimeConfigError, match="step\\(\\) trains and needs a loss"):
        pipe.step(torch.randn(4, 4))
    assert pipe.plan is None


def test_none_leaves_an_option_to_the_plan_and_data_parallel_must_match_the_world():
    made = smp.plan(_Two(), torch.randn(8, 4), stages=2, microbatches=2, timing="analytic")
    smp.partition(_Two(), plan=made, stages=None, microbatches=None)
    with pytest.raises(RuntimeConfigError, match="data_parallel=2 disagrees with the world"):
        smp.partition(_Two(), stages=1, data_parallel=2)
    with pytest.raises(RuntimeConfigError, match="smp.partition trains"):
        smp.partition(_Two(), training=False)


def test_the_train_worker_runs_a_plan_of_another_schedule(tmp_path, capsys):
    from smp.cli import train_worker
    from smp.models import build_step

    bundle = build_step("mlp:size=tiny", microbatches=2)
    made = smp.plan(bundle.model, bundle.example_args, bundle.example_kwargs, stages=2, microbatches=2,
                    schedule="gpipe", timing="analytic")
    path = made.save(tmp_path / "gpipe.json")
    job = {"spec": "mlp:size=tiny", "microbatches": 2, "schedule": "1f1b", "batch_size": None, "seq_len": None,
           "device": "cpu", "plan": str(path), "lr": 1e-3, "steps": 1}
    assert train_worker._train(job) == 0
    assert '"event": "summary"' in capsys.readouterr().out


def test_prepared_on_held_microbatches_the_trace_is_the_first_one():
    from runtime.batch import Microbatches

    x = torch.randn(8, 4)
    made = smp.plan(_Two(), x, stages=2, microbatches=2, timing="analytic")
    pipe = smp.partition(_Two(), plan=made, loss_fn=lambda out, _: out.sum())
    micro = Microbatches.cut((x,), {}, 2)
    pipe.prepare_microbatches(micro)
    assert pipe.step_microbatches(micro).shape == ()
    outputs = pipe.forward_microbatches(micro)
    assert len(outputs) == 2 and outputs[0].shape == (4, 2)
    with pytest.raises(RuntimeConfigError, match="3 microbatches given, and the plan runs 2"):
        pipe.step_microbatches(Microbatches.cut((torch.randn(9, 4),), {}, 3))
    with pytest.raises(RuntimeConfigError, match="partitions by a plan made already"):
        smp.partition(_Two(), stages=2).prepare_microbatches(micro)


def test_sharding_is_named_checked_and_carried_by_the_plan():
    from partitioner.plan import Plan

    with pytest.raises(PlanError, match="unknown sharding 'zero3'"):
        PlanRequest(sharding="zero3")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    made = smp.plan(model, torch.randn(8, 4), stages=2, data_parallel=2, sharding="full_shard", microbatches=2,
                    timing="analytic")
    assert made.sharding == Plan.from_dict(made.to_dict()).sharding == "full_shard"
    with pytest.raises(PlanError, match="data_parallel=1"):
        smp.plan(model, torch.randn(8, 4), stages=2, sharding="shard_grad_op", microbatches=2, timing="analytic")


def test_a_made_plan_and_a_sharding_that_disagrees_with_it_are_refused():
    from smp.plan_options import check_agrees, given_options

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    made = smp.plan(model, torch.randn(8, 4), stages=2, data_parallel=2, sharding="shard_grad_op", microbatches=2,
                    timing="analytic")
    for agreeing in ("auto", "shard_grad_op"):
        request = PlanRequest(sharding=agreeing)
        check_agrees(made, request, given_options(request, {}))
    request = PlanRequest(sharding="none")
    with pytest.raises(RuntimeConfigError, match="sharding='none' disagrees with the plan's 'shard_grad_op'"):
        check_agrees(made, request, given_options(request, {"sharding": "none"}))


def test_an_option_error_respells_its_options_not_the_same_words_in_its_prose() -> None:
    from partitioner.errors import OptionError

    err = OptionError("stages must divide devices= (4 stages on 6 devices); drop stages= or devices=",
                      "stages", "devices")
    flags = err.spelled(lambda name: f"--{name}")
    assert flags == "--stages must divide --devices (4 stages on 6 devices); drop --stages or --devices"


def test_a_plan_file_with_a_fractional_tensor_parallel_degree_is_refused(tmp_path) -> None:
    import json

    built = smp.models.build("gpt:size=tiny,batch=4")
    plan = smp.plan(built.model, built.example_args, stages=2, timing="analytic")
    data = plan.to_dict()
    data.setdefault("replicas", {})["tensor_parallel"] = 2.5
    with pytest.raises(PlanError, match="tensor_parallel is 2.5"):
        smp.Plan.from_dict(json.loads(json.dumps(data)))
