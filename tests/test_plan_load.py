"""Loading saved plans: a plan of the previous schema still runs; a hand-edited assignment is refused at load."""

import json
from pathlib import Path

import pytest

import smp
from partitioner.cost import evaluate
from partitioner.errors import InvalidAssignmentError
from smp.models import build
from smp.plan import PlanError

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def gpt():
    return build("gpt:size=tiny,batch=4")


def test_a_plan_saved_by_the_previous_version_loads_and_trains(gpt):
    # Written by smp at 3ea4ac6 (schema 1, before #10 typed the plan) for gpt:size=tiny,batch=4,
    # 2 stages, 1f1b, 2 microbatches, analytic timing on the cpu profile.
    plan = smp.Plan.load(DATA / "plan_schema1_gpt_tiny_1f1b.json")
    assert plan.schema == 1 and plan.model.class_name == "smp.models.gpt.GPT"
    assert (plan.num_stages, plan.pipeline_ranks, plan.microbatches, plan.schedule_name) == (2, 2, 2, "1f1b")
    pipe = smp.partition(gpt.model, plan=plan, loss_fn=gpt.loss_fn)
    loss = pipe.step(*gpt.example_args, target=gpt.target, **gpt.example_kwargs)
    assert loss.isfinite() and loss.item() > 0
    assert all(p.grad is not None for p in pipe.parameters())


def _moved_one_op(data: dict) -> tuple[str, dict]:
    """A copy of the plan with one op of stage 0 moved to stage 1 in stage_of alone (still a valid pipeline)."""
    graph = smp.Plan.from_dict(data).graph
    stage_of = data["partition"]["stage_of"]
    for op in reversed(data["partition"]["stages"][0]["ops"]):
        edited = dict(stage_of, **{op: 1})
        try:
            evaluate(graph, edited, stages=2)
        except InvalidAssignmentError:  # this move is not a pipeline: try the op before it
            continue
        data = json.loads(json.dumps(data))
        data["partition"]["stage_of"] = edited
        return op, data
    raise AssertionError("no op of stage 0 can move to stage 1")


@pytest.fixture(scope="module")
def edited(gpt):
    """(the op moved, the plan's JSON with stage_of edited by hand)."""
    plan = smp.plan(gpt.model, gpt.example_args, gpt.example_kwargs, stages=2, microbatches=2, timing="analytic",
                    device_profile="cpu")
    return _moved_one_op(plan.to_dict())


def test_a_hand_edited_assignment_that_disagrees_with_the_stage_table_is_refused(edited, tmp_path):
    op, data = edited
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as err:
        smp.Plan.load(path)
    msg = str(err.value)
    # Was: loaded, showed the stale stage table, and step() failed with "no edge ... re-plan".
    assert "stage_of" in msg and op in msg and "smp plan" in msg
    assert len(msg.splitlines()) == 1


def test_an_assignment_edited_with_its_stage_table_but_not_its_cut_tensors_is_refused(edited):
    op, data = edited
    data = json.loads(json.dumps(data))
    stages = data["partition"]["stages"]
    stages[0]["ops"].remove(op)
    stages[1]["ops"].append(op)
    with pytest.raises(PlanError, match=r"its cut tensors are not what its stage_of makes .*`smp plan`"):
        smp.Plan.from_dict(data)
