"""The pipeline engine: executes a schedule's action lists on stage programs (this rank's, or every rank's in one process)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from partitioner.buckets import gradient_buckets
from partitioner.ir import Action, ActionKind, Schedule, ScheduleError
from partitioner.recompute import OFFLOAD
from partitioner.timeline import Timeline, TimelineEvent
from partitioner.walk import validate, walk
from runtime.comm import Comm, LocalComm, Pending
from runtime.compiled import compile_stages
from runtime.errors import PipelineError, RuntimeConfigError
from runtime.precision import Precision
from runtime.offload import kept_storages, offloading
from runtime.program import Ownership, Program
from runtime.recompute import forward_for_recompute, recompute
from runtime.sharding import StageShards, local
from runtime.tensor_parallel import SequenceGrads, TensorParallel, check_sequence_length, settled
from runtime.tied import sum_tied_grads
from runtime.split import OUTPUT_KEY, SplitError, SplitProgram, ValueMeta, propagate_meta, split_program
from runtime.stash import EdgeKey, Stash, StashMeter

__all__ = ["Engine"]


@dataclass
class _StepMeta:
    """Per batch shape: every cut value's leaves, and the tags of every transfer."""

    values: dict[str, ValueMeta]
    leaves_per_edge: dict[EdgeKey, list[tuple[tuple[int, ...], torch.dtype]]]
    max_leaves: int


