"""Shared by the runtime tests: the single-model reference, a pipeline run, comparisons, the gloo rank worker."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import smp
from partitioner.microbatch import split_microbatches
from smp.models import build
from smp.partition import partition

RTOL = 1e-5
ATOL = 1e-6
# Several optimizer steps are taken with SGD + momentum, not Adam: SGD's update is linear in
# the gradient, so the rounding differences between a pipelined and an unpartitioned run
# (microbatches accumulated in another order) stay at float-rounding size (~1e-7 relative
# after 5 steps). Adam divides each gradient by its own running size, so an entry with a
# tiny gradient moves a full step on rounding alone: with AdamW, T5 on 3 stages drifted
# 1e-2 relative in some weights after 4 steps, in the reference itself run as 1 or 2
# microbatches, which would hide a real error as well as fail a correct run.
LR = 0.01
MOMENTUM = 0.9


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def make_plan(spec: str, stages: int, microbatches: int, schedule: str, **options: Any) -> smp.Plan:
    """A plan from analytic costs (fast and identical everywhere)."""
    b = build(spec, seed=0)
    return smp.plan(b.model, b.example_args, b.example_kwargs, stages=stages, microbatches=microbatches,
                    schedule=schedule, timing="analytic", **options)


def reference_run(spec: str, microbatches: int, steps: int) -> dict[str, Any]:
    """The unpartitioned model, microbatch by microbatch (loss / m each), then an SGD step.

    Running microbatch by microbatch equals one large batch for mean losses, and is
    what BatchNorm's running statistics see under a pipeline.
    """
    b = build(spec, seed=0)
    model = b.model
    opt = make_optimizer(model.parameters())
    result: dict[str, Any] = {"losses": []}
    for step in range(steps):
        opt.zero_grad()
        losses = []
        pieces = split_microbatches(b.example_args, b.example_kwargs, microbatches)
        targets = [t[0][0] for t in split_microbatches((b.target,), None, microbatches)]
        for (a, k), tgt in zip(pieces, targets):
            loss = b.loss_fn(model(*a, **k), tgt)
            (loss / microbatches).backward()
            losses.append(loss.detach())
        result["losses"].append(torch.stack(losses).mean())
        if step == 0:
            result["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    result["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    result["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


def pipeline_run(pipe: Any, spec: str, steps: int) -> dict[str, Any]:
    """The same steps through a PipelinedModel (this rank's parameters only)."""
    b = build(spec, seed=0)
    result: dict[str, Any] = {"losses": []}
    opt = None
    for step in range(steps):
        loss = pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
        if opt is None:  # parameters() is this rank's share only once partitioned (after the first step)
            opt = make_optimizer(pipe.parameters())
        result["losses"].append(loss.detach().clone())
        if step == 0:
            result["grads"] = {n: p.grad.detach().clone() for n, p in pipe.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    result["params"] = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    return result


def assert_close_maps(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], what: str,
                      rtol: float = RTOL, atol: float = ATOL, per_tensor: bool = False) -> None:
    """Every tensor of ``got`` equals ``ref``'s: element by element, or relative to the tensor's scale.

    ``per_tensor``: max |got - ref| <= rtol * max |ref| + atol. Parameters after several
    optimizer steps are compared this way (an entry near zero carries the rounding of its
    larger neighbours' updates); gradients element by element.
    """
    assert got, f"{what}: nothing to compare"
    for name, g in got.items():
        assert name in ref, f"{what}: {name} is not in the reference"
        r = ref[name]
        assert g.shape == r.shape, f"{what}: {name} shape {tuple(g.shape)} != {tuple(r.shape)}"
        if per_tensor:
            close = (g - r).abs().max().item() <= rtol * r.abs().max().item() + atol if r.numel() else True
        else:
            close = torch.allclose(g, r, rtol=rtol, atol=atol)
        if not close:
            diff = (g - r).abs().max().item()
            raise AssertionError(f"{what}: {name} differs by up to {diff:.3g} (max |ref| {r.abs().max().item():.3g})")


def check_against_reference(results: list[dict[str, Any]], ref: dict[str, Any], label: str) -> None:
    """Every rank's loss equals the reference; the union of their gradients/parameters covers and equals it."""
    seen_grads: set[str] = set()
    seen_params: set[str] = set()
    for r, res in enumerate(results):
        for i, (lg, lr) in enumerate(zip(res["losses"], ref["losses"])):
            assert torch.allclose(lg.float(), lr.float(), rtol=RTOL, atol=ATOL), \
                f"{label} rank {r} step {i}: loss {lg.item()} != {lr.item()}"
        assert_close_maps(res["grads"], ref["grads"], f"{label} rank {r} grads")
        assert_close_maps(res["params"], ref["params"], f"{label} rank {r} params after {len(res['losses'])} steps",
                          per_tensor=True)
        seen_grads |= set(res["grads"])
        seen_params |= set(res["params"])
    assert seen_grads == set(ref["grads"]), f"{label}: gradients missing for {set(ref['grads']) - seen_grads}"
    assert seen_params == set(ref["params"]), f"{label}: parameters missing {set(ref['params']) - seen_params}"


# ---------------------------------------------------------------------- gloo rank workers


def train_worker(rank: int, world: int, *, spec: str, plans: Mapping[str, dict], out: str, steps: int,
                 check_state: bool = False, options: Mapping[str, Any] | None = None) -> None:
    """One rank: for each plan, a fresh model, ``steps`` pipelined SGD steps, results to ``out``; ``options``
    go to ``smp.partition``."""
    for label, plan_dict in plans.items():
        b = build(spec, seed=0)
        pipe = partition(b.model, plan=smp.Plan.from_dict(plan_dict), loss_fn=b.loss_fn, timeout=60,
                         **(options or {}))
        res = pipeline_run(pipe, spec, steps)
        if check_state:
            res["state"] = pipe.state_dict()
            res["forward"] = pipe(*b.example_args, **b.example_kwargs)
        torch.save(res, Path(out) / f"{label}-{rank}.pt")


def fault_worker(rank: int, world: int, *, spec: str, plan: dict, victim: int, how: str, timeout: float) -> None:
    """One rank of a pipeline in which rank ``victim`` raises or dies in the middle of the second step."""
    b = build(spec, seed=0)
    pipe = partition(b.model, plan=smp.Plan.from_dict(plan), loss_fn=b.loss_fn, timeout=timeout)
    pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
    if rank == victim:
        eng = pipe._engine
        calls = {"n": 0}
        original = eng.split.stages[next(iter(eng.split.stages))].gm.forward

        def dying(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 2:  # second microbatch: the step is well under way on every rank
                if how == "kill":
                    os.kill(os.getpid(), 9)
                raise ValueError("injected failure")
            return original(*args, **kwargs)

        eng.split.stages[next(iter(eng.split.stages))].gm.forward = dying
    import time

    start = time.monotonic()
    try:
        pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
    except Exception as err:  # noqa: BLE001 - reported to the test through stderr, exit code 3
        print(f"SMP-ERROR {type(err).__name__}: {err}", flush=True)
        print(f"SMP-STOPPED-AFTER {time.monotonic() - start:.3f}", flush=True)
        os._exit(3)
    print("SMP-NO-ERROR", flush=True)


def user_model_worker(rank: int, world: int, *, case: str, out: str, order: str = "train-first") -> None:
    """One rank running a user-written model (tests/_user_models.py) through the cases the runtime tests check.

    ``two_towers``: two SGD steps and a forward on a model returning a value made on stage 0.
    ``train_eval``: steps and eval forwards alternating (``order``), with the state gathered at
    each eval so the test can compare the eval output with the unpartitioned model's.
    ``bf16``: the loss's dtype on every rank for a bf16 model.
    """
    import sys

    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the launcher imports this file by path
    from _user_models import Dropping, TwoTowers, two_towers_loss

    torch.manual_seed(0)
    res: dict[str, Any] = {}
    if case == "two_towers":
        model, x = TwoTowers(), (torch.randn(8, 16), torch.randn(8, 16))
        target = torch.randn(8)
        plan = smp.plan(model, x, stages=world, microbatches=2, timing="analytic", method="uniform")
        pipe = partition(model, plan=plan, loss_fn=two_towers_loss, timeout=60)
        opt = None
        res["losses"] = []
        for step in range(2):
            res["losses"].append(pipe.step(*x, target=target).detach())
            if step == 0:
                res["grads"] = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
            opt = opt or make_optimizer(pipe.parameters())
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            res["forward"] = pipe(*x)
        res["emb_stage"] = plan.partition.stage_of["embed_a"]
    elif case in ("train_eval", "train_eval_hf"):
        if case == "train_eval":
            model, x = Dropping(), (torch.randn(8, 16),)
            loss_fn = lambda out, target: out.pow(2).mean()  # noqa: E731
            kwargs: dict[str, Any] = {}
        else:
            b = build("hf-gpt2:size=tiny,batch=4", seed=0)
            model, x, kwargs, loss_fn = b.model, b.example_args, b.example_kwargs, b.loss_fn
        target = None if case == "train_eval" else b.target
        pipe = partition(model, stages=world, microbatches=2, loss_fn=loss_fn, timeout=60,
                         timing="analytic")
        opt = None
        res["evals"] = []
        steps = ["train", "eval", "train", "eval", "train", "eval"] if order == "train-first" else \
            ["eval", "train", "eval", "eval", "train", "eval"]
        for what in steps:
            if what == "train":
                pipe.train()
                pipe.step(*x, target=target, **kwargs)
                opt = opt or make_optimizer(pipe.parameters())
                opt.step()
                opt.zero_grad()
            else:
                pipe.eval()
                with torch.no_grad():
                    got = pipe(*x, **kwargs)
                res["evals"].append({"output": got, "state": pipe.state_dict()})
    elif case == "bf16":
        model = Dropping().to(torch.bfloat16)
        x = torch.randn(8, 16, dtype=torch.bfloat16)
        pipe = partition(model, stages=world, microbatches=2, loss_fn=lambda o, t: F.mse_loss(o.float(), t),
                         timeout=60, timing="analytic")
        res["dtype"] = str(pipe.step(x, target=torch.zeros(8, 4)).dtype)
    torch.save(res, Path(out) / f"{case}-{order}-{rank}.pt")


def large_model_worker(rank: int, world: int, *, case: str, out: str, checkpoint: str, plan: dict,
                       steps: int = 2, size: tuple = (64, 32, 2, 4, 16)) -> None:
    """One rank of a model built without weights (``delay_param_initialization``), loaded from ``checkpoint``.

    ``train``: ``steps`` SGD steps; saves losses, first-step grads, final parameters, memory.
    ``resume``: ``steps`` steps, then saves a pipeline checkpoint with the optimizer to ``out``/ckpt.
    ``continue``: loads ``checkpoint`` (an smp checkpoint) with its optimizer state, ``steps`` more steps.
    ``clip``: one step, then clip_grad_norm_(0.5): the total norm and this rank's clipped grads.
    ``rss``: peak resident memory before and after partitioning and one step.
    """
    import resource

    from smp.deferred import delay_param_initialization
    from smp.models.gpt import GPT

    vocab, d, layers, heads, seq = size
    torch.manual_seed(0)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with delay_param_initialization():
        model = GPT(vocab, d, layers, heads, seq)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (4, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    pipe = partition(model, plan=smp.Plan.from_dict(plan), loss_fn=loss_fn, checkpoint=checkpoint, timeout=60)
    pipe.prepare(x)
    opt = make_optimizer(pipe.parameters())
    if case == "continue":
        pipe.load_checkpoint(checkpoint, optimizer=opt)
    res: dict[str, Any] = {"losses": []}
    for step in range(steps if case != "clip" else 1):
        res["losses"].append(pipe.step(x, target=y).detach())
        if step == 0:
            res["grads"] = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        if case == "clip":
            res["norm"] = pipe.clip_grad_norm_(0.5)
            res["clipped"] = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
            break
        opt.step()
        opt.zero_grad()
    if case == "resume":
        pipe.save_checkpoint(Path(out) / "ckpt", optimizer=opt)
    res["params"] = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    res["memory"] = pipe.memory_stats(opt)[rank]
    res["rss"] = (rss0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    res["meta_params"] = sum(1 for p in model.parameters() if p.is_meta)
    torch.save(res, Path(out) / f"{case}-{rank}.pt")


def hf_meta_worker(rank: int, world: int, *, spec: str, checkpoint: str, out: str, steps: int = 2) -> None:
    """One rank of a Hugging Face zoo model built under ``delay_param_initialization`` and loaded from a file."""
    from smp.deferred import delay_param_initialization

    with delay_param_initialization():
        b = build(spec, seed=0)
    held_before = sum(p.numel() for p in b.model.parameters() if not p.is_meta)
    pipe = partition(b.model, stages=world, microbatches=2, loss_fn=b.loss_fn, checkpoint=checkpoint, timeout=60,
                     timing="analytic")
    res = pipeline_run(pipe, spec, steps)
    res["held_before"] = held_before
    res["held"] = sum(p.numel() for p in b.model.parameters() if not p.is_meta)
    res["total"] = sum(p.numel() for p in b.model.parameters())
    torch.save(res, Path(out) / f"hf-{rank}.pt")


def data_parallel_worker(rank: int, world: int, *, spec: str, stages: int, schedule: str, out: str,
                         placement: str = "cluster", steps: int = 2, microbatches: int = 2) -> None:
    """One rank of D = world / stages replicas: its replica's shard of the global batch, ``steps`` SGD steps."""
    b = build(spec, seed=0)
    pipe = partition(b.model, stages=stages, microbatches=microbatches, schedule=schedule, loss_fn=b.loss_fn,
                     timeout=60, placement=placement, timing="analytic")
    x, y = b.example_args[0], b.target
    share = x.shape[0] // pipe.dp_size
    rows = slice(pipe.dp_rank * share, (pipe.dp_rank + 1) * share)
    res: dict[str, Any] = {"losses": [], "dp_rank": pipe.dp_rank, "pp_rank": pipe.pp_rank, "dp_size": pipe.dp_size}
    opt = None
    for step in range(steps):
        res["losses"].append(pipe.step(x[rows], target=y[rows]).detach())
        if step == 0:
            res["grads"] = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
            res["plan_dp"] = pipe.plan.data_parallel
            res["actions"] = [str(a) for a in pipe._engine.schedule.actions[pipe.pp_rank]]
            res["launches"] = list(pipe._engine.bucket_launches)
        opt = opt or make_optimizer(pipe.parameters())
        opt.step()
        opt.zero_grad()
    res["params"] = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    torch.save(res, Path(out) / f"dp-{rank}.pt")


def check_data_parallel(ranks: list[dict], spec: str, replicas: int, microbatches: int = 2) -> None:
    """Every rank's gradients and losses equal the unpartitioned model's on the global batch, replicas agree."""
    # the reference: the unpartitioned model on the whole global batch, as replicas x microbatches pieces
    check_against_reference(ranks, reference_run(spec, replicas * microbatches, 2), f"{spec} {replicas} replicas")
    by_place: dict[int, list[dict]] = {}
    for res in ranks:
        assert res["dp_size"] == replicas and res["plan_dp"] == replicas
        by_place.setdefault(res["pp_rank"], []).append(res)
    for pp, same in by_place.items():  # every replica holds the same parameters after the steps
        assert sorted(r["dp_rank"] for r in same) == list(range(replicas))
        for other in same[1:]:
            for n, p in other["params"].items():
                assert torch.equal(p, same[0]["params"][n]), (pp, n)
        assert sum(a.startswith("AR") for a in same[0]["actions"]) == len(
            {a.split(".")[0][1:] for a in same[0]["actions"] if a[0] in "BW"})  # an all-reduce per stage
        for res in same:  # each bucket goes out during its stage's final backward, or (split: W) at its AR
            for stage, _, during in res["launches"]:
                final = [a for a in res["actions"] if a.split(".")[0] in (f"B{stage}", f"W{stage}")][-1]
                assert during in (final, f"AR{stage}"), (stage, during)
                assert during == (f"AR{stage}" if final.startswith("W") else final), (stage, during)


def buffer_worker(rank: int, world: int, *, out: str, broadcast_buffers: bool = True) -> None:
    """Two replicas of a one-stage ResNet (BatchNorm): a step on each replica's own data, then one on the same data."""
    b = build("resnet:size=tiny,batch=8", seed=0)
    pipe = partition(b.model, stages=1, microbatches=1, loss_fn=b.loss_fn, timeout=60,
                     timing="analytic", broadcast_buffers=broadcast_buffers)
    x, y = b.example_args[0], b.target
    share = x.shape[0] // pipe.dp_size
    mine = slice(pipe.dp_rank * share, (pipe.dp_rank + 1) * share)
    pipe.step(x[mine], target=y[mine])  # the replicas' statistics part here
    pipe.step(x[:share], target=y[:share])  # the same data on both: equal again only if they started equal
    torch.save({n: t.clone() for n, t in pipe.module.named_buffers() if not t.is_meta}, Path(out) / f"buf-{rank}.pt")


def recompute_worker(rank: int, world: int, *, spec: str, plans: Mapping[str, dict], out: str) -> None:
    """One rank: for each plan, a fresh model and one step; its gradients, loss and measured stashed bytes."""
    for label, plan_dict in plans.items():
        b = build(spec, seed=0)
        torch.manual_seed(100 + rank)  # dropout draws the same masks in every plan's run of this rank
        pipe = partition(b.model, plan=smp.Plan.from_dict(plan_dict), loss_fn=b.loss_fn, timeout=60)
        loss = pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
        eng = pipe._engine
        torch.save({"loss": loss, "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None},
                    "peak": eng.stash_peak[rank], "kept": dict(eng.stash_kept)}, Path(out) / f"{label}-{rank}.pt")


def precision_worker(rank: int, world: int, *, spec: str, out: str) -> None:
    """One rank: a bf16 step (loss, grads, the cut tensors' dtypes), then fp16 steps in which rank 0's gradients
    overflow on the first step only."""
    res: dict[str, Any] = {}
    b = build(spec, seed=0)
    pipe = partition(b.model, stages=world, microbatches=2, loss_fn=b.loss_fn, timeout=60, precision="bf16",
                     timing="analytic", recompute="none")
    res["bf16_loss"] = pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
    res["bf16_grads"] = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    res["param_dtypes"] = {str(p.dtype) for p in pipe.parameters()}
    eng = pipe._engine
    meta = next(iter(eng._meta_cache.values()))
    res["wire_dtypes"] = sorted({str(dt) for leaves in meta.leaves_per_edge.values() for _, dt in leaves})
    res["kept"] = {s: (eng.stash_kept[s], pipe.plan.partition.stages[s].activations) for s in eng.my_stages}
    res["output_stage"] = eng.split.output_stage

    b = build(spec, seed=0)
    pipe = partition(b.model, stages=world, microbatches=2, loss_fn=b.loss_fn, timeout=60, precision="fp16",
                     timing="analytic", recompute="none")
    pipe.prepare(*b.example_args, **b.example_kwargs)
    opt = make_optimizer(pipe.parameters())
    res["scales"] = [pipe.grad_scaler.scale]
    res["skipped"] = []
    res["params"] = [{n: p.detach().clone() for n, p in pipe.named_parameters()}]
    hook = None
    if rank == 0:  # an overflow in one gradient of rank 0 only (no tied weight, whose sum would carry it), by autograd
        tied = {id(p) for ps in pipe._setup.ownership.ties.values() for p in ps}
        victim = next(p for p in pipe.parameters() if id(p) not in tied)
        hook = victim.register_hook(lambda g: g * float("inf"))
    res["local_overflow"] = []  # what this rank found in its own gradients, before the ranks agree
    agree = pipe.any_rank
    pipe.any_rank = lambda flag: (res["local_overflow"].append(bool(flag.item())), agree(flag))[1]
    for _ in range(2):
        pipe.step(*b.example_args, target=b.target, **b.example_kwargs)
        res["skipped"].append(pipe.last_step_skipped)
        opt.step()
        opt.zero_grad()
        res["scales"].append(pipe.grad_scaler.scale)
        res["params"].append({n: p.detach().clone() for n, p in pipe.named_parameters()})
        if hook is not None:
            hook.remove()
            hook = None
    torch.save(res, Path(out) / f"precision-{rank}.pt")


def unused_parameter_worker(rank: int, world: int, *, out: str) -> None:
    """D = world replicas of one stage whose model reads a parameter no gradient reaches: which gradients exist
    after a step."""
    from torch import nn

    from _user_models import WithSpare

    torch.manual_seed(0)
    model = nn.Sequential(WithSpare(), nn.Linear(8, 2))
    pipe = partition(model, stages=1, microbatches=1, loss_fn=lambda o, t: (o - t).pow(2).mean(), timeout=60,
                     timing="analytic")
    pipe.step(torch.randn(4, 8), target=torch.randn(4, 2))
    torch.save({n: p.grad is None for n, p in pipe.named_parameters()}, Path(out) / f"unused-{rank}.pt")


def rank0_planning_worker(rank: int, world: int, *, out: str) -> None:
    """Lazy planning on rank 0 shared with the others (smp.rank0_plan): a plan rank 0 cannot make (no plan fits
    a 1-byte memory limit), then one it can; each rank's outcome and plan to ``out``."""
    spec = "gpt:size=tiny,batch=4,layers=2"
    res: dict[str, Any] = {}
    b = build(spec, seed=0)
    pipe = partition(b.model, loss_fn=b.loss_fn, timeout=30, microbatches=2, timing="analytic", memory_limit=1)
    try:
        pipe.prepare(*b.example_args, **b.example_kwargs)
        res["failed"] = None
    except Exception as err:  # noqa: BLE001 - what each rank was told is the result
        res["failed"] = f"{type(err).__name__}: {err}"
    b = build(spec, seed=0)
    pipe = partition(b.model, loss_fn=b.loss_fn, timeout=30, microbatches=2, timing="analytic")
    pipe.prepare(*b.example_args, **b.example_kwargs)
    res["plan"] = pipe.plan.to_dict()  # type: ignore[union-attr]
    torch.save(res, Path(out) / f"rank0-planning-{rank}.pt")
