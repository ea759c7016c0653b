"""The pipeline engine: interprets a Plan's per-rank action list on stage modules (one process or many)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from partitioner.microbatch import split_microbatches
from partitioner.schedule import Action, ActionKind
from partitioner.timeline import Timeline, TimelineEvent
from partitioner.trace import fingerprint, flatten_inputs, trace
from runtime.comm import Comm, Pending, PipelineError
from runtime.split import (
    OUTPUT_KEY,
    SplitError,
    SplitProgram,
    ValueMeta,
    _stage_tensor_names,
    propagate_meta,
    split_program,
    state_meta_of,
)

__all__ = ["Engine", "RuntimeConfigError"]

EdgeKey = tuple[int, int, str]


class RuntimeConfigError(ValueError):
    """The runtime cannot start as configured (world size, plan, loss); raised before any work."""


@dataclass
class _Stash:
    """What one (stage, microbatch) keeps between its forward and its backward."""

    inputs: dict[EdgeKey, list[torch.Tensor | None]]   # leaf tensors received per in-edge
    outputs: dict[EdgeKey, list[torch.Tensor]]         # tensors sent per out-edge
    loss: torch.Tensor | None = None
    roots: list[torch.Tensor] = field(default_factory=list)      # backward roots (kept for a split W)
    root_grads: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _StepMeta:
    """Per batch shape: every cut value's leaves, and the tags of every transfer."""

    values: dict[str, ValueMeta]
    leaves_per_edge: dict[EdgeKey, list[tuple[tuple[int, ...], torch.dtype]]]
    max_leaves: int


