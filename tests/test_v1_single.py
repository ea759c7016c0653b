"""smp.v1 in one process (every partition here, through the same engine): steps, outputs, manual partitions,
state dicts, checkpoints, GradScaler, memory and the errors v1 users met."""

from __future__ import annotations

import copy
from pathlib import Path

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smp.v1 as smp
from partitioner.compile import plan_from_graph
from partitioner.graph import OpGraph
from partitioner.request import PlanRequest
from smp.v1 import planning
from smp.v1.step import split_arguments

TOL = dict(rtol=1e-5, atol=1e-6)


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 8, 3)

    def forward(self, x):
        return torch.flatten(F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2), 1)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8 * 5 * 5, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), 1)


class TwoPart(nn.Module):
    """v1's two-module CNN, small: 1x14x14 images; ``first``/``second`` say where a manual split puts each half."""

    def __init__(self, first: int | None = None, second: int | None = None) -> None:
        super().__init__()
        with smp.partition(first) if first is not None else _nothing():
            self.convs = Convs()
        with smp.partition(second) if second is not None else _nothing():
            self.head = Head()

    def forward(self, x):
        return self.head(self.convs(x))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def data(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 14, 14, generator=g), torch.randint(0, 10, (n,), generator=g)


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target)
    model.backward(loss)
    return output, loss


@smp.step
def eval_step(model, data, target):
    output = model(data)
    return F.nll_loss(output, target, reduction="sum").item(), output.argmax(1).eq(target).sum().item()


def wrapped(config: dict | None = None, seed: int = 0, **parts: int) -> tuple[smp.DistributedModel, nn.Module]:
    """smp.init(config), a TwoPart model wrapped, and an identical plain copy."""
    smp.init({"partitions": 2, "microbatches": 4, **(config or {})})
    torch.manual_seed(seed)
    model = TwoPart(**parts)
    reference = TwoPart()
    reference.load_state_dict(model.state_dict())
    return smp.DistributedModel(model), reference


def test_training_and_outputs_match_plain_pytorch() -> None:
    model, ref = wrapped()
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    x, y = data()
    for _ in range(3):
        opt.zero_grad()
        outputs, losses = train_step(model, x, y)
        opt.step()
        ref_opt.zero_grad()
        ref_out = ref(x)
        ref_loss = F.nll_loss(ref_out, y)
        ref_loss.backward()
        ref_opt.step()
        assert isinstance(losses, smp.StepOutput) and len(losses.outputs) == 4
        torch.testing.assert_close(losses.reduce_mean(), ref_loss.detach(), **TOL)
        torch.testing.assert_close(losses.reduce_sum(), 4 * ref_loss.detach(), **TOL)
        torch.testing.assert_close(losses.stack().shape, torch.Size([4]))
        torch.testing.assert_close(outputs.concat(), ref_out.detach(), **TOL)
        assert not outputs.concat().requires_grad
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=name)
    model.eval()
    ref.eval()
    with torch.no_grad():
        loss_mb, correct_mb = eval_step(model, x, y)  # Python numbers come back as lists, one per microbatch
        ref_out = ref(x)
    assert isinstance(loss_mb, list) and len(loss_mb) == 4
    assert sum(loss_mb) == pytest.approx(F.nll_loss(ref_out, y, reduction="sum").item(), rel=1e-5)
    assert sum(correct_mb) == ref_out.argmax(1).eq(y).sum().item()
    assert model.pipe.plan.num_ranks == 2


def test_arguments_split_like_v1() -> None:
    import inspect

    class Sliced:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def smp_slice(self, num_mb: int, mb: int, axis: int) -> Sliced:
            return Sliced(self.t.chunk(num_mb, axis)[mb])

    def fn(model, batch, mask, seq_first, custom, scale=1.0):
        return None

    batch = {"x": torch.arange(8).reshape(8, 1), "ys": [torch.arange(8)]}
    mask = torch.ones(3, 3)
    seq = torch.arange(16).reshape(2, 8)
    pieces = split_arguments(inspect.signature(fn), ("m", batch, mask, seq, Sliced(torch.arange(8))), {"scale": 2.0},
                             4, non_split=("mask",), axes={"seq_first": 1})
    assert len(pieces) == 4
    args, kwargs = pieces[2]
    assert args[0] == "m" and args[5] == 2.0 and not kwargs
    assert args[1]["x"].flatten().tolist() == [4, 5] and args[1]["ys"][0].tolist() == [4, 5]
    assert args[2] is mask and args[3].tolist() == [[4, 5], [12, 13]] and args[4].t.tolist() == [4, 5]
    with pytest.raises(smp.V1Error, match="'batch' .* size 6 along axis 0.*4 microbatches"):
        split_arguments(inspect.signature(fn), ("m", torch.zeros(6), mask, seq, None), {}, 4)
    with pytest.raises(smp.V1Error, match="does not have"):
        smp.step(non_split_inputs=["nope"])(fn)