class Engine:
    """Executes one traced program's schedule: this rank's action list, or (``comm`` None) every rank's in one process.

    One process walks all ranks' lists in the order the validator's walk proves runnable
    (:attr:`partitioner.walk.Walk.sequence`), each rank with its own mailboxes and a
    :class:`LocalComm` for its transfers: the same interpreter, action by action, as a
    multi-rank run over torch.distributed.

    With data-parallel replicas (``dp_group`` of ``dp_size`` ranks, the same pipeline rank
    of every replica) each stage's gradients are averaged over them in buckets
    (:mod:`partitioner.buckets`, in backward order), waited for at the end of the step; a
    bucket is launched as soon as the stage's final backward has made all of its gradients
    final (when the schedule's walk says its ALLREDUCE overlaps that B: ``Walk.overlapped``),
    else at the ALLREDUCE action. The step's loss is the mean over the replicas.

    Each stage's forward runs under ``precision``'s autocast and, when training, as its
    ``program.recompute`` choice says (runtime/recompute.py; "offload": runtime/offload.py). ``loss_scale`` multiplies the
    loss the backward starts from (fp16 loss scaling; the caller unscales).

    Sharded replicas (the schedule's ``sharding`` is not "none", ``shard_mesh`` the replicas'
    1-D mesh): this rank's stage programs run under FSDP2 (:class:`runtime.sharding.StageShards`),
    whose hooks gather the parameters for each forward and backward; a stage's REDUCE_SCATTER
    reduce-scatters its gradients. ``gathered_by``: the training engine whose sharded
    parameters this engine's programs read (an eval-mode trace), gathered for each run.
    ``compile_backend``: the stage programs run compiled with it (runtime/compiled.py); None: eagerly.

    ``tensor_parallel`` (:class:`runtime.tensor_parallel.TensorParallel`): the stage programs run on
    this rank's shares of the plan's modules; a split cut value crosses as this rank's shard (sequence parallelism:
    :class:`runtime.tensor_parallel.SequenceGrads`).
    """

    def __init__(self, program: Program, ownership: Ownership, *, rank: int = 0, comm: Comm | None = None,
                 device: torch.device, example_flat: Sequence[Any], dp_group: Any = None,
                 dp_size: int = 1, precision: Precision = Precision("fp32"), shard_mesh: Any = None,
                 gathered_by: StageShards | None = None, compile_backend: str | None = None,
                 tensor_parallel: TensorParallel | None = None) -> None:
        self.program = program
        self.precision = precision
        self.loss_scale = 1.0
        self.ownership = ownership
        self.rank = rank
        self.comm = comm
        self.single = comm is None
        self.dp_group = dp_group
        self.dp_size = dp_size
        sch = program.schedule
        try:
            validate(sch)
        except ScheduleError as err:
            raise RuntimeConfigError(f"the plan's schedule cannot run: {err}") from None
        self.schedule = sch
        self.s2r = list(sch.stage_to_rank)
        self.m = sch.num_microbatches
        self.device = device
        self.my_stages = list(range(sch.num_stages)) if self.single else sch.stages_of(rank)
        self.edges: list[EdgeKey] = [e.key for e in sch.graph.edges]
        self.edge_index = {k: i for i, k in enumerate(self.edges)}
        self.in_edges = {s: [k for k in self.edges if k[1] == s] for s in range(sch.num_stages)}
        self.out_edges = {s: [k for k in self.edges if k[0] == s] for s in range(sch.num_stages)}
        try:
            self.split: SplitProgram = split_program(program.gm, program.fx_stage_of, sch.num_stages, self.edges,
                                                     self.my_stages, program.fx_to_op)
        except SplitError as err:
            raise RuntimeConfigError(str(err)) from None
        self.out_rank = self.s2r[self.split.output_stage]
        self.tp, self.tp_acts = tensor_parallel, None  # tp_acts: which values are split over the tp ranks
        if tensor_parallel is not None:
            self.tp_acts, replaced = tensor_parallel.split_stages(program, list(self.split.stages.values()),
                                                                  example_flat, device, precision)
            ownership.rekey(replaced)
        self.sequence_grads = SequenceGrads.of(self.tp_acts, tensor_parallel)
        # split over "tp" first, then sharded over "dp" of the same mesh: FSDP2 shards TP's DTensors (torchtitan's
        # 2-D order; the other way round, parallelize_module would meet FSDP's DTensors)
        self.shards: StageShards | None = None
        self.gathered_by = gathered_by
        if shard_mesh is not None and sch.sharding != "none" and not self.single:
            self.shards = StageShards(sch.sharding, shard_mesh, {s: sp.gm for s, sp in self.split.stages.items()},
                                      ownership.canonical)
        self.compiled = compile_stages(self.split.stages, program.recompute, compile_backend,
                                       split_backward=sch.split_backward, sharded=self.shards is not None) \
            if compile_backend is not None else {}
        self.reduced_by = self._reducing_stages()
        self.buckets = {s: [[ps[i] for i in group] for group in gradient_buckets(
            [local(p).numel() * p.element_size() for p in ps], [p.dtype for p in ps])]
            for s, ps in ((s, ps[::-1]) for s, ps in self.reduced_by.items())}  # later layers' gradients first
        w = walk(sch)
        self.overlapped = {w.actions[b].stage: w.actions[b].mb for b in w.overlapped.values()
                           if w.rank[b] == rank and w.actions[b].stage in self.buckets}
        self._meta_cache: dict[Any, _StepMeta] = {}
        self._traced_key = _shape_key(example_flat)
        self.events: list[TimelineEvent] = []
        self.executed: dict[int, list[Action]] = {}
        self.stash_peak: dict[int, int] = {}  # rank -> peak stashed activation bytes of the last step
        self.bucket_launches: list[tuple[int, int, str]] = []  # (stage, bucket, during which action), last step
        self.stash_kept: dict[int, int] = {}  # stage -> bytes one microbatch kept from its forward (last step)
        self.bucket_bytes: dict[int, int] = {}  # rank -> bytes of its all-reduce's flat buckets (last step)
        self.step_start = 0.0
        self.step_end = 0.0

    def _reducing_stages(self) -> dict[int, list[nn.Parameter]]:
        """Stage -> the parameters its ALLREDUCE reduces: each parameter of this rank once, by the last of its
        stages to reduce (a weight two stages of one rank share is final only after both)."""
        if self.single or self.dp_size < 2 or self.shards is not None:  # sharded: FSDP reduces
            return {}
        order = [a.stage for a in self.schedule.actions[self.rank] if a.kind is ActionKind.ALLREDUCE]
        last: dict[int, int] = {}
        for s in order:
            for i in self.ownership.stage_param_ids.get(s, ()):
                last[i] = s
        out: dict[int, list[nn.Parameter]] = {s: [] for s in order}
        # in the model's parameter order: every replica must put the same gradients in the same buckets
        for p in self.ownership.model.parameters():
            if id(p) in last and not p.is_meta and p.requires_grad:
                out[last[id(p)]].append(p)
        return out

    # ------------------------------------------------------------------ shapes

    def _step_meta(self, flat: Sequence[Any]) -> _StepMeta:
        key = _shape_key(flat)
        cached = self._meta_cache.get(key)
        if cached is not None:
            return cached
        if self.program.frontend == "export" and key != self._traced_key:
            raise RuntimeConfigError(
                f"this model was traced with torch.export, which fixes the shapes: it runs microbatches of input "
                f"shapes {[k[0] for k in self._traced_key]}, not {[k[0] for k in key]}. Keep the batch shape fixed "
                "(e.g. DataLoader(drop_last=True), pad sequences), or make a new PipelinedModel for the new shape.")
        acts = self.tp_acts
        wanted = set(self.split.value_src) | (acts.rowwise_scatter if acts is not None else set())
        try:  # under the stages' autocast: a value made in bf16 crosses the link in bf16
            with self.precision.autocast(self.device), \
                    self.tp.hooks_off() if self.tp is not None else contextlib.nullcontext():
                values = propagate_meta(self.program.gm, flat, wanted, self.program.state_meta, self.device)
        except Exception as err:  # noqa: BLE001
            raise RuntimeConfigError(
                f"could not derive the shapes of the cut tensors for a microbatch of input shapes "
                f"{[k[0] for k in key]}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. "
                "The program's shapes must follow from its input shapes (no data-dependent shapes); "
                "an export-traced program only accepts the shapes it was traced with.") from None
        for name, (src, dst) in self.split.no_edge.items():
            if values[name].tensor_leaves():
                raise RuntimeConfigError(
                    f"value {name} is made on stage {src} and read on stage {dst}, but the plan has no edge for it: "
                    "the plan does not describe this program; re-plan")
        check_sequence_length(acts, values)
        per_edge: dict[EdgeKey, list[tuple[tuple[int, ...], torch.dtype]]] = {}
        for k in self.edges:  # a split value crosses as this rank's shard
            per_edge[k] = [(acts.local_shape(v, i, leaf.shape) if acts is not None else leaf.shape, leaf.dtype)
                           for v in self.split.edge_values.get(k, ())
                           for i, leaf in enumerate(values[v].leaves) if leaf.is_tensor]
        meta = _StepMeta(values, per_edge, max([1] + [len(v) for v in per_edge.values()]))
        self._meta_cache[key] = meta
        return meta

    def tag(self, meta: _StepMeta, key: EdgeKey, mb: int, backward: bool, leaf: int) -> int:
        return ((self.edge_index[key] * 2 + int(backward)) * self.m + mb) * meta.max_leaves + leaf

    def _special_tag(self, meta: _StepMeta, i: int) -> int:
        return len(self.edges) * 2 * self.m * meta.max_leaves + i

    # ------------------------------------------------------------------ one step

    def run(self, micro_flat: list[list[Any]], targets: list[Any] | None, loss_fn: Callable[..., Any] | None,
            training: bool) -> tuple[torch.Tensor | None, list[Any]]:
        """Run every microbatch through the schedule (its forward alone when not ``training``).

        Returns (mean loss over microbatches, float32, on every rank, when training; the
        microbatch outputs, on the rank holding the output stage).
        """
        meta = self._step_meta(micro_flat[0])
        schedule = self.schedule if training else self.schedule.forward()
        self.events = []
        self.executed = {}
        self.bucket_launches = []
        self.step_start = time.perf_counter()
        if self.shards is not None and training:
            self.shards.start_step()
        with self.gathered_by.gathered([sp.gm for sp in self.split.stages.values()]) \
                if self.gathered_by is not None else contextlib.nullcontext():
            if self.single:
                loss, outputs = self._run_single(schedule, meta, micro_flat, targets, loss_fn, training)
            else:
                loss, outputs = self._run_rank(schedule, meta, micro_flat, targets, loss_fn, training)
        if self.shards is not None and not training:  # no backward freed what the forwards gathered
            self.shards.reshard_all()
        self.step_end = time.perf_counter()
        return loss, outputs

    def _run_single(self, schedule: Schedule, meta: _StepMeta, micro_flat: list[list[Any]],
                    targets: list[Any] | None, loss_fn: Callable[..., Any] | None, training: bool
                    ) -> tuple[torch.Tensor | None, list[Any]]:
        mailbox: dict[tuple[int, int, int], torch.Tensor] = {}
        states = [_RankState(self, r, LocalComm(r, mailbox), meta, micro_flat, targets, loss_fn, training)
                  for r in range(schedule.num_ranks)]
        w = walk(schedule)
        for i in w.sequence:
            states[w.rank[i]].do(w.actions[i])
        for st in states:
            st.finish()
        out = states[self.out_rank]
        return (out.mean_loss() if training else None), out.outputs

    def _run_rank(self, schedule: Schedule, meta: _StepMeta, micro_flat: list[list[Any]],
                  targets: list[Any] | None, loss_fn: Callable[..., Any] | None, training: bool
                  ) -> tuple[torch.Tensor | None, list[Any]]:
        assert self.comm is not None
        st = _RankState(self, self.rank, self.comm, meta, micro_flat, targets, loss_fn, training)
        try:
            with self.sequence_grads.summed(self.ownership, self.comm) if self.sequence_grads is not None and \
                    training else contextlib.nullcontext():
                for a in schedule.actions[self.rank]:
                    st.do(a)
                st.finish()
            loss = self._share_loss(meta, st.mean_loss()) if training else None
            if training:
                sum_tied_grads(self.comm, self.ownership, self.rank, lambda j: self._special_tag(meta, 1 + j))
                if self.dp_size > 1:  # the mean over every replica's batch
                    pend = self.comm.all_reduce(loss.clone(), self.dp_group, "the loss mean over the replicas")
                    loss = self.comm.wait(pend)[0] / self.dp_size
        except PipelineError:
            raise
        except Exception as err:
            self.comm.report_failure(f"rank {self.comm.me} raised {type(err).__name__}: "
                                     f"{str(err).splitlines()[0] if str(err) else ''} during {st.current}")
            raise
        return loss, st.outputs

    def _share_loss(self, meta: _StepMeta, loss: torch.Tensor | None) -> torch.Tensor:
        """The output rank's mean loss, sent to every other rank; float32 everywhere."""
        assert self.comm is not None
        tag = self._special_tag(meta, 0)
        ranks = self.schedule.num_ranks
        if self.rank == self.out_rank:
            assert loss is not None
            buf = loss.detach().reshape(1).to(torch.float32)
            works = [Pending([self.comm.isend(buf, r, tag)], [buf], "the loss broadcast", r)
                     for r in range(ranks) if r != self.rank]
            for w in works:
                self.comm.wait(w)
            return buf.reshape(())
        buf = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.comm.wait(Pending([self.comm.irecv(buf, self.out_rank, tag)], [buf],
                               "the loss of the step", self.out_rank))
        return buf.reshape(())

    # ------------------------------------------------------------------ timeline

    def timeline(self, events: Sequence[TimelineEvent] | None = None, step_time: float | None = None) -> Timeline:
        evs = list(self.events if events is None else events)
        t0 = self.step_start
        norm = [TimelineEvent(e.rank, e.stage, e.kind, e.mb, e.start - t0, e.end - t0) for e in evs]
        return Timeline(norm, step_time if step_time is not None else self.step_end - self.step_start, "measured",
                        self.schedule.num_ranks, {"schedule": self.schedule.name, "microbatches": self.m})