class Engine:
    """Runs this rank's stages of a Plan (every stage when ``comm`` is None: one process, no group).

    The engine holds stage GraphModules that share parameters with ``model`` (by
    reference); on a multi-rank run the parameters and buffers of other ranks' stages
    are replaced by meta tensors, so they do not occupy memory here.
    """

    def __init__(self, model: nn.Module, plan: Any, example_args: Sequence[Any], example_kwargs: Mapping[str, Any],
                 *, rank: int = 0, world_size: int = 1, comm: Comm | None = None,
                 device: torch.device | None = None) -> None:
        self.model = model
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.comm = comm
        self.single = comm is None
        sch = plan.schedule
        self.schedule = sch
        self.s2r = list(sch.stage_to_rank)
        self.m = plan.microbatches
        self.split_backward = sch.split_backward
        self.device = device or _model_device(model)
        self.my_stages = list(range(plan.num_stages)) if self.single else sch.stages_of(rank)
        self.edges: list[EdgeKey] = [e.key for e in sch.graph.edges]
        self.edge_index = {k: i for i, k in enumerate(self.edges)}
        self.in_edges = {s: [k for k in self.edges if k[1] == s] for s in range(plan.num_stages)}
        self.out_edges = {s: [k for k in self.edges if k[0] == s] for s in range(plan.num_stages)}

        leaf_modules = list(plan.model.get("leaf_modules") or [])
        gm = trace(model, example_args, example_kwargs, frontend=plan.model.get("frontend", "auto"),
                   leaf_modules=leaf_modules, check=False)
        got = fingerprint(gm, model)
        if got != plan.model.get("fingerprint"):
            raise RuntimeConfigError(
                f"this plan was made for another model (plan fingerprint {plan.model.get('fingerprint')}, "
                f"this model {got}; plan for {plan.model.get('name', '?')!r}): the ops, their wiring or the "
                "parameter shapes differ. Re-plan for this model (smp.partition(model, plan=None) or `smp plan`).")
        self.gm = gm
        self.state_meta = state_meta_of(gm)
        try:
            fx_to_op = {fx_name: str(node) for node in plan.graph.nx for fx_name in plan.graph[node]["fx_nodes"]}
            self.program: SplitProgram = split_program(gm, plan.fx_stage_of, plan.num_stages, self.edges,
                                                       self.my_stages, fx_to_op)
        except SplitError as err:
            raise RuntimeConfigError(str(err)) from None
        self.out_rank = self.s2r[self.program.output_stage]
        self._placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self._assign_state(model, gm)
        self._meta_cache: dict[Any, _StepMeta] = {}
        self._traced_key = self._shape_key(flatten_inputs(gm, example_args, example_kwargs))
        self.frontend = gm.meta["smp_trace"].frontend
        self.events: list[TimelineEvent] = []
        self.step_start = 0.0
        self.step_end = 0.0

    # ------------------------------------------------------------------ state ownership

    def _assign_state(self, model: nn.Module, gm: nn.Module) -> None:
        """Which rank holds each parameter/buffer; drop the others here; find tied parameters across ranks."""
        plan = self.plan
        names_by_id: dict[int, list[str]] = {}
        for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
                model.named_buffers(remove_duplicate=False)):
            names_by_id.setdefault(id(t), []).append(name)
        self.canonical: dict[int, str] = {i: ns[0] for i, ns in names_by_id.items()}
        gm_tensors = dict(gm.named_parameters(remove_duplicate=False))
        gm_tensors.update(dict(gm.named_buffers(remove_duplicate=False)))
        # stage -> ids of tensors it reads (for every stage, so that every rank agrees on the ties)
        nodes_by_stage: dict[int, list[Any]] = {s: [] for s in range(plan.num_stages)}
        for node in gm.graph.nodes:
            s = plan.fx_stage_of.get(node.name)
            if s is not None:
                nodes_by_stage[int(s)].append(node)
        holders: dict[int, set[int]] = {}
        self.stage_param_ids: dict[int, set[int]] = {}
        for s, nodes in nodes_by_stage.items():
            ids = set()
            for name in _stage_tensor_names(gm, nodes):
                t = gm_tensors.get(name)
                if t is None:
                    try:
                        t = gm.get_parameter(name)
                    except (AttributeError, ValueError):
                        continue
                ids.add(id(t))
                holders.setdefault(id(t), set()).add(self.s2r[s])
            self.stage_param_ids[s] = ids
        for i in names_by_id:
            holders.setdefault(i, {0})  # read by no op: rank 0 keeps it so the full state dict is complete
        self.holders = holders
        local_ranks = set(range(plan.num_ranks)) if self.single else {self.rank}
        drop = {i for i, rs in holders.items() if not (rs & local_ranks)}
        if drop:
            for root in (model, gm):
                for mod in root.modules():
                    for store in (mod._parameters, mod._buffers):
                        for key, t in list(store.items()):
                            if t is not None and id(t) in drop:
                                meta = torch.empty_like(t, device="meta")
                                store[key] = nn.Parameter(meta, requires_grad=t.requires_grad) \
                                    if isinstance(t, nn.Parameter) else meta
                                # An optimizer made before partitioning still refers to the old
                                # tensor: empty it so that reference holds no memory (it gets no
                                # gradient, so optimizers skip it).
                                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        # parameters held by several ranks (a tied embedding and LM head on two stages)
        ties: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for name, p in model.named_parameters():
            rs = tuple(sorted(holders.get(id(p), {0})))
            if len(rs) > 1 and not self.single and self.rank in rs:
                ties.setdefault(rs, []).append(p)
        self.ties = ties
        self.tied_names = [self.canonical[id(p)] for ps in ties.values() for p in ps]

    def local_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if not p.is_meta]

    # ------------------------------------------------------------------ shapes

    @staticmethod
    def _shape_key(flat: Sequence[Any]) -> tuple:
        return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("c", repr(x)) for x in flat)

    def _step_meta(self, flat: Sequence[Any]) -> _StepMeta:
        key = self._shape_key(flat)
        cached = self._meta_cache.get(key)
        if cached is not None:
            return cached
        if self.frontend == "export" and key != self._traced_key:
            raise RuntimeConfigError(
                f"this model was traced with torch.export, which fixes the shapes: it runs microbatches of input "
                f"shapes {[k[0] for k in self._traced_key]}, not {[k[0] for k in key]}. Keep the batch shape fixed "
                "(e.g. DataLoader(drop_last=True), pad sequences), or make a new PipelinedModel for the new shape.")
        wanted = set(self.program.value_src)
        try:
            values = propagate_meta(self.gm, flat, wanted, self.state_meta)
        except Exception as err:  # noqa: BLE001
            raise RuntimeConfigError(
                f"could not derive the shapes of the cut tensors for a microbatch of input shapes "
                f"{[k[0] for k in key]}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. "
                "The program's shapes must follow from its input shapes (no data-dependent shapes); "
                "an export-traced program only accepts the shapes it was traced with.") from None
        for name, (src, dst) in self.program.no_edge.items():
            if values[name].tensor_leaves():
                raise RuntimeConfigError(
                    f"value {name} is made on stage {src} and read on stage {dst}, but the plan has no edge for it: "
                    "the plan does not describe this program; re-plan")
        per_edge: dict[EdgeKey, list[tuple[tuple[int, ...], torch.dtype]]] = {}
        for k in self.edges:
            per_edge[k] = [(leaf.shape, leaf.dtype) for v in self.program.edge_values.get(k, ())
                           for leaf in values[v].tensor_leaves()]
        meta = _StepMeta(values, per_edge, max([1] + [len(v) for v in per_edge.values()]))
        self._meta_cache[key] = meta
        return meta

    def _tag(self, meta: _StepMeta, key: EdgeKey, mb: int, backward: bool, leaf: int) -> int:
        return ((self.edge_index[key] * 2 + int(backward)) * self.m + mb) * meta.max_leaves + leaf

    def _special_tag(self, meta: _StepMeta, i: int) -> int:
        return len(self.edges) * 2 * self.m * meta.max_leaves + i

    # ------------------------------------------------------------------ one step

    def run(self, micro_flat: list[list[Any]], targets: list[Any] | None, loss_fn: Callable[..., Any] | None,
            training: bool) -> tuple[torch.Tensor | None, list[Any]]:
        """Run every microbatch through this rank's program.

        Returns (mean loss over microbatches, on every rank, when training; the
        microbatch outputs, on the rank holding the output stage).
        """
        meta = self._step_meta(micro_flat[0])
        st = _StepState(self, meta, micro_flat, targets, loss_fn, training)
        self.events = []
        self.step_start = time.perf_counter()
        try:
            if self.single:
                st.run_single()
            else:
                st.run_rank(self.schedule.actions[self.rank])
                st.finish_sends()
            loss = st.mean_loss() if training else None
            if training and not self.single:
                loss = self._share_loss(meta, loss)
                self._sum_tied_grads(meta)
        except PipelineError:
            raise
        except Exception as err:
            if self.comm is not None:
                self.comm.report_failure(f"rank {self.rank} raised {type(err).__name__}: "
                                         f"{str(err).splitlines()[0] if str(err) else ''} during {st.current}")
            raise
        self.step_end = time.perf_counter()
        return loss, st.outputs

    def _share_loss(self, meta: _StepMeta, loss: torch.Tensor | None) -> torch.Tensor:
        assert self.comm is not None
        tag = self._special_tag(meta, 0)
        if self.rank == self.out_rank:
            buf = loss.detach().reshape(1).to(torch.float64)  # type: ignore[union-attr]
            works = [Pending([self.comm.isend(buf, r, tag)], [buf], "the loss broadcast", r)
                     for r in range(self.world_size) if r != self.rank]
            for w in works:
                self.comm.wait(w)
            return loss  # type: ignore[return-value]
        buf = torch.zeros(1, dtype=torch.float64, device=self.device)
        self.comm.wait(Pending([self.comm.irecv(buf, self.out_rank, tag)], [buf],
                               "the loss of the step", self.out_rank))
        return buf.to(torch.float32).reshape(())

    def _sum_tied_grads(self, meta: _StepMeta) -> None:
        """A parameter held by several ranks gets the sum of their gradients (lowest rank adds, in rank order)."""
        assert self.comm is not None
        for ranks, params in sorted(self.ties.items()):
            for j, p in enumerate(params):
                tag = self._special_tag(meta, 1 + j)
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                lead = ranks[0]
                what = f"the gradient sum of tied parameter {self.canonical[id(p)]}"
                if self.rank == lead:
                    total = g.detach().clone()
                    for r in ranks[1:]:
                        buf = torch.empty_like(total)
                        self.comm.wait(Pending([self.comm.irecv(buf, r, tag)], [buf], what, r))
                        total += buf
                    sends = [Pending([self.comm.isend(total, r, tag)], [total], what, r) for r in ranks[1:]]
                    for s in sends:
                        self.comm.wait(s)
                else:
                    buf = g.detach().contiguous().clone()
                    self.comm.wait(Pending([self.comm.isend(buf, lead, tag)], [buf], what, lead))
                    total = torch.empty_like(buf)
                    self.comm.wait(Pending([self.comm.irecv(total, lead, tag)], [total], what, lead))
                if p.grad is None:
                    p.grad = total
                else:
                    p.grad.copy_(total)

    # ------------------------------------------------------------------ timeline

    def timeline(self, events: Sequence[TimelineEvent] | None = None, step_time: float | None = None) -> Timeline:
        evs = list(self.events if events is None else events)
        t0 = self.step_start
        norm = [TimelineEvent(e.rank, e.stage, e.kind, e.mb, e.start - t0, e.end - t0) for e in evs]
        return Timeline(norm, step_time if step_time is not None else self.step_end - self.step_start, "measured",
                        self.plan.num_ranks, {"schedule": self.schedule.name, "microbatches": self.m})