def test_step_function_mistakes_are_named() -> None:
    model, _ = wrapped()
    x, y = data()

    @smp.step
    def twice(model, data):
        return model(data) + model(data)

    @smp.step
    def no_model(model, data):
        return data.sum()

    with pytest.raises(smp.V1Error, match="returned without calling the DistributedModel"):
        no_model(model, x)
    with pytest.raises(smp.V1Error, match="twice"):
        twice(model, x)
    with pytest.raises(smp.V1Error, match="backward.*no_grad"), torch.no_grad():
        train_step(model, x, y)
    with pytest.raises(smp.V1Error, match="inside an smp.step"):
        model(x)
    with pytest.raises(smp.V1Error, match="one model"):
        smp.DistributedModel(TwoPart())


def test_a_decorated_method_is_a_step() -> None:
    class Trainer:
        scale = 2.0

        @smp.step
        def step(self, model, data, target):
            loss = F.nll_loss(model(data), target) * self.scale
            model.backward(loss)
            return loss

    model, ref = wrapped()
    x, y = data()
    losses = Trainer().step(model, x, y)
    torch.testing.assert_close(losses.reduce_mean(), 2.0 * F.nll_loss(ref(x), y).detach(), **TOL)


def test_a_step_without_backward_trains_nothing_and_says_so() -> None:
    model, _ = wrapped()
    x, y = data()
    before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    with pytest.warns(UserWarning, match="did not call model.backward"):
        losses, _ = eval_step(model, x, y)  # gradients enabled, as an evaluation loop without no_grad
    assert len(losses) == 4
    for n, p in model.module.named_parameters():
        assert p.grad is None or not p.grad.any(), n
        assert torch.equal(p, before[n])


def test_manual_partitions_follow_smp_partition_blocks() -> None:
    model, ref = wrapped({"auto_partition": False, "default_partition": 0}, second=1)  # convs: the default
    x, y = data()
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        _, losses = train_step(model, x, y)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = F.nll_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(losses.reduce_mean(), ref_loss.detach(), **TOL)
    plan = model.pipe.plan
    modules = {plan.graph[n]["module"]: s for n, s in plan.partition.stage_of.items() if n != "output"}
    assert {m: s for m, s in modules.items() if m.startswith("convs")} == {m: 0 for m in modules if
                                                                        m.startswith("convs")}
    assert {s for m, s in modules.items() if m.startswith("head")} == {1}
    assert plan.partition.method == "manual (smp.partition)"


def test_manual_partitions_that_cannot_pipeline_are_refused() -> None:
    model, _ = wrapped({"auto_partition": False}, first=1, second=0)
    x, y = data()
    with pytest.raises(smp.V1Error, match="module 'convs.*' on partition 1 feeds .*'head.*' on partition 0"):
        train_step(model, x, y)
    model, _ = wrapped({"auto_partition": False}, first=0, second=0)
    with pytest.raises(smp.V1Error, match="partition 1 would run no op"):
        train_step(model, x, y)
    with pytest.raises(smp.V1Error, match="there are 2 partitions"):
        with smp.partition(2):
            pass


