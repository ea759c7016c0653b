"""smp.partition: wrap an unmodified model into a PipelinedModel that trains as one pipeline across ranks."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.microbatch import MicrobatchError, split_microbatches
from partitioner.timeline import Timeline, TimelineEvent
from runtime.comm import Comm, PipelineError
from runtime.engine import Engine, RuntimeConfigError, check_world, concat_outputs, split_batch
from smp.plan import Plan, PlanError, canonical_schedule
from smp.plan import plan as make_plan

__all__ = ["partition", "PipelinedModel", "PipelineError", "RuntimeConfigError"]

DEFAULT_TIMEOUT = 300.0


def partition(model: nn.Module, *, stages: int | None = None, microbatches: int = 1, schedule: str = "1f1b",
              loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, cluster: Any = None,
              memory_limit: float | None = None, plan: Plan | str | Path | None = None,
              timeout: float = DEFAULT_TIMEOUT, plan_options: Mapping[str, Any] | None = None) -> PipelinedModel:
    """Wrap ``model`` so that ``step()`` trains it as a pipeline over the ranks of the default process group.

    ``stages`` defaults to the world size (1 without a process group: every stage then
    runs in this process, through the same engine). With ``plan=None`` the plan is made
    on the first ``step()`` (or call) from that batch: rank 0 plans (profiling is
    measured, hence not identical across ranks) and broadcasts the plan; every rank
    traces the model itself and checks the plan's fingerprint. ``timeout`` (seconds)
    bounds every wait on a peer. ``plan_options`` go to ``smp.plan`` (e.g.
    ``{"timing": "analytic"}``).
    """
    return PipelinedModel(model, stages=stages, microbatches=microbatches, schedule=schedule, loss_fn=loss_fn,
                          cluster=cluster, memory_limit=memory_limit, plan=plan, timeout=timeout,
                          plan_options=plan_options)


def _init_from_launcher(model: nn.Module, timeout: float) -> None:
    """Join the default process group when a launcher (torchrun) started this process and nobody did yet.

    torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a script that does not
    call ``init_process_group`` itself gets NCCL for a model on a GPU and gloo otherwise,
    with ``timeout`` on the group's collectives.
    """
    if not dist.is_available() or dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        return
    on_gpu = any(p.is_cuda for p in model.parameters())
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=datetime.timedelta(seconds=timeout))


class PipelinedModel:
    """A model split into pipeline stages over ranks; this rank holds only its stages' parameters.

    ``step(*args, target=..., **kwargs)`` runs one training step on the full batch
    (every rank passes the same batch, as every rank runs the same script and data
    loader): the batch is split into ``microbatches`` along dim 0, gradients are the
    mean over microbatches (so they match one large batch) and are accumulated into
    ``parameters()``; the mean loss is returned on every rank. Call your optimizer's
    ``zero_grad()``/``step()`` around it as usual.
    """

    def __init__(self, model: nn.Module, *, stages: int | None = None, microbatches: int = 1,
                 schedule: str = "1f1b", loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 cluster: Any = None, memory_limit: float | None = None, plan: Plan | str | Path | None = None,
                 timeout: float = DEFAULT_TIMEOUT, plan_options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"smp.partition takes a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        self.loss_fn = loss_fn
        self.timeout = float(timeout)
        _init_from_launcher(model, self.timeout)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if isinstance(plan, (str, Path)):
            plan = Plan.load(plan)
        self._plan: Plan | None = plan
        if plan is not None:
            if self.distributed:
                check_world(plan, self.world_size)
            if stages is not None and stages * plan.virtual_stages != plan.num_stages and stages != plan.num_ranks:
                raise RuntimeConfigError(f"stages={stages} disagrees with the plan's {plan.num_ranks} ranks")
            self.stages = plan.num_ranks
            self.microbatches = plan.microbatches
        else:
            self.stages = int(stages) if stages is not None else self.world_size
            if self.stages < 1:
                raise RuntimeConfigError(f"stages must be >= 1, got {stages}")
            if self.distributed and self.world_size != self.stages:
                if self.world_size % self.stages:
                    raise RuntimeConfigError(
                        f"the world size {self.world_size} is not a multiple of stages={self.stages}: launch "
                        f"{self.stages} processes or pass stages={self.world_size}")
                raise RuntimeConfigError(
                    f"the world size {self.world_size} is a multiple of stages={self.stages}, but data parallelism "
                    f"across pipeline replicas is not supported yet: launch {self.stages} processes")
            self.microbatches = int(microbatches)
            if self.microbatches < 1:
                raise RuntimeConfigError(f"microbatches must be >= 1, got {microbatches}")
        self.schedule = canonical_schedule(schedule) if plan is None else plan.schedule_name
        self.cluster = cluster
        self.memory_limit = memory_limit
        self.plan_options = dict(plan_options or {})
        self._engine: Engine | None = None  # the engine of the last mode used
        self._engines: dict[bool, Engine] = {}

    # ------------------------------------------------------------------ set-up

    @property
    def plan(self) -> Plan | None:
        """The Plan this pipeline runs (None until the first step when planning lazily)."""
        return self._plan

    def _ensure(self, args: tuple, kwargs: dict) -> Engine:
        # A trace records train/eval behaviour (F.dropout(x, p, self.training), export's
        # batch norm), so each mode gets its own stage programs, built on first use.
        mode = self.module.training
        engine = self._engines.get(mode)
        if engine is not None:
            self._engine = engine
            return engine
        if self._plan is None:
            self._plan = self._make_plan(args, kwargs)
        if self.distributed:
            check_world(self._plan, self.world_size)
        # traced on one microbatch: an export-traced program is specialised to the shapes it runs on
        micro_args, micro_kwargs = _first_microbatch(args, kwargs, self._plan.microbatches)
        comm = None
        if self.distributed:
            comm = self._engine.comm if self._engine is not None else Comm(
                self.rank, self.world_size, self.timeout,
                [self._plan.schedule.stages_of(r) for r in range(self._plan.num_ranks)])
        try:
            engine = Engine(self.module, self._plan, micro_args, micro_kwargs, rank=self.rank,
                            world_size=self.world_size, comm=comm)
        except Exception as err:
            if not self._engines:
                raise
            raise RuntimeConfigError(
                f"could not re-trace the model in {'train' if mode else 'eval'} mode after partitioning "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); make a separate "
                "smp.partition for the other mode, or switch modes before the first step") from None
        self._engines[mode] = engine
        self._engine = engine
        return engine

    def _make_plan(self, args: tuple, kwargs: dict) -> Plan:
        opts = dict(self.plan_options)

        def build() -> Plan:
            # profiling runs the model; keep every rank's RNG stream identical to the others'
            with torch.random.fork_rng(devices=[]):
                return make_plan(self.module, args, kwargs, stages=self.stages, microbatches=self.microbatches,
                                 schedule=self.schedule, cluster=self.cluster, memory_limit=self.memory_limit,
                                 **opts)

        if not self.distributed:
            return build()
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = {"plan": build().to_dict()}
            except Exception as err:  # noqa: BLE001 - every rank must learn that planning failed
                box[0] = {"error": f"{type(err).__name__}: {err}"}
                dist.broadcast_object_list(box, src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        if "error" in box[0]:
            raise PlanError(f"rank 0 could not plan the model: {box[0]['error']}")
        return Plan.from_dict(box[0]["plan"])

    # ------------------------------------------------------------------ running

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """One training step on the full batch; returns the mean loss over microbatches on every rank.

        The loss of a microbatch is ``loss_fn(output, target)`` on its slice of ``target``, or
        ``loss_fn(output, None)`` when no target is given (a loss that needs none).
        """
        if self.loss_fn is None:
            raise RuntimeConfigError("step() trains and needs a loss: pass loss_fn=... to smp.partition "
                                     "(a function (output, target) -> scalar tensor)")
        eng = self._ensure(args, kwargs)
        m = self._plan.microbatches  # type: ignore[union-attr]
        micro = self._split(eng, args, kwargs, m)
        try:
            targets = [None] * m if target is None else [piece[0][0]
                                                         for piece in split_microbatches((target,), None, m)]
        except MicrobatchError as err:
            raise RuntimeConfigError(f"the target cannot be split like the batch: {err}") from None
        loss, _ = eng.run(micro, targets, self.loss_fn, training=True)
        assert loss is not None
        return loss

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipelined pass (no gradients). The output is returned on the rank holding the
        output stage (every rank in a single process); the other ranks get None."""
        eng = self._ensure(args, kwargs)
        m = self._plan.microbatches  # type: ignore[union-attr]
        micro = self._split(eng, args, kwargs, m)
        with torch.no_grad():
            _, outputs = eng.run(micro, None, None, training=False)
        return concat_outputs(outputs) if outputs else None

    forward = __call__

    def _split(self, eng: Engine, args: tuple, kwargs: dict, m: int) -> list[list[Any]]:
        try:
            return split_batch(eng.gm, args, kwargs, m)
        except MicrobatchError as err:
            raise RuntimeConfigError(str(err)) from None

    # ------------------------------------------------------------------ parameters and state

    def _need_engine(self, what: str) -> Engine:
        if self._engine is None:
            if self._plan is None:
                raise RuntimeConfigError(
                    f"{what} needs the model to be partitioned, which happens on the first step() (plan=None): "
                    "run one step first, or pass plan=... to smp.partition")
            raise RuntimeConfigError(f"{what} needs a first step() or call to build the stages")
        return self._engine

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, with the original model's names (a tied parameter under its first name).

        Before partitioning (lazy planning) this is every parameter of the model.
        """
        if self._engine is None:
            yield from self.module.named_parameters()
            return
        yield from self._engine.local_named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def train(self, mode: bool = True) -> PipelinedModel:
        self.module.train(mode)
        return self

    def eval(self) -> PipelinedModel:
        return self.train(False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state with the original names, on rank 0 ({} on the other ranks).

        A collective: every rank must call it.
        """
        local = {k: v.detach().cpu() for k, v in self.module.state_dict().items()
                 if isinstance(v, torch.Tensor) and not v.is_meta}
        if not self.distributed:
            return local
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(local, gathered, dst=0)
        if self.rank != 0:
            return {}
        full: dict[str, torch.Tensor] = {}
        order = list(self.module.state_dict().keys())
        for part in gathered or []:
            for k, v in part.items():
                full.setdefault(k, v)
        missing = [k for k in order if k not in full]
        if missing:
            raise PipelineError(f"state_dict: no rank holds {missing[:3]} ({len(missing)} entries)")
        return {k: full[k] for k in order}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load a full (unpartitioned) state dict: each rank copies the entries it holds."""
        own = self.module.state_dict(keep_vars=True)
        if strict:
            missing = [k for k in own if k not in state_dict]
            unexpected = [k for k in state_dict if k not in own]
            if missing or unexpected:
                raise RuntimeConfigError(f"load_state_dict: missing keys {missing[:5]}, unexpected keys "
                                         f"{unexpected[:5]}; pass strict=False to load a partial state")
        with torch.no_grad():
            for k, t in own.items():
                if k in state_dict and isinstance(t, torch.Tensor) and not t.is_meta:
                    t.copy_(state_dict[k])

    # ------------------------------------------------------------------ measurements

    def timeline(self, gather: bool = False) -> Timeline:
        """Measured start/end of every compute action of the last step (the simulator's Timeline format).

        This rank's actions; with ``gather=True`` (a collective) every rank's, on one
        clock (perf_counter is one monotonic clock for all processes of a machine).
        """
        eng = self._need_engine("timeline()")
        if not (gather and self.distributed):
            return eng.timeline()
        mine = ([e.to_dict() for e in eng.events], eng.step_start, eng.step_end)
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        t0 = min(p[1] for p in parts)
        t1 = max(p[2] for p in parts)
        events = [TimelineEvent.from_dict(d) for p in parts for d in p[0]]
        eng_t0 = eng.step_start
        eng.step_start = t0
        try:
            return eng.timeline(events, t1 - t0)
        finally:
            eng.step_start = eng_t0

    def __repr__(self) -> str:
        return f"PipelinedModel({type(self.module).__name__}, rank {self.rank}/{self.world_size}, plan={self._plan!r})"


def _first_microbatch(args: tuple, kwargs: dict, m: int) -> tuple[tuple, dict]:
    try:
        return split_microbatches(args, kwargs, m)[0]
    except MicrobatchError as err:
        raise RuntimeConfigError(str(err)) from None