class _StepState:
    """The mailboxes, stashes and pending transfers of one step."""

    def __init__(self, eng: Engine, meta: _StepMeta, micro_flat: list[list[Any]], targets: list[Any] | None,
                 loss_fn: Callable[..., Any] | None, training: bool) -> None:
        self.eng = eng
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
        self.stash: dict[tuple[int, int], _Stash] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: list[Any] = []
        self._outputs: dict[int, Any] = {}
        self.current = "the step set-up"

    # -------------------------------------------------------------- drivers

    def _local(self, key: EdgeKey) -> bool:
        return self.eng.single or self.eng.s2r[key[0]] == self.eng.s2r[key[1]]

    def run_rank(self, program: Sequence[Action]) -> None:
        for a in program:
            if not self.training and a.kind in (ActionKind.B, ActionKind.W, ActionKind.SEND_B, ActionKind.RECV_B):
                continue
            self.current = str(a)
            self.do(a)
        self._collect_outputs()

    def run_single(self) -> None:
        """All ranks' programs in one process: run any rank whose next compute action has its inputs."""
        progs = [[a for a in p if a.is_compute and (self.training or a.kind is ActionKind.F)]
                 for p in self.eng.schedule.actions]
        pc = [0] * len(progs)
        left = sum(len(p) for p in progs)
        while left:
            progressed = False
            for r, prog in enumerate(progs):
                while pc[r] < len(prog) and self._ready(prog[pc[r]]):
                    self.current = str(prog[pc[r]])
                    self.do(prog[pc[r]])
                    pc[r] += 1
                    left -= 1
                    progressed = True
            if not progressed:  # a validated schedule cannot get here
                raise RuntimeError("single-process pipeline made no progress: the schedule is inconsistent")
        self._collect_outputs()

    def _ready(self, a: Action) -> bool:
        if a.kind is ActionKind.F:
            return all((k, a.mb) in self.fwd_box for k in self.eng.in_edges[a.stage])
        if a.kind is ActionKind.B:
            return all((k, a.mb) in self.bwd_box for k in self.eng.out_edges[a.stage])
        return True

    def do(self, a: Action) -> None:
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

    # -------------------------------------------------------------- transfers

    def _differentiable(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point or dtype.is_complex

    def _send(self, a: Action, tensors: list[torch.Tensor | None], backward: bool) -> None:
        comm = self.eng.comm
        assert comm is not None
        key = a.edge
        peer = self.eng.s2r[a.peer]  # type: ignore[index]
        works, keep = [], []
        for i, t in enumerate(tensors):
            if t is None:  # a non-differentiable leaf: its gradient is not sent (both sides know)
                continue
            t = t.detach().contiguous()
            keep.append(t)
            works.append(comm.isend(t, peer, self.eng._tag(self.meta, key, a.mb, backward, i)))
        self.sends.append(Pending(works, keep, str(a), peer))

    def _post_recv(self, a: Action, backward: bool) -> Pending:
        comm = self.eng.comm
        assert comm is not None
        key = a.edge
        peer = self.eng.s2r[a.peer]  # type: ignore[index]
        works, bufs = [], []
        for i, (shape, dtype) in enumerate(self.meta.leaves_per_edge[key]):
            if backward and not self._differentiable(dtype):
                bufs.append(None)
                continue
            buf = torch.empty(shape, dtype=dtype, device=self.eng.device)
            bufs.append(buf)
            works.append(comm.irecv(buf, peer, self.eng._tag(self.meta, key, a.mb, backward, i)))
        pend = Pending(works, bufs, str(a), peer)  # type: ignore[arg-type]
        return pend

    def _take_fwd(self, key: EdgeKey, mb: int) -> list[torch.Tensor]:
        if (key, mb) in self.fwd_box:
            return self.fwd_box.pop((key, mb))
        pend = self.recv_f.pop((key, mb), None)
        if pend is None:  # the program forgot its RECV_F: post it now rather than fail
            pend = self._post_recv(Action(ActionKind.RECV_F, key[1], mb, key[0], key[2]), backward=False)
        return self.eng.comm.wait(pend)  # type: ignore[union-attr]

    def _take_bwd(self, key: EdgeKey, mb: int) -> list[torch.Tensor | None]:
        if (key, mb) in self.bwd_box:
            return self.bwd_box.pop((key, mb))
        pend = self.recv_b.pop((key, mb), None)
        if pend is None:
            pend = self._post_recv(Action(ActionKind.RECV_B, key[0], mb, key[1], key[2]), backward=True)
        return self.eng.comm.wait(pend)  # type: ignore[union-attr]

    def finish_sends(self) -> None:
        for pend in self.sends:
            self.eng.comm.wait(pend)  # type: ignore[union-attr]
        self.sends = []

    # -------------------------------------------------------------- compute

    def _event(self, kind: str, stage: int, mb: int, t0: float) -> None:
        self.eng.events.append(TimelineEvent(self.eng.s2r[stage], stage, kind, mb, t0, time.perf_counter()))

    def forward(self, s: int, mb: int) -> None:
        eng = self.eng
        prog = eng.program.stages[s]
        values = self.meta.values
        flat = self.flat[mb]
        args: list[Any] = [flat[i] for i in prog.input_index]
        received: dict[str, Any] = {}
        leaves_in: dict[EdgeKey, list[torch.Tensor | None]] = {}
        for key in eng.in_edges[s]:
            tensors = self._take_fwd(key, mb)
            leaves: list[torch.Tensor | None] = []
            it = iter(tensors)
            for v in eng.program.edge_values.get(key, ()):
                vm = values[v]
                ts = []
                for leaf in vm.tensor_leaves():
                    t = next(it)
                    if self.training and self._differentiable(leaf.dtype):
                        x = t.detach().requires_grad_(True)
                        leaves.append(x)
                        # in-place ops on a leaf that requires grad are illegal: feed a copy
                        ts.append(x.clone() if v in prog.mutated_inputs else x)
                    else:
                        leaves.append(None)
                        ts.append(t.detach().clone() if v in prog.mutated_inputs else t.detach())
                received[v] = vm.rebuild(ts)
            leaves_in[key] = leaves
        ext = [received[v] if v in received else values[v].rebuild([]) for v in prog.external]
        t0 = time.perf_counter()
        with torch.set_grad_enabled(self.training):
            res = prog.gm(*args, *ext)
            loss = None
            if prog.has_output:
                out = res[OUTPUT_KEY]
                if eng.program.out_spec is not None:
                    out = pytree.tree_unflatten(list(out) if isinstance(out, (list, tuple)) else [out],
                                                eng.program.out_spec)
                if self.training:
                    assert self.loss_fn is not None and self.targets is not None
                    loss = self.loss_fn(out, self.targets[mb])
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise RuntimeConfigError(
                            f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
                    self.losses[mb] = loss.detach().reshape(())
                else:
                    self._outputs[mb] = out
        self._event("F", s, mb, t0)
        outs: dict[EdgeKey, list[torch.Tensor]] = {}
        for key in eng.out_edges[s]:
            tensors = [t for v in eng.program.edge_values.get(key, ()) for t in ValueMeta.tensors_of(res[v])]
            outs[key] = tensors
            if self._local(key):
                self.fwd_box[(key, mb)] = tensors
            else:
                self.to_send_f[(key, mb)] = tensors
        if self.training:
            self.stash[(s, mb)] = _Stash(leaves_in, outs, loss)

    def _roots(self, s: int, mb: int, stash: _Stash) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for key in self.eng.out_edges[s]:
            gs = self._take_bwd(key, mb)
            for t, g in zip(stash.outputs[key], gs):
                if g is not None and t.requires_grad:
                    roots.append(t)
                    grads.append(g)
        if stash.loss is not None:
            roots.append(stash.loss / self.eng.m)  # mean over microbatches == one large batch
            grads.append(torch.ones_like(stash.loss))
        return roots, grads

    def backward(self, s: int, mb: int) -> None:
        stash = self.stash[(s, mb)]
        roots, grads = self._roots(s, mb, stash)  # waits for the gradients from later stages
        t0 = time.perf_counter()  # after the wait: waiting is bubble, not backward time
        leaves = [x for key in self.eng.in_edges[s] for x in stash.inputs[key] if x is not None]
        if self.eng.split_backward:
            if roots and leaves:
                got = torch.autograd.grad(roots, leaves, grads, retain_graph=True, allow_unused=True)
            else:
                got = (None,) * len(leaves)
            gmap = {id(x): g for x, g in zip(leaves, got)}
            stash.roots, stash.root_grads = roots, grads
        else:
            if roots:
                torch.autograd.backward(roots, grads)
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
        if not self.eng.split_backward:
            del self.stash[(s, mb)]

    def weights(self, s: int, mb: int) -> None:
        """W of a split backward: the weight gradients, from the graph B kept (costs a second backward pass)."""
        stash = self.stash.pop((s, mb))
        t0 = time.perf_counter()
        ids = self.eng.stage_param_ids[s]
        params = [p for _, p in self.eng.model.named_parameters() if id(p) in ids and p.requires_grad]
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

    # -------------------------------------------------------------- results

    def mean_loss(self) -> torch.Tensor | None:
        if not self.losses:
            return None
        return torch.stack([self.losses[k] for k in sorted(self.losses)]).mean()

    def _collect_outputs(self) -> None:
        self.outputs = [self._outputs[k] for k in sorted(self._outputs)]


def _model_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def concat_outputs(outputs: list[Any]) -> Any:
    """Microbatch outputs back into one batch: tensors with a batch dimension are concatenated along dim 0."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    leaves0, spec = flat[0]
    merged = []
    for i, leaf in enumerate(leaves0):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            merged.append(torch.cat([f[0][i] for f in flat], dim=0))
        else:
            merged.append(leaf)
    return pytree.tree_unflatten(merged, spec)


def split_batch(gm_like: Any, args: Sequence[Any], kwargs: Mapping[str, Any], m: int) -> list[list[Any]]:
    """The flat placeholder values of each of ``m`` microbatches."""
    return [flatten_inputs(gm_like, a, k) for a, k in split_microbatches(args, kwargs, m)]


def check_world(plan: Any, world_size: int) -> None:
    if world_size % plan.num_ranks:
        raise RuntimeConfigError(
            f"the world size {world_size} is not a multiple of the plan's {plan.num_ranks} pipeline ranks: "
            f"launch {plan.num_ranks} processes (torchrun --nproc_per_node {plan.num_ranks}) or re-plan with "
            f"stages={world_size}")
    if world_size != plan.num_ranks:
        raise RuntimeConfigError(
            f"the world size {world_size} is {world_size // plan.num_ranks} x the plan's {plan.num_ranks} ranks; "
            "data parallelism across pipeline replicas is not supported yet: launch "
            f"{plan.num_ranks} processes or re-plan with stages={world_size}")