def _on(value: Any, device: torch.device) -> Any:
    """A batch tensor on the device the stages run on (the batch arrives wherever the script made it)."""
    return value.to(device) if isinstance(value, torch.Tensor) and value.device != device else value


def _shape_key(flat: Sequence[Any]) -> tuple:
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("c", repr(x)) for x in flat)


class _RankState:
    """One rank's mailboxes, stashes and pending transfers during one step, and the actions that use them."""

    def __init__(self, eng: Engine, rank: int, comm: Any, meta: _StepMeta, micro_flat: list[list[Any]],
                 targets: list[Any] | None, loss_fn: Callable[..., Any] | None, training: bool) -> None:
        self.eng = eng
        self.rank = rank
        self.comm = comm
        self.meta = meta
        self.flat = micro_flat
        self.targets = targets
        self.loss_fn = loss_fn
        self.training = training
        self.fwd_box: dict[tuple[EdgeKey, int], list[torch.Tensor]] = {}
        self.bwd_box: dict[tuple[EdgeKey, int], list[torch.Tensor | None]] = {}
        self.to_send_f: dict[tuple[EdgeKey, int], list[torch.Tensor]] = {}
        self.to_send_b: dict[tuple[EdgeKey, int], list[torch.Tensor | None]] = {}
        self.recv_f: dict[tuple[EdgeKey, int], Pending] = {}
        self.recv_b: dict[tuple[EdgeKey, int], Pending] = {}
        self.sends: list[Pending] = []
        self.reductions: list[tuple[Pending, list[torch.Tensor], list[torch.Tensor]]] = []
        self.launched: dict[int, int] = {}  # stage -> how many of its gradient buckets are on their way
        self.zero_filled: list[torch.Tensor] = []  # parameters no op used: a zero gradient only for the all-reduce
        self.stash: dict[tuple[int, int], Stash] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: list[Any] = []
        self._outputs: dict[int, Any] = {}
        self.executed = eng.executed.setdefault(rank, [])
        # parameters, buffers and the batch (inputs and targets, which the script holds anyway) are no activations
        model = eng.ownership.model
        batch = [t for t in pytree.tree_leaves((micro_flat, targets)) if isinstance(t, torch.Tensor)]
        # FSDP's gathered parameters are parameters too, wherever (and while) they are allocated
        self.meter = StashMeter({local(t).untyped_storage().data_ptr()
                                 for t in [*model.parameters(), *model.buffers(), *batch] if not t.is_meta},
                                None if eng.shards is None else eng.shards.holds_gathered)
        self.current = "the step set-up"

    def _local(self, key: EdgeKey) -> bool:
        return self.eng.s2r[key[0]] == self.eng.s2r[key[1]]

    def do(self, a: Action) -> None:
        self.current = str(a)
        self.executed.append(a)
        kind = a.kind
        if kind is ActionKind.F:
            self.forward(a.stage, a.mb)
        elif kind is ActionKind.B:
            self.backward(a.stage, a.mb)
        elif kind is ActionKind.W:
            self.weights(a.stage, a.mb)
        elif kind is ActionKind.SEND_F:
            self._send(a, self.to_send_f.pop((a.edge, a.mb)), backward=False)
        elif kind is ActionKind.SEND_B:
            self._send(a, self.to_send_b.pop((a.edge, a.mb)), backward=True)
        elif kind is ActionKind.RECV_F:
            self.recv_f[(a.edge, a.mb)] = self._post_recv(a, backward=False)
        elif kind is ActionKind.RECV_B:
            self.recv_b[(a.edge, a.mb)] = self._post_recv(a, backward=True)
        elif kind is ActionKind.ALLREDUCE:
            self._all_reduce(a.stage)
        elif kind is ActionKind.REDUCE_SCATTER and self.eng.shards is not None:
            self.eng.shards.reduce(a.stage)
        # ALLGATHER / ALLGATHER_B: FSDP2's pre-forward and pre-backward hooks gather the stage's parameters at
        # the F or B the action precedes (the schedule says where, for the simulator and the timeline)

    def finish(self) -> None:
        """Wait for this rank's sends (their tensors were kept alive until now) and gradient all-reduces; gather
        its outputs."""
        for pend in self.sends:
            self.comm.wait(pend)
        self.sends = []
        # every bucket is alive here, from its launch to the step's end (the plan's ``buckets``)
        self.eng.bucket_bytes[self.rank] = sum(flat.untyped_storage().nbytes() for _, flat, _ in self.reductions)
        for pend, flat, grads in self.reductions:
            self.comm.wait(pend)
            flat /= self.eng.dp_size
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        self.reductions = []
        for p in self.zero_filled:  # unused on every replica (one traced program): no gradient, as with one
            p.grad = None
        self.zero_filled = []
        self.outputs = [self._outputs[k] for k in sorted(self._outputs)]
        self.eng.stash_peak[self.rank] = self.meter.peak
        self.eng.stash_kept.update(self.meter.kept)

    def _all_reduce(self, stage: int) -> None:
        """Launch the sum of this stage's final gradients over the replicas: the buckets not on their way yet."""
        for p in self.eng.reduced_by.get(stage, []):
            if p.grad is None:  # every replica must send the same buckets: a missing gradient is a zero one
                p.grad = torch.zeros_like(p)
                self.zero_filled.append(p)
        self._launch(stage, len(self.eng.buckets.get(stage, [])))

    def _launch(self, stage: int, upto: int) -> None:
        """Launch the stage's buckets in order, up to (not including) bucket ``upto``; averaged in ``finish``."""
        buckets = self.eng.buckets[stage]
        while self.launched.get(stage, 0) < upto:
            k = self.launched.get(stage, 0)
            grads = [local(p.grad) for p in buckets[k]]  # tensor parallel: this rank's shards
            flat = torch._utils._flatten_dense_tensors(grads)
            pend = self.comm.all_reduce(flat, self.eng.dp_group, f"the gradient all-reduce of stage {stage}")
            self.reductions.append((pend, flat, grads))
            self.launched[stage] = k + 1
            self.eng.bucket_launches.append((stage, k, self.current))

    def _reducing_backward(self, stage: int) -> list[Any]:
        """Hooks that launch each bucket of ``stage`` once the running backward has made its gradients final.

        Buckets go in their fixed order (every replica launches the same ones in the same
        order, as DistributedDataParallel's reducer does): a bucket waits for the earlier ones.
        """
        buckets = self.eng.buckets[stage]
        ready: set[int] = set()

        def on_grad(p: torch.Tensor) -> None:
            ready.add(id(p))
            upto = self.launched.get(stage, 0)
            while upto < len(buckets) and all(id(q) in ready for q in buckets[upto]):
                upto += 1
            self._launch(stage, upto)

        return [p.register_post_accumulate_grad_hook(on_grad) for bucket in buckets for p in bucket]

    # -------------------------------------------------------------- transfers

    @staticmethod
    def _differentiable(dtype: torch.dtype) -> bool:
        return dtype.is_floating_point or dtype.is_complex

    def _send(self, a: Action, tensors: list[torch.Tensor | None], backward: bool) -> None:
        key = a.edge
        peer = self.eng.s2r[a.peer]  # type: ignore[index]
        works, keep = [], []
        for i, t in enumerate(tensors):
            if t is None:  # a non-differentiable leaf: its gradient is not sent (both sides know)
                continue
            t = t.detach().contiguous()
            keep.append(t)
            works.append(self.comm.isend(t, peer, self.eng.tag(self.meta, key, a.mb, backward, i), str(a)))
        self.sends.append(Pending(works, keep, str(a), peer))

    def _post_recv(self, a: Action, backward: bool) -> Pending:
        key = a.edge
        peer = self.eng.s2r[a.peer]  # type: ignore[index]
        works, bufs = [], []
        for i, (shape, dtype) in enumerate(self.meta.leaves_per_edge[key]):
            if backward and not self._differentiable(dtype):
                bufs.append(None)
                continue
            buf = torch.empty(shape, dtype=dtype, device=self.eng.device)
            bufs.append(buf)
            works.append(self.comm.irecv(buf, peer, self.eng.tag(self.meta, key, a.mb, backward, i), str(a)))
        return Pending(works, bufs, str(a), peer)  # type: ignore[arg-type]

    def _take(self, box: dict, posted: dict, key: EdgeKey, mb: int) -> list[Any]:
        if (key, mb) in box:
            return box.pop((key, mb))
        pend = posted.pop((key, mb), None)
        if pend is None:  # the validator refuses a list that uses data it has not received
            raise RuntimeError(f"rank {self.rank}: no receive was posted for {key} mb={mb} before its use; the "
                               "schedule passed validation, so this is a bug in smp")
        return self.comm.wait(pend)

    # -------------------------------------------------------------- compute

    def _event(self, kind: str, stage: int, mb: int, t0: float) -> None:
        self.eng.events.append(TimelineEvent(self.rank, stage, kind, mb, t0, time.perf_counter()))

    def _inputs(self, s: int, mb: int) -> tuple[dict[EdgeKey, list[torch.Tensor]], dict[EdgeKey, list[torch.Tensor | None]]]:
        """What stage ``s`` receives for microbatch ``mb``, per in-edge: the tensors it runs on (differentiable ones
        as leaves that require grad when training), and those leaves (None for the others)."""
        received: dict[EdgeKey, list[torch.Tensor]] = {}
        leaves_in: dict[EdgeKey, list[torch.Tensor | None]] = {}
        for key in self.eng.in_edges[s]:
            got, leaves = [], []
            for t in self._take(self.fwd_box, self.recv_f, key, mb):
                if self.training and self._differentiable(t.dtype):
                    x = t.detach().requires_grad_(True)
                    got.append(x)
                    leaves.append(x)
                else:
                    got.append(t.detach())
                    leaves.append(None)
            received[key], leaves_in[key] = got, leaves
        return received, leaves_in

    def _args(self, s: int, mb: int, received: Mapping[EdgeKey, list[torch.Tensor]]) -> list[Any]:
        """The stage's call arguments: model inputs, then the received values rebuilt from their tensors."""
        eng = self.eng
        prog = eng.split.stages[s]
        values = self.meta.values
        rebuilt: dict[str, Any] = {}
        for key, tensors in received.items():
            it = iter(tensors)
            for v in eng.split.edge_values.get(key, ()):
                ts = [next(it) for _ in values[v].tensor_leaves()]
                # in-place ops on a leaf that requires grad are illegal (and a rerun needs the value unchanged)
                rebuilt[v] = values[v].rebuild([t.clone() for t in ts] if v in prog.mutated_inputs else ts)
        args = [_on(self.flat[mb][i], eng.device) for i in prog.input_index]
        args += [rebuilt[v] if v in rebuilt else values[v].rebuild([]) for v in prog.external]
        return args

    def _choice(self, s: int) -> str:
        rec = self.eng.program.recompute
        return rec[s] if self.training and rec else "none"

    def forward(self, s: int, mb: int) -> None:
        eng = self.eng
        prog = eng.split.stages[s]
        received, leaves_in = self._inputs(s, mb)
        args = self._args(s, mb, received)
        choice = self._choice(s)
        run = eng.compiled.get(s, prog.gm)
        rerun = None
        t0 = time.perf_counter()
        with torch.set_grad_enabled(self.training), self.meter.saving((s, mb)), eng.precision.autocast(eng.device):
            if choice == "none":
                res = run(*args)
            elif choice == OFFLOAD:  # as none, what autograd saves copied to host memory (runtime/offload.py)
                kept = kept_storages([t for ts in received.values() for t in ts])
                with offloading(eng.device, lambda ptr: ptr in kept or self.meter.is_excluded(ptr),
                                lambda t: self.meter.add((s, mb), t)):
                    res = run(*args)
            else:
                shards = self._selective_shards(s)
                if shards is not None:
                    shards.gather(s)
                res, rerun = forward_for_recompute(run, args, choice, eng.program.matmul_nodes, eng.device,
                                                   lambda t: self.meter.add((s, mb), t))
                if shards is not None:
                    shards.release(s)
            loss = self._output(res, mb) if prog.has_output else None
        self._event("F", s, mb, t0)
        outs = self._outs(s, res)
        for key, tensors in outs.items():
            if self._local(key):
                self.fwd_box[(key, mb)] = tensors
            else:
                self.to_send_f[(key, mb)] = tensors
        if self.training:
            self.stash[(s, mb)] = Stash(leaves_in, outs, loss, rerun=rerun,
                                         received=received if rerun is not None else {})
            for t in [x for xs in received.values() for x in xs] + [t for ts in outs.values() for t in ts]:
                self.meter.add((s, mb), t)
            self.meter.forward_done((s, mb))

    def _selective_shards(self, s: int) -> StageShards | None:
        """The sharded stages when stage ``s`` recomputes selectively: both its forwards run outside FSDP's hooks
        (:meth:`StageShards.gather`), the first node by node, the rerun under the selective cache."""
        shards = self.eng.shards
        return shards if shards is not None and self._choice(s) == "selective" else None

    def _outs(self, s: int, res: Mapping[str, Any]) -> dict[EdgeKey, list[torch.Tensor]]:
        """The tensors stage ``s``'s outputs ``res`` send, per out-edge."""
        values = self.eng.split.edge_values
        return {key: [settled(t) for v in values.get(key, ()) for t in ValueMeta.tensors_of(res[v])]
                for key in self.eng.out_edges[s]}

    def _rerun(self, s: int, mb: int, stash: Stash) -> None:
        """A recomputing stage's forward again, with autograd, before its backward: its outputs (and loss) become
        the backward's roots; what autograd saves now is counted until the microbatch's backward ends."""
        eng = self.eng
        prog = eng.split.stages[s]
        assert stash.rerun is not None
        t0 = time.perf_counter()
        shards = self._selective_shards(s)
        if shards is not None:
            shards.gather(s)  # released at the end of this backward
        with self.meter.saving((s, mb)), eng.precision.autocast(eng.device):
            res = recompute(eng.compiled.get(s, prog.gm), self._args(s, mb, stash.received), stash.rerun, s,
                            hooks=shards is None)
            if prog.has_output:
                with torch.enable_grad():
                    stash.loss = self._loss(res, mb)
        stash.outputs = self._outs(s, res)
        stash.rerun = None
        self._event("R", s, mb, t0)

    def _model_output(self, res: Mapping[str, Any]) -> Any:
        """The model's output from the output stage's results (an export program's rebuilt from its leaves)."""
        out = res[OUTPUT_KEY]
        spec = self.eng.split.out_spec
        if spec is not None:
            out = pytree.tree_unflatten(list(out) if isinstance(out, (list, tuple)) else [out], spec)
        return out

    def _output(self, res: Mapping[str, Any], mb: int) -> torch.Tensor | None:
        """The model output of microbatch ``mb``: its loss when training, else kept as an output."""
        if not self.training:
            self._outputs[mb] = self._model_output(res)
            return None
        return self._loss(res, mb)

    def _loss(self, res: Mapping[str, Any], mb: int) -> torch.Tensor:
        """``loss_fn`` of microbatch ``mb``'s output and target (recorded, float32, for the step's mean)."""
        out = self._model_output(res)
        assert self.loss_fn is not None
        target = pytree.tree_map(lambda t: _on(t, self.eng.device), self.targets[mb]) if self.targets is not None \
            else None
        loss = self.loss_fn(out, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise RuntimeConfigError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        self.losses[mb] = loss.detach().reshape(()).float()
        return loss

    def _roots(self, s: int, mb: int, stash: Stash) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for key in self.eng.out_edges[s]:
            gs = self._take(self.bwd_box, self.recv_b, key, mb)
            for t, g in zip(stash.outputs[key], gs):
                if g is not None and t.requires_grad:
                    roots.append(t)
                    grads.append(g)
        if stash.loss is not None:
            # mean over microbatches == one large batch; times the fp16 loss scale (unscaled after the step)
            roots.append(stash.loss * (self.eng.loss_scale / self.eng.m))
            grads.append(torch.ones_like(stash.loss))
        return roots, grads

    def backward(self, s: int, mb: int) -> None:
        stash = self.stash[(s, mb)]
        if stash.rerun is not None:
            self._rerun(s, mb, stash)
        roots, grads = self._roots(s, mb, stash)  # waits for the gradients from later stages
        t0 = time.perf_counter()  # after the wait: waiting is bubble, not backward time
        leaves = [x for key in self.eng.in_edges[s] for x in stash.inputs[key] if x is not None]
        if self.eng.schedule.split_backward:
            if roots and leaves:
                got = torch.autograd.grad(roots, leaves, grads, retain_graph=True, allow_unused=True)
            else:
                got = (None,) * len(leaves)
            gmap = {id(x): g for x, g in zip(leaves, got)}
            stash.roots, stash.root_grads = roots, grads
        else:
            hooks = self._reducing_backward(s) if self.eng.overlapped.get(s) == mb else []
            if self.eng.shards is not None:
                self.eng.shards.backward_starts()
            try:
                if roots:
                    torch.autograd.backward(roots, grads)
            finally:
                for h in hooks:
                    h.remove()
            shards = self._selective_shards(s)
            if shards is not None:
                shards.release(s)
            gmap = {id(x): x.grad for x in leaves}
        self._event("B", s, mb, t0)
        for key in self.eng.in_edges[s]:
            out: list[torch.Tensor | None] = []
            for x, (shape, dtype) in zip(stash.inputs[key], self.meta.leaves_per_edge[key]):
                if x is None:
                    out.append(None)
                else:
                    g = gmap.get(id(x))
                    out.append(g if g is not None else torch.zeros(shape, dtype=dtype, device=x.device))
            if self._local(key):
                self.bwd_box[(key, mb)] = out
            else:
                self.to_send_b[(key, mb)] = out
        if not self.eng.schedule.split_backward:
            del self.stash[(s, mb)]
            self.meter.release((s, mb))

    def weights(self, s: int, mb: int) -> None:
        """W of a split backward: the weight gradients, from the graph B kept (costs a second backward pass)."""
        stash = self.stash.pop((s, mb))
        self.meter.release((s, mb))
        t0 = time.perf_counter()
        ids = self.eng.ownership.stage_param_ids[s]
        params = [p for p in self.eng.ownership.model.parameters() if id(p) in ids and p.requires_grad]
        if stash.roots and params:
            got = torch.autograd.grad(stash.roots, params, stash.root_grads, allow_unused=True)
            with torch.no_grad():
                for p, g in zip(params, got):
                    if g is None:
                        continue
                    if p.grad is None:
                        p.grad = g.detach().clone()
                    else:
                        p.grad += g
        self._event("W", s, mb, t0)

    def mean_loss(self) -> torch.Tensor | None:
        if not self.losses:
            return None
        return torch.stack([self.losses[k] for k in sorted(self.losses)]).mean()