def test_memory_weight_caps_the_largest_stage() -> None:
    """Two compute-heavy ops without weights, then two cheap ops with big weights: the fastest 2-stage plan puts both
    weights on one stage; memory_weight=1 asks for the least memory any plan needs, which splits them."""
    g = nx.DiGraph()
    for i, (name, fwd, params) in enumerate([("c1", 10e-3, 0), ("c2", 10e-3, 0), ("p1", 1e-3, 100e6),
                                             ("p2", 1e-3, 100e6)]):
        g.add_node(name, fwd=fwd, bwd=2 * fwd, bwd_w=fwd, params=params, out_bytes=1000, module=name, index=i)
    g.add_edges_from([("c1", "c2"), ("c2", "p1"), ("p1", "p2")])
    request = PlanRequest(stages=2, microbatches=4)
    fast = plan_from_graph(OpGraph(g), request)
    assert fast.partition.stage_of["p1"] == fast.partition.stage_of["p2"]
    assert planning.weigh_memory(fast, request, None) is fast and planning.weigh_memory(fast, request, 0.0) is fast
    for weight in (0.5, 1.0):
        lean = planning.weigh_memory(fast, request, weight)
        assert lean.partition.stage_of["p1"] != lean.partition.stage_of["p2"]
        assert max(lean.stage_memory) < max(fast.stage_memory)
        assert any(f"memory_weight={weight:g}" in note for note in lean.partition.notes)


def test_partitions_that_do_not_fit_name_the_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = wrapped()
    x, y = data()
    monkeypatch.setattr(planning, "device_memory", lambda device: (1000, 4000))
    with pytest.raises(smp.V1Error, match=r"partition 0 \(convs.*\): about .* partition 1 \(.*head.*\).*needs "
                                          r"about .* but cpu has 1000 B free of 3.91 KiB"):
        train_step(model, x, y)
    monkeypatch.setattr(planning, "device_memory", lambda device: None)

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    from smp.partition import PipelinedModel

    monkeypatch.setattr(PipelinedModel, "prepare_microbatches", out_of_memory)
    with pytest.raises(smp.V1Error, match=r"rank 0 ran out of memory on cpu placing its partition. The plan "
                                          r"expected .* partition 0 \(convs.*\): about"):
        train_step(model, x, y)


def test_modules_whose_output_is_unused_are_named_and_get_no_gradient() -> None:
    class WithAux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.aux = nn.Linear(8, 8)
            self.b = nn.Linear(8, 4)

        def forward(self, x):
            h = torch.relu(self.a(x))
            self.aux(h)  # computed, never used: v1 hung here
            return self.b(h)

    smp.init({"partitions": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = smp.DistributedModel(WithAux())

    @smp.step
    def step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    with pytest.warns(UserWarning, match="module aux never reach"):
        step(model, torch.randn(4, 8), torch.randn(4, 4))
    assert model.module.aux.weight.grad is None and model.module.b.weight.grad is not None


def test_state_dicts_and_checkpoints_round_trip(tmp_path: Path) -> None:
    model, _ = wrapped()
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    x, y = data()
    train_step(model, x, y)
    opt.step()
    full = copy.deepcopy(model.state_dict())  # like torch's, its tensors share the live ones' storage in one process
    assert list(full) == list(model.module.state_dict())
    local = model.local_state_dict()
    assert local.pop("_smp_is_partial") is True and set(local) == set(full)
    opt_local = opt.local_state_dict()
    assert opt_local["_smp_is_partial"] is True and len(opt_local["state"]) == len(list(model.parameters()))
    smp.save({"model": model.local_state_dict(), "opt": opt.local_state_dict()}, tmp_path / "ckpt.pt", partial=True)
    smp.save(full, tmp_path / "full.pt", partial=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt_0", "full.pt"]
    saved_opt = copy.deepcopy(opt.state_dict())
    for _ in range(2):  # move away
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
    ckpt = smp.load(tmp_path / "ckpt.pt", partial=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, full[k], rtol=0, atol=0, msg=k)
    for i, s in opt.state_dict()["state"].items():
        torch.testing.assert_close(s["exp_avg"], saved_opt["state"][i]["exp_avg"], rtol=0, atol=0)
    with pytest.raises(smp.V1Error, match="no file .*nope.pt_0"):
        smp.load(tmp_path / "nope.pt")


def test_a_checkpoint_loaded_before_partitioning_applies(tmp_path: Path) -> None:
    model, _ = wrapped(seed=0)
    train_step(model, *data())
    smp.save(model.local_state_dict(), tmp_path / "m.pt")
    expected = copy.deepcopy(model.state_dict())
    fresh, _ = wrapped(seed=1)  # other weights; partitioned only at its first step
    fresh.load_state_dict(smp.load(tmp_path / "m.pt"))
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0, msg=k)


def test_a_model_built_without_weights_trains_with_the_optimizer_made_before() -> None:
    smp.init({"partitions": 2, "microbatches": 2})
    with smp.delay_param_initialization():
        model = TwoPart()
    assert all(p.is_meta for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # over the placeholders, as the script was written
    model = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(opt)
    x, y = data(8)
    opt.zero_grad()
    train_step(model, x, y)
    opt.step()
    params = [p for g in opt.param_groups for p in g["params"]]
    assert all(not p.is_meta for p in params) and {id(p) for p in params} == {id(p) for p in model.parameters()}
    before = [p.detach().clone() for p in params]
    opt.zero_grad()
    train_step(model, x, y)
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, params))


def test_grad_scaler_skips_a_step_with_an_inf_and_backs_off() -> None:
    model, _ = wrapped()
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler()

    @smp.step
    def scaled(model, data, target):
        loss = F.nll_loss(model(data), target)
        model.backward(scaler.scale(loss))
        return loss

    x, y = data()
    scaled(model, x, y)
    before = [p.detach().clone() for p in model.parameters()]
    next(iter(model.parameters())).grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0**15


@pytest.mark.parametrize("partial", [True, False])
def test_checkpoint_directories_resume(tmp_path: Path, partial: bool) -> None:
    model, _ = wrapped()
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    x, y = data()
    train_step(model, x, y)
    opt.step()
    expected = copy.deepcopy(model.state_dict())
    expected_opt = copy.deepcopy(opt.state_dict())
    smp.save_checkpoint(tmp_path, "step1", partial=partial, model=model, optimizer=opt, user_content={"step": 1})
    assert (tmp_path / "newest").read_text() == "step1"
    for _ in range(2):
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
    assert smp.resume_from_checkpoint(tmp_path, partial=partial) == {"step": 1}
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0, msg=k)
    for i, s in opt.state_dict()["state"].items():
        torch.testing.assert_close(s["exp_avg_sq"], expected_opt["state"][i]["exp_avg_sq"], rtol=0, atol=0)


