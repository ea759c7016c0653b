"""smp.plan and the Plan artifact: end to end, JSON round-trip, re-timing, clear errors."""

import json

import pytest
import torch

import smp
from partitioner import trace
from partitioner.microbatch import MicrobatchError, split_microbatches
from partitioner.walk import validate
from partitioner.program import fingerprint
from smp.models import build
from smp.plan import PLAN_SCHEMA_VERSION, PlanError


@pytest.fixture(scope="module")
def gpt():
    return build("gpt:size=tiny,batch=4")


def _plan(bundle, **kw):
    kw.setdefault("stages", 2)
    kw.setdefault("microbatches", 2)
    return smp.plan(bundle.model, bundle.example_args, bundle.example_kwargs, timing="analytic",
                    device_profile="cpu", **kw)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_plan_end_to_end(gpt, schedule):
    plan = _plan(gpt, schedule=schedule, name="gpt-tiny")
    v = 2 if schedule == "interleaved" else 1
    assert plan.num_ranks == 2 and plan.num_stages == 2 * v
    assert plan.schedule.num_ranks == 2
    validate(plan.schedule)
    gm = trace(gpt.model, gpt.example_args)
    calls = {n.name for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")}
    assert set(plan.fx_stage_of) == calls | {"output"}  # every op of the program, and its output, has a stage
    assert set(plan.fx_stage_of.values()) == set(range(plan.num_stages))
    assert plan.model.fingerprint == fingerprint(gm, gpt.model)
    assert plan.step_time > 0 and 0 <= plan.bubble < 1
    # the simulator's step can't beat the bottleneck stage doing every microbatch
    assert plan.step_time >= plan.microbatches * max(s.fwd + s.bwd for s in plan.partition.stages) * (1 - 1e-9)
    assert plan.speedup > 0
    text = plan.summary()
    assert "predicted step" in text and "lower bound" in text and "stage" in text


def test_plan_json_round_trip(gpt, tmp_path):
    plan = _plan(gpt, schedule="1f1b")
    path = plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["kind"] == "smp.Plan" and data["schema"] == PLAN_SCHEMA_VERSION and data["smp_version"] == smp.__version__
    again = smp.Plan.load(path)
    assert again.to_dict() == plan.to_dict()
    assert again.timeline().step_time == pytest.approx(plan.step_time)


def test_plan_load_errors(gpt, tmp_path):
    plan = _plan(gpt)
    with pytest.raises(PlanError, match="no plan file"):
        smp.Plan.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "smp.Plan", "schema": 1, ')
    with pytest.raises(PlanError, match="not a valid plan file"):
        smp.Plan.load(bad)
    newer = plan.to_dict() | {"schema": 99}
    bad.write_text(json.dumps(newer))
    with pytest.raises(PlanError, match="newer|schema 99"):
        smp.Plan.load(bad)
    damaged = plan.to_dict()
    del damaged["partition"]
    bad.write_text(json.dumps(damaged))
    with pytest.raises(PlanError, match="damaged"):
        smp.Plan.load(bad)
    bad.write_text(json.dumps({"kind": "smp.OpGraph"}))
    with pytest.raises(PlanError, match="not an smp plan"):
        smp.Plan.load(bad)


def test_resimulate_under_other_schedule_and_microbatches(gpt):
    plan = _plan(gpt, schedule="gpipe", microbatches=2)
    again = plan.resimulate(schedule="1f1b", microbatches=4)
    assert again.schedule_name == "1f1b" and again.microbatches == 4
    assert again.partition.stage_of == plan.partition.stage_of
    # twice the microbatches of half the size: each op costs half as much
    assert again.graph.total_fwd == pytest.approx(plan.graph.total_fwd / 2)
    validate(again.schedule)
    with pytest.raises(PlanError, match="interleav"):
        plan.resimulate(schedule="interleaved")


def test_plan_errors(gpt):
    with pytest.raises(PlanError, match="unknown schedule"):
        _plan(gpt, schedule="2f2b")
    with pytest.raises(PlanError, match="fewer than the"):
        _plan(gpt, stages=500)
    with pytest.raises(MicrobatchError, match="does not divide"):
        _plan(gpt, microbatches=3)


def test_split_microbatches_slices_only_batched_tensors():
    x = torch.arange(12).reshape(6, 2)
    mask = torch.ones(3)  # not batched: shared by every microbatch
    pieces = split_microbatches((x,), {"mask": mask, "flag": True}, 3)
    assert len(pieces) == 3
    for i, (args, kwargs) in enumerate(pieces):
        assert torch.equal(args[0], x[2 * i: 2 * i + 2])
        assert kwargs["mask"] is mask and kwargs["flag"] is True
    with pytest.raises(MicrobatchError, match="does not divide"):
        split_microbatches((x,), {}, 4)
    with pytest.raises(MicrobatchError, match="no tensor input"):
        split_microbatches((3,), {}, 2)


def test_fingerprint_is_stable_and_tells_models_apart(gpt):
    a = fingerprint(trace(gpt.model, gpt.example_args), gpt.model)
    again = build("gpt:size=tiny,batch=4")
    assert fingerprint(trace(again.model, again.example_args), again.model) == a
    other = build("gpt:size=tiny,batch=4,layers=3")
    assert fingerprint(trace(other.model, other.example_args), other.model) != a


def test_resimulate_on_another_cluster_does_not_claim_the_old_proof(gpt):
    from partitioner import Cluster

    slow = smp.plan(gpt.model, gpt.example_args, stages=2, microbatches=2, timing="analytic",
                    device_profile="cpu", cluster=Cluster.uniform(2, bandwidth=1e6, latency=1e-3))
    assert slow.partition.optimal
    free = slow.resimulate(cluster=Cluster.free(2))
    assert not free.partition.optimal
    assert free.partition.lower_bound <= free.partition.bottleneck
    interleaved = _plan(gpt, schedule="interleaved")
    again = interleaved.resimulate(cluster=Cluster.uniform(2, bandwidth=1e9))
    assert again.num_stages == 4 and again.num_ranks == 2


def test_resimulate_refuses_microbatch_counts_the_batch_cannot_take(gpt):
    plan = _plan(gpt)  # batch 4 in 2 microbatches
    with pytest.raises(PlanError, match="does not split"):
        plan.resimulate(microbatches=3)
    with pytest.raises(PlanError, match=">= 1"):
        plan.resimulate(microbatches=0)
    assert plan.resimulate(microbatches=4).microbatches == 4


def test_colocate_tied_keeps_readers_of_a_shared_weight_together(gpt):
    from torch import nn

    from partitioner import ColocationError

    class Shared(nn.Module):
        """Layers 2 and 3 share one weight (ALBERT-style); layers 1 and 4 are their own."""

        def __init__(self):
            super().__init__()
            self.l1, self.l2, self.l3, self.l4 = (nn.Linear(32, 32) for _ in range(4))
            self.l3.weight = self.l2.weight

        def forward(self, x):
            return self.l4(self.l3(self.l2(self.l1(x).relu()).relu()).relu())

    model, x = Shared(), torch.randn(4, 32)
    plan = smp.plan(model, (x,), stages=3, microbatches=2, timing="analytic", colocate_tied=True)
    assert plan.fx_stage_of["l2"] == plan.fx_stage_of["l3"]
    # GPT's embedding and LM head hold everything between them on one stage; only the
    # position branch, which does not depend on the tokens, can go to another stage.
    tied = _plan(gpt, stages=2, colocate_tied=True)
    assert tied.fx_stage_of["tok_emb"] == tied.fx_stage_of["lm_head"] == 1
    stage0 = {n for n, s in tied.fx_stage_of.items() if s == 0}
    assert stage0 and all(not n.startswith(("blocks", "tok_emb", "lm_head")) for n in stage0), stage0
    with pytest.raises(ColocationError, match="tok_emb"):  # 4 blocks: size, narrow, pos_emb and the rest
        _plan(gpt, stages=5, colocate_tied=True)


def test_a_tied_weight_is_held_once_by_a_stage_reading_it_twice(gpt):
    """Was: the embedding and the LM head on one stage counted the tied matrix twice (the one-rank run of
    benchmarks/large_model.py: predicted 2,717 MiB, held 2,201 MiB)."""
    unique = sum(p.numel() * p.element_size() for p in gpt.model.parameters())
    tied = gpt.model.lm_head.weight.numel() * gpt.model.lm_head.weight.element_size()
    one = _plan(gpt, stages=1)
    assert one.partition.stages[0].params == unique
    two = _plan(gpt, stages=2, colocate_tied=True)  # both readers on stage 1
    assert sum(st.params for st in two.partition.stages) == unique
    apart = _plan(gpt, stages=2)  # the embedding on stage 0, the head on stage 1: both hold it
    assert apart.fx_stage_of["tok_emb"] != apart.fx_stage_of["lm_head"]
    assert sum(st.params for st in apart.partition.stages) == unique + tied
    factor = one.partition.state_factor
    activations = one.partition.stages[0].in_flight * one.partition.stages[0].activations
    assert one.partition.stages[0].memory == pytest.approx(unique * factor + one.partition.stages[0].buffers + activations,
                                                          rel=1e-9)


def test_a_plan_with_a_damaged_section_says_so(gpt, tmp_path):
    data = _plan(gpt).to_dict()
    data["schedule"] = []
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="damaged"):
        smp.Plan.load(bad)
