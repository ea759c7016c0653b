"""smp.partition: wrap an unmodified model into a PipelinedModel that trains as one pipeline across ranks."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.compile import plan as make_plan
from partitioner.errors import PlanningError
from partitioner.microbatch import MicrobatchError
from partitioner.plan import Plan
from partitioner.program import flatten_inputs, retarget_device
from partitioner.request import PlanRequest
from partitioner.timeline import Timeline, TimelineEvent
from partitioner.trace import trace
from runtime.batch import Microbatches, join_outputs
from runtime.checkpoint import CheckpointError, open_weights
from runtime.comm import Comm
from runtime.engine import Engine
from runtime.errors import PipelineError, RuntimeConfigError
from runtime.faults import ARRIVAL_DEADLINE, FailTogether
from runtime.layout import ReplicaLayout
from runtime.materialize import MaterializeError, materialize
from runtime.memory import OptimizerStepMeter, rank_memory
from runtime.precision import PipelineGradScaler, Precision
from runtime.program import Ownership, Program, program_for
from runtime.sharding import local, repoint
from runtime.split import SplitError
from runtime.teardown import release_at_exit
from runtime.tensor_parallel import TensorParallel, refuse_plan, tp_plan_for
from smp.launch import DEFAULT_TIMEOUT, init_distributed, launched_by_torchrun, resolve_device
from smp.pipeline_state import PipelineState
from smp.plan_options import check_agrees, check_precision, given_options
from smp.rank0_plan import plan_on_rank0

__all__ = ["partition", "PipelinedModel", "PipelineError", "RuntimeConfigError"]


def partition(model: nn.Module, **options: Any) -> PipelinedModel:
    """Wrap ``model`` so that ``step()`` trains it as a pipeline over the ranks of the default process group.

    The options are :class:`PipelinedModel`'s (``plan``, ``loss_fn``, ``timeout``, ``arrival_deadline``, ``device``,
    ``checkpoint``, ``init_fn``, ``init_seed``, ``broadcast_output``, ``broadcast_buffers``,
    ``precision``, ``grad_scaler``, ``compile_backend``, ``tp_plan``) and the planning request's (``request``, or its
    fields: ``stages``, ``microbatches``, ``schedule``, ``cluster``, ``memory_limit``, ``placement``,
    ``recompute``, ``active_microbatches``, ``timing``, ``compile``, ``tensor_parallel``, ...:
    :class:`partitioner.request.PlanRequest`).
    """
    return PipelinedModel(model, **options)


class PipelinedModel(PipelineState):
    """A model split into pipeline stages over ranks; this rank holds only its stages' parameters.

    ``step(*args, target=..., **kwargs)`` runs one training step on the full batch
    (every rank passes the same batch, as every rank runs the same script and data
    loader): the batch is split into ``microbatches`` along dim 0, gradients are the
    mean over microbatches (so they match one large batch) and are accumulated into
    ``parameters()``; the mean loss is returned on every rank. Call your optimizer's
    ``zero_grad()``/``step()`` around it as usual.

    What to plan is a :class:`~partitioner.request.PlanRequest` (``request=``, or its fields as
    keywords: ``stages``, ``microbatches``, ``schedule``, ``timing``, ...): ``stages`` defaults
    to the world size (1 without a process group: every stage then runs in this process,
    through the same engine), ``microbatches`` to the request's one rule
    (:func:`~partitioner.request.default_microbatches`: 1 on one rank, else the largest
    divisor of the batch not above 2 x stages). With ``plan=None`` the plan is made on the
    first ``step()`` (or call, or ``prepare()``) from that batch: rank 0 plans (measured
    profiling differs between ranks) and shares the plan through the store; every rank traces the model
    itself and checks the plan's fingerprint. With ``plan=...`` a planning option given
    too must agree with the plan. ``timeout`` (seconds) bounds every wait on a peer. A failure on any
    rank makes the others raise it at once (:class:`PipelineError` "rank 0 failed: ..."); a collective
    call names a rank that did not enter it within ``arrival_deadline`` seconds (runtime/faults.py).

    Placement and weights: this rank's stages run on ``device`` (default ``cuda:LOCAL_RANK``
    with a GPU, else where the model is; CPU for a model on the meta device); only the
    parameters and buffers its stages hold are ever put there. Tensors without values (a
    model built on the meta device or under ``smp.delay_param_initialization()``) are
    filled from ``checkpoint`` (a safetensors file, a Hugging Face directory, a torch.save
    state dict or an smp checkpoint; each rank reads only its tensors), else by
    ``init_fn(module)`` or each module's ``reset_parameters()``, seeded by ``init_seed``
    and the module's name. A ``checkpoint`` given for a model with real weights replaces
    them. ``broadcast_output``: ``pipe(x)`` returns the output on every rank, not only on
    the one holding the output stage.

    Data parallel: in a world of D x P ranks (``stages`` = P) the pipeline runs as D
    replicas, laid out by ``placement`` ("cluster": each pipeline on consecutive ranks;
    "spread": each stage's replicas on consecutive ranks; default the plan's, else
    "cluster"). Each rank passes its replica's share of the global batch, as with
    DistributedDataParallel; gradients become the mean over the global batch (each stage's
    all-reduced over its replicas as soon as they are final, overlapping the rest of the
    step) and ``step()`` returns the global mean loss on every rank. ``dp_rank``,
    ``dp_size``, ``pp_rank``, ``pp_size`` say where this rank sits. ``broadcast_buffers``
    (default True, as in DistributedDataParallel) copies the first replica's buffers (e.g.
    batch-norm statistics) to the others before each training step.

    Tensor parallel: ``tensor_parallel=T`` splits each stage's modules over T consecutive ranks (world D x P x T)
    by ``tp_plan`` (default the model's own); ``tp_rank``, ``tp_size``: docs/runtime.md#tensor-parallelism.
    ``sequence_parallel`` (default "auto": where the program allows it; True, False) runs the ops between the
    split modules on each tp rank's chunk of the sequence, as the plan records (``plan.sequence_parallel``).
    The tp groups are innermost: in the placements above each "rank" is a block of T consecutive ranks.
    Every tp rank of a replica passes the same batch (a sampler sharding over ``dp_rank``, not the world).

    Compiled stages: ``compile=True`` plans for stages compiled with ``torch.compile`` and runs
    them so (a plan made with it runs compiled), on ``compile_backend`` (default "inductor";
    "aot_eager" checks the mechanics without a C++ compiler). docs/runtime.md#compiled-stages.
    """

    def __init__(self, model: nn.Module, *, plan: Plan | str | Path | None = None,
                 request: PlanRequest | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 timeout: float = DEFAULT_TIMEOUT, arrival_deadline: float = ARRIVAL_DEADLINE,
                 device: str | torch.device | None = None,
                 checkpoint: str | Path | None = None, init_fn: Callable[[nn.Module], None] | None = None,
                 init_seed: int = 0, broadcast_output: bool = False, broadcast_buffers: bool = True,
                 precision: str = "fp32", grad_scaler: PipelineGradScaler | None = None,
                 compile_backend: str = "inductor", tp_plan: Mapping[str, Any] | None = None,
                 **planning: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"smp.partition takes a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        self.loss_fn = loss_fn
        self.timeout = float(timeout)
        self.device = resolve_device(device, model)
        self.init_fn = init_fn
        self.init_seed = int(init_seed)
        self.broadcast_output = bool(broadcast_output)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.compile_backend = compile_backend
        try:
            self.precision = Precision.parse(precision)
        except ValueError as err:
            raise RuntimeConfigError(str(err)) from None
        if grad_scaler is not None and not self.precision.needs_scaling:
            raise RuntimeConfigError(f"grad_scaler is for precision='fp16' (bf16 and fp32 need no loss scaling), got "
                                     f"precision={self.precision.name!r}")
        self.grad_scaler = grad_scaler or (PipelineGradScaler() if self.precision.needs_scaling else None)
        self.last_step_skipped = False
        try:
            self.request = PlanRequest.build(request, **planning)
        except PlanningError as err:
            raise RuntimeConfigError(str(err)) from None
        if self.request.searching:
            raise RuntimeConfigError("smp.partition runs one pipeline shape: fix stages and microbatches (or choose "
                                     "them first with smp.plan(..., devices=N) and pass plan=...)")
        if dist.is_available() and launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:  # not joined yet
            init_distributed(timeout=self.timeout, device=self.device)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._together = FailTogether(self.rank, self.world_size, timeout=self.timeout,
                                      arrival_deadline=float(arrival_deadline), distributed=self.distributed)
        self._setup: _SetUp | None = None
        with self._together.failing():  # the file may be missing or damaged on this rank's machine only
            self.checkpoint = open_weights(checkpoint) if checkpoint is not None else None
        if isinstance(plan, (str, Path)):
            plan = Plan.load(plan)
        self._plan: Plan | None = plan
        given = given_options(request, planning)
        if given.get("training") is False:
            raise RuntimeConfigError("smp.partition trains (pipe(x) runs the forward alone): drop training=False")
        tp_size = plan.tensor_parallel if plan is not None else self.request.tensor_parallel
        if plan is not None:
            check_agrees(plan, self.request, given)
            check_precision(plan, self.precision.name)
            self.stages = plan.pipeline_ranks
        else:
            self.stages = self.request.stages or max(1, self.world_size // tp_size)
        self.tp_plan = tp_plan_for(model, tp_plan, self.request, tp_size)  # checked before any collective
        self.layout = ReplicaLayout.build(self.world_size, self.stages, self.request.placement or (
            plan.placement if plan is not None else "cluster"), self.device,
            plan.data_parallel if plan is not None else None, tensor_parallel=tp_size)
        self._tp = TensorParallel(model, self.tp_plan, self.layout.mesh["tp"], tp_size) \
            if self.tp_plan is not None else None
        if "data_parallel" in given and self.request.data_parallel != self.layout.dp_size:
            raise RuntimeConfigError(f"data_parallel={given['data_parallel']!r} disagrees with the world: "
                                     f"{self.world_size} ranks of {self.stages} stages run {self.layout.dp_size} "
                                     "replicas; drop data_parallel= (the world size decides it)")
        self._engine: Engine | None = None  # the engine of the last mode used
        self._engines: dict[bool, Engine] = {}
        release_at_exit(self._release_groups)

    def _release_groups(self) -> None:
        """Let go of the process groups at exit, after smp destroyed them, so that their threads stop before the
        interpreter finalizes (runtime/teardown.py); the pipeline cannot step afterwards."""
        self.layout = dataclasses.replace(self.layout, pp_group=None, dp_group=None, mesh=None)
        for engine in self._engines.values():
            engine.dp_group = None

    # ------------------------------------------------------------------ where this rank sits

    @property
    def pp_rank(self) -> int:
        """This rank's place in its pipeline (0 .. pp_size - 1)."""
        return self.layout.pp_rank

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def tp_rank(self) -> int:
        """This rank's place among its stage's tensor-parallel ranks (0 .. tp_size - 1)."""
        return self.layout.tp_rank

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def dp_rank(self) -> int:
        """Which replica of the pipeline this rank belongs to (0 .. dp_size - 1)."""
        return self.layout.dp_rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    # ------------------------------------------------------------------ set-up

    @property
    def plan(self) -> Plan | None:
        """The Plan this pipeline runs (None until the first step when planning lazily)."""
        return self._plan

    def _ensure(self, args: tuple, kwargs: dict, first: tuple[tuple, dict] | None = None) -> Engine:
        """The engine of the module's current mode (a trace records train/eval behaviour), built on first use
        from the batch ``args, kwargs`` (or, with a plan, from its ``first`` microbatch); the ranks meet after it."""
        mode = self.module.training
        engine = self._engines.get(mode)
        if engine is None:
            with self._together.failing():
                if self._setup is None:
                    self._setup = self._set_up(args, kwargs, first)
            self._program(mode)  # the same on every rank (one trace): not published, the other mode still runs
            with self._together.failing():
                engine = self._build_engine(mode)
            self._together.meet_after_setup()
        self._engine = engine
        return engine

    def _program(self, mode: bool) -> Program:
        """The traced program of a mode (train: True), or the reason the model cannot run in it."""
        assert self._setup is not None
        program = self._setup.programs.get(mode)
        if program is None:
            raise RuntimeConfigError(f"the model cannot run in {'train' if mode else 'eval'} mode as partitioned: "
                                     f"{self._setup.errors[mode]}")
        return program

    def _build_engine(self, mode: bool) -> Engine:
        """The engine of a mode. Sharded (``plan.sharding``), the training engine wraps its stage programs with
        FSDP2 first, whatever mode runs first: the model and every traced program then hold the sharded
        parameters, and an eval-mode engine runs on them gathered."""
        setup = self._setup
        assert setup is not None
        program = self._program(mode)
        if self._tp is not None:
            refuse_plan(self._plan)  # type: ignore[arg-type]
            self._tp.sequence_parallel = self._plan.sequence_parallel  # type: ignore[union-attr]
        sharded = self._plan.sharding != "none" and self.distributed  # type: ignore[union-attr]
        train = self._engines.get(True) or (self._build_engine(True) if sharded and not mode else None)
        engine = Engine(program, setup.ownership, rank=self.pp_rank, comm=setup.comm, device=setup.device,
                        example_flat=setup.example_flat[mode], dp_group=self.layout.dp_group,
                        dp_size=self.layout.dp_size, precision=self.precision,
                        shard_mesh=self.layout.mesh["dp"] if sharded and mode else None,
                        gathered_by=train.shards if train is not None and not mode else None,
                        tensor_parallel=self._tp,
                        compile_backend=self.compile_backend if self._plan.model.compiled else None)  # type: ignore[union-attr]
        if engine.shards is not None:
            repoint([self.module, *(p.gm for p in setup.programs.values())], engine.shards.replaced)
            setup.ownership.rekey(engine.shards.replaced)  # after: it finds the ties in the model as it is now
        self._engines[mode] = engine
        return engine

    def _set_up(self, args: tuple, kwargs: dict, first: tuple[tuple, dict] | None) -> _SetUp:
        """Plan (if needed), trace the model in both modes, and keep only this rank's parameters.

        Both modes are traced now, while every parameter is still here: an export trace runs
        the model (on fake tensors), which it cannot do once other ranks' weights are gone.
        """
        if self._plan is None:
            self._plan = self._make_plan(args, kwargs)
        plan = self._plan
        # traced on one microbatch: an export-traced program is specialised to the shapes it runs on
        micro_args, micro_kwargs = first if first is not None else self._cut(args, kwargs).inputs[0]
        on_meta = any(t.is_meta for t in [*self.module.parameters(), *self.module.buffers()])
        was_training = self.module.training
        programs: dict[bool, Program] = {}
        errors: dict[bool, str] = {}
        flat: dict[bool, list[Any]] = {}
        try:
            with torch.random.fork_rng(devices=[]):
                for mode in (True, False):
                    self.module.train(mode)
                    try:
                        gm = trace(self.module, micro_args, micro_kwargs, frontend=plan.model.frontend or "auto",
                                   leaf_modules=list(plan.model.leaf_modules), check=False)
                    except Exception as err:  # noqa: BLE001 - only this mode is unavailable
                        if mode:
                            raise
                        errors[mode] = f"tracing it failed ({type(err).__name__}: {str(err).splitlines()[0]})"
                        continue
                    if on_meta:  # "the model's device" is this rank's device, not meta
                        retarget_device(gm, torch.device("meta"), self.device)
                    try:  # eval mode may run another graph on the training program's stages
                        programs[mode] = program_for(plan, gm, self.module, self.layout.dp_size,
                                                     train=None if mode else programs.get(True))
                    except SplitError as err:
                        if mode:
                            raise
                        errors[mode] = str(err)
                        continue
                    flat[mode] = flatten_inputs(gm, micro_args, micro_kwargs)
        finally:
            self.module.train(was_training)
        ownership = Ownership(self.module, programs[True], [p.gm for p in programs.values()],
                              rank=self.pp_rank if self.distributed else None)
        try:
            replaced = materialize(self.module, [p.gm for p in programs.values()], ownership.local_ids, self.device,
                                   source=self.checkpoint, init_fn=self.init_fn, seed=self.init_seed)
        except (MaterializeError, CheckpointError) as err:
            raise RuntimeConfigError(f"rank {self.rank}: {err}") from None
        ownership.rekey(replaced)
        comm = Comm(self.pp_rank, self.timeout, [plan.schedule.stages_of(r) for r in range(plan.pipeline_ranks)],
                    global_ranks=self.layout.pp_ranks, note=self._together.note) if self.distributed else None
        self._together.comm = comm
        return _SetUp(programs, errors, ownership, comm, self.device, flat)

    def _make_plan(self, args: tuple, kwargs: dict) -> Plan:
        request = self.request.with_(stages=self.stages, training=True, data_parallel=self.layout.dp_size,
                                     placement=self.layout.placement)
        if request.profiling.dtype is None and self.precision.dtype is not None:
            # priced as the stages run: a model on meta (deferred initialization) is walked under autocast on
            # fake tensors (autocast has no meta kernels); on a device the stages' autocast below already is on
            request = request.with_(dtype=self.precision.name)

        def build() -> Plan:
            # profiling runs the model; keep every rank's RNG stream identical to the others'. Under the stages'
            # autocast: the profile then records what autograd saves in that precision (bf16 activations, the
            # bf16 copies of the fp32 weights autocast makes for each microbatch) and prices ops in its dtype.
            with torch.random.fork_rng(devices=[]), self.precision.autocast(self.device):
                return make_plan(self.module, args, kwargs, request, tp_plan=self.tp_plan)

        store = dist.distributed_c10d._get_default_store() if self.distributed else None
        return plan_on_rank0(build, rank=self.rank, store=store, timeout=self.timeout, note=self._together.note)

    def prepare(self, *args: Any, **kwargs: Any) -> PipelinedModel:
        """Partition now, on this sample batch (plan, trace, keep and materialize this rank's stages), without a step.

        For what needs this rank's parameters before the first step: an optimizer that
        holds only them, ``load_checkpoint``. Every rank must call it (planning may broadcast).
        """
        with self._together.collective("prepare()", "call it on every rank"):
            self._ensure(args, kwargs)
        return self

    def prepare_microbatches(self, micro: Microbatches) -> PipelinedModel:
        """:meth:`prepare` on microbatches the caller holds (traced on the first as it will run); needs ``plan=``."""
        if self._plan is None:
            raise RuntimeConfigError("prepare_microbatches() partitions by a plan made already: pass plan=... to "
                                     "smp.partition, or prepare(*batch) to plan on the whole batch")
        with self._together.collective("prepare_microbatches()", "call it on every rank"):
            self._ensure((), {}, first=micro.inputs[0])
        return self

    # ------------------------------------------------------------------ running

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """One training step on the full batch; returns the mean loss over microbatches on every rank.

        The loss of a microbatch is ``loss_fn(output, target)`` on its slice of ``target``, or
        ``loss_fn(output, None)`` when no target is given (a loss that needs none).
        """
        self._need_loss()
        self._ensure(args, kwargs)
        return self.step_microbatches(self._cut(args, kwargs, target))

    def step_microbatches(self, micro: Microbatches) -> torch.Tensor:
        """:meth:`step` on microbatches the caller already holds (``runtime.batch.Microbatches``, as many as
        the plan's), e.g. one per call of a step function; the pipeline must be partitioned (a first step, or
        :meth:`prepare`)."""
        self._need_loss()
        eng = self._engine_for(micro)  # a failure in the step is told by the engine (Engine._run_rank)
        if self.broadcast_buffers and self.dp_size > 1:
            self._broadcast_buffers()
        flat = micro.flat(eng.program.gm)
        targets = list(micro.targets) if micro.targets is not None else None
        scaler = self.grad_scaler
        if scaler is None:
            loss, _ = eng.run(flat, targets, self.loss_fn, training=True)
            assert loss is not None
            return loss
        # fp16: this step's gradients are made scaled, apart from any the caller accumulated before it
        params = list(self.parameters())
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        eng.loss_scale = scaler.scale
        loss, _ = eng.run(flat, targets, self.loss_fn, training=True)
        assert loss is not None
        fresh = [local(p.grad) for p in params if p.grad is not None]  # sharded: each rank checks its shard
        self.last_step_skipped = scaler.unscale_and_check(fresh, self.any_rank)
        for p, old in zip(params, before):
            if self.last_step_skipped:  # no gradient anywhere: optimizer.step() changes nothing on any rank
                p.grad = None
            elif old is not None:
                p.grad = old + p.grad if p.grad is not None else old
        return loss

    def _broadcast_buffers(self) -> None:
        """The first replica's buffers (batch-norm statistics) to the others, as DistributedDataParallel's
        ``broadcast_buffers`` does before each step: replicas would otherwise drift apart on their own data."""
        comm = self._require_setup("the buffer broadcast").comm
        assert comm is not None
        group = self.layout.dp_group
        src = dist.get_process_group_ranks(group)[0]
        for name, buffer in sorted((n, b) for n, b in self.module.named_buffers() if not b.is_meta):
            comm.wait(comm.broadcast(buffer, src, group, f"the broadcast of buffer {name} from the first replica"))

    def any_rank(self, flag: torch.Tensor) -> torch.Tensor:
        """The maximum of ``flag`` (one number) over every rank of the world, waited for within the pipeline's
        timeout (a rank that does not come is named): e.g. whether any rank found inf/NaN in its fp16 gradients.
        A collective once partitioned; ``flag`` itself without a process group."""
        if not self.distributed:
            return flag
        setup = self._require_setup("the overflow check")
        assert setup.comm is not None
        buf = flag.to(self.device).reshape(1).clone()
        return setup.comm.wait(setup.comm.all_reduce(buf, dist.group.WORLD, "the fp16 overflow check over every rank",
                                                     op=dist.ReduceOp.MAX))[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipelined pass (no gradients). The output is returned on the rank holding the
        output stage (every rank in a single process); the other ranks get None. A collective."""
        with self._together.collective("pipe(x)", "call it on every rank: its output comes back on the rank "
                                                  "holding the last stage (on every rank with broadcast_output=True)"):
            self._ensure(args, kwargs)
            outputs = self.forward_microbatches(self._cut(args, kwargs))
            output = join_outputs(outputs) if outputs else None
            if self.broadcast_output and self.distributed:
                box = [output]
                dist.broadcast_object_list(box, src=self.layout.pp_ranks[self._engine.out_rank],  # type: ignore[union-attr]
                                           group=self.layout.pp_group)
                output = box[0]
        return output

    forward = __call__

    def forward_microbatches(self, micro: Microbatches) -> list[Any] | None:
        """Each microbatch's output of a forward-only pass (no gradients) on the rank holding the output stage
        (every rank in one process); None on the others. The pipeline must be partitioned."""
        eng = self._engine_for(micro)
        with torch.no_grad():
            _, outputs = eng.run(micro.flat(eng.program.gm), None, None, training=False)
        return outputs or None

    def _need_loss(self) -> None:
        if self.loss_fn is None:
            raise RuntimeConfigError("step() trains and needs a loss: pass loss_fn=... to smp.partition "
                                     "(a function (output, target) -> scalar tensor)")

    def _cut(self, args: tuple, kwargs: dict, target: Any = None) -> Microbatches:
        """The batch cut into the plan's microbatches (runtime.batch, the one place that cuts)."""
        try:
            return Microbatches.cut(args, kwargs, self._plan.microbatches, target)  # type: ignore[union-attr]
        except MicrobatchError as err:
            raise RuntimeConfigError(str(err)) from None

    def _engine_for(self, micro: Microbatches) -> Engine:
        """The engine of the current mode, for as many microbatches as the plan's."""
        if self._setup is None:
            raise RuntimeConfigError("running microbatches needs the model partitioned: run prepare(*batch) first")
        m = self._plan.microbatches  # type: ignore[union-attr]
        if len(micro) != m:
            raise RuntimeConfigError(f"{len(micro)} microbatches given, and the plan runs {m} a step")
        return self._ensure((), {})

    # ------------------------------------------------------------------ parameters and state

    def _require_setup(self, what: str) -> _SetUp:
        if self._setup is None:
            raise RuntimeConfigError(f"{what} needs the model partitioned: run a first step(), or prepare(*batch)")
        return self._setup

    def _need_engine(self, what: str) -> Engine:
        if self._engine is None:
            if self._plan is None:
                raise RuntimeConfigError(
                    f"{what} needs the model to be partitioned, which happens on the first step() (plan=None): "
                    "run one step first, or pass plan=... to smp.partition")
            raise RuntimeConfigError(f"{what} needs a first step() or call to build the stages")
        return self._engine

    def named_parameters(self, rank: int | None = None) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, with the original model's names (a tied parameter under its first name).

        Before partitioning (lazy planning) this is every parameter of the model. ``rank``:
        only those pipeline rank ``rank`` holds (one process holding every rank, e.g. to give
        each rank its own optimizer as separate processes would).
        """
        holders = self._require_setup("named_parameters(rank=...)").ownership.holders if rank is not None else None
        for name, p in self.module.named_parameters():
            if not p.is_meta and (holders is None or rank in holders.get(id(p), ())):  # meta: another rank's
                yield name, p

    def parameters(self, rank: int | None = None) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters(rank):
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

    # ------------------------------------------------------------------ measurements

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None,
                     step_meter: OptimizerStepMeter | None = None) -> dict[int, dict[str, int]]:
        """What each rank in this process holds, in bytes, counted exactly: parameters, gradients, optimizer
        state, buffers, and the peak of stashed activations during the last step (``activations_peak``);
        with replicas also the all-reduce's ``buckets`` or, sharded, what the step held whole
        (``gathered_peak``, ``whole_grads_peak``: :func:`runtime.memory.rank_memory`).
        With ``step_meter`` (a :class:`runtime.memory.OptimizerStepMeter` made on ``optimizer``
        before the steps) also the last optimizer step's workspace (``optimizer_step_peak``); the
        ``total`` holds the larger of it and the activations, as the plan counts them.

        On a GPU ``cuda_max_allocated`` adds the allocator's peak. In one process every
        rank of the plan is reported (a tied parameter under each rank that holds it).
        """
        setup = self._require_setup("memory_stats()")
        eng = self._engine
        ranks = range(self._plan.pipeline_ranks) if not self.distributed else [self.pp_rank]  # type: ignore[union-attr]
        return {r: rank_memory(self.module, setup.ownership, r, optimizer,
                               eng.stash_peak.get(r, 0) if eng is not None else 0, step_meter,
                               working=eng.shards.working_peak if eng is not None and eng.shards is not None else None,
                               buckets=eng.bucket_bytes.get(r, 0) if eng is not None else 0) for r in ranks}


    def timeline(self, gather: bool = False) -> Timeline:
        """Measured start/end of every compute action of the last step (the simulator's Timeline format).

        This rank's actions; with ``gather=True`` (a collective) every rank's, on one
        clock (perf_counter is one monotonic clock for all processes of a machine).
        """
        eng = self._need_engine("timeline()")
        if not (gather and self.distributed):
            return eng.timeline()
        mine = ([e.to_dict() for e in eng.events], eng.step_start, eng.step_end)
        parts: list[Any] = [None] * self.layout.pp_size
        dist.all_gather_object(parts, mine, group=self.layout.pp_group)
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


@dataclass
class _SetUp:
    """What partitioning made once: each mode's program (or why it has none), ownership, comm, device."""

    programs: dict[bool, Program]
    errors: dict[bool, str]
    ownership: Ownership
    comm: Comm | None
    device: torch.device
    example_flat: dict[bool, list[Any]]