def test_activation_checkpointing_recomputes_the_partitions_running_the_module() -> None:
    """set_activation_checkpointing(head): the partition running the head's ops recomputes its forward ("full"),
    every loss and weight stay exactly those of the same run without it (one manual assignment for both)."""
    x, y = data()
    runs = []
    for checkpoint in (False, True):
        model, _ = wrapped({"auto_partition": False}, first=0, second=1)
        if checkpoint:
            smp.set_activation_checkpointing(model.module.head)
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        losses = []
        for _ in range(3):
            opt.zero_grad()
            losses.append(train_step(model, x, y)[1].reduce_mean())
            opt.step()
        runs.append((model.pipe.plan, losses, model.state_dict()))
    (plain, plain_losses, plain_state), (plan, losses, state) = runs
    part = plan.partition
    head = {part.stage_of[n] for n in plan.graph.nx if plan.graph[n]["module"].startswith("head")}
    assert head == {1} and plan.recompute == ["none", "full"] and plain.recompute == ["none", "none"]
    assert part.stage_of == plain.partition.stage_of
    assert any("set_activation_checkpointing" in note for note in part.notes)
    for a, b in zip(losses, plain_losses):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for k, v in state.items():
        torch.testing.assert_close(v, plain_state[k], rtol=0, atol=0, msg=k)


def test_activation_checkpointing_needs_a_module_of_the_model_before_partitioning() -> None:
    model, _ = wrapped()
    with pytest.raises(smp.V1Error, match="not part of the DistributedModel"):
        smp.set_activation_checkpointing(nn.Linear(2, 2))
    with pytest.raises(smp.V1Error, match="strategy"):
        smp.set_activation_checkpointing(model.module.head, strategy="every")
    train_step(model, *data())
    with pytest.raises(smp.V1Error, match="after the first smp.step call"):
        smp.set_activation_checkpointing(model.module.head)


def test_tensor_parallelism_is_refused_by_name_and_off_is_a_no_op() -> None:
    smp.init({"partitions": 2})
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.float64):
        assert nn.Linear(2, 2).weight.dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32
    with smp.tensor_parallelism(enabled=False):
        pass
    for call in (lambda: smp.tensor_parallelism().__enter__(), smp.get_tp_process_group):
        with pytest.raises(smp.V1Error, match="tensor parallelism"):
            call()
