"""Activation recomputation and offloading as a planner choice: what each choice keeps, re-creates and recomputes, per op.

Each stage runs under one of four choices (docs/memory.md):

- ``none``: autograd keeps what it saves (the profiler's ``saved_bytes``) for every
  microbatch in flight.
- ``selective``: keep the outputs of the matmul-like ops (and what they save of their
  own), recompute every other op inside the backward: Megatron-LM's selective
  recomputation (Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", MLSys 2023), which keeps the costly matmuls and recomputes the
  cheap element-wise, normalisation and softmax work.
- ``full``: keep only the stage's inputs and recompute its whole forward inside the
  backward: gradient checkpointing (Chen et al., "Training Deep Nets with Sublinear
  Memory Cost", 2016) at stage granularity, as GPipe does (Huang et al., NeurIPS 2019).
- ``offload``: run the forward as ``none`` does, but copy what autograd saves to host memory
  and back for the backward (``torch.autograd.graph.save_on_cpu``; ZeRO-Offload/ZeRO-R's
  activation offloading, Rajbhandari et al., SC 2020). On the device it keeps what ``full``
  keeps (the stage's inputs and the outputs it sends) and, during one microbatch's backward,
  at most what ``none`` keeps (the copies coming back): priced as ``full``'s memory. Its
  time is the saved bytes over the device's host link, each way, per op one copy with the
  link's latency; the copies run on the compute stream, so nothing overlaps them, and both
  directions are charged to the backward, as recomputation is. A device without a host link
  (a CPU: its memory is host memory) keeps the stash where it is: priced as ``none`` (no
  time), and never chosen by ``auto``.

Choosing per stage, together with the partition, is AdaPipe's search (Sun et al.,
"AdaPipe: Optimizing Pipeline Parallelism with Adaptive Recomputation and
Partitioning", ASPLOS 2024); the solvers in partitioner/solve/ do it exactly.

An op is matmul-like when ``torch.utils.flop_counter`` counts FLOPs for it: the counter
knows exactly mm, addmm, bmm, baddbmm, the convolutions and the fused attention kernels
(``scaled_dot_product_attention``), so an op's ``flops`` attribute decides, and no second
list of op names is kept. A selective stage keeps the storages the matmul kernels inside a
matmul-like op make, saved or not (the recomputed ops read them; the runtime caches exactly
these through torch's selective activation checkpointing), and re-creates what the op's
other kernels save; on a graph that did not record the kernels' storages, it keeps the
op's output whole and what the op saves of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from partitioner.cluster import Link
from partitioner.errors import PlanningError
from partitioner.graph import is_matmul
from partitioner.ir import ActionKind, ScheduleKind
from partitioner.schedule import compute_orders
from partitioner.walk import peak_held

__all__ = ["CHOICES", "MODES", "OFFLOAD", "RECOMPUTING", "OpRecompute", "check_mode", "offload_seconds",
           "op_recompute", "peak_recomputing"]

#: The recomputing choices, fastest first: each recomputes a superset of the one before, so the
#: first that fits a stage's memory is the fastest that fits.
RECOMPUTING = ("none", "selective", "full")
#: Offloading: its time is copies, not recomputation, so it is weighed against the recomputing
#: choice that fits by time (a stage takes it where it fits and is strictly faster).
OFFLOAD = "offload"
#: The per-stage choices.
CHOICES = (*RECOMPUTING, OFFLOAD)
#: What ``recompute=`` accepts: a choice forced on every stage, or ``auto`` (the solver picks per stage).
MODES = ("auto", *CHOICES)


def check_mode(value: str | Sequence[str], stages: int | None = None) -> str | tuple[str, ...]:
    """``value`` checked: a mode of :data:`MODES`, or one choice of :data:`CHOICES` per stage."""
    if isinstance(value, str):
        mode = value.strip().lower()
        if mode not in MODES:
            raise PlanningError(f"unknown recompute {value!r}; choose one of {', '.join(MODES)}")
        return mode
    per_stage = tuple(str(c).strip().lower() for c in value)
    bad = [c for c in per_stage if c not in CHOICES]
    if bad:
        raise PlanningError(f"unknown recompute choice {bad[0]!r} for a stage; each stage takes one of "
                            f"{', '.join(CHOICES)}")
    if stages is not None and len(per_stage) != stages:
        raise PlanningError(f"{len(per_stage)} recompute choices for {stages} stages; give one per stage")
    return per_stage


@dataclass(frozen=True)
class OpRecompute:
    """Per op (positions of a Problem's order) and per choice, what a stage holding it pays.

    ``seconds``: forward seconds run again inside the backward. ``kept``: bytes kept per
    microbatch in flight. ``remade``: bytes re-created for the one microbatch being
    recomputed. ``sent``: for an op owning a storage it (or a view of it) sends to another
    stage, the bytes the stage keeps for that beyond ``kept`` (the backward starts from
    the sent tensor). ``received``: whether the stage counts the tensors it receives (its
    stashed inputs) as its own.
    """

    seconds: dict[str, np.ndarray]
    kept: dict[str, np.ndarray]
    remade: dict[str, np.ndarray]
    sent: dict[str, np.ndarray]
    received: dict[str, bool]


def offload_seconds(saved: np.ndarray, host: Link) -> np.ndarray:
    """Per op, seconds to copy what it saves to host memory and back over ``host`` (one copy each way,
    each paying the link's latency); nothing for an op that saves nothing."""
    return np.where(saved > 0, 2.0 * (saved / host.bandwidth + host.latency), 0.0)


def op_recompute(fwd: np.ndarray, flops: np.ndarray, saved: np.ndarray, saved_output: np.ndarray,
                 storage: np.ndarray, *, exact: bool, kernel: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                 host: Link | None = None, selective_fwd: np.ndarray | None = None) -> OpRecompute:
    """The per-op terms of every choice.

    ``exact``: ``saved``, ``saved_output`` and ``storage`` are the profiler's (autograd's
    saved bytes, each storage once); otherwise they are the proxy every op's output is
    (saved whole by its consumers, in a storage of its own) and received tensors are the
    sender's bytes under ``none``. ``kernel``: per op, the bytes of the storages its matmul
    kernels make, the part of ``saved`` and the part of ``storage`` they are (negative where
    not recorded). Where recorded, a selective matmul-like op keeps exactly those storages
    (what the runtime caches) and re-creates what its other ops save (an unfused attention's
    softmax and dropout mask); elsewhere it keeps its output whole and what it saves of its own.
    ``host``: the devices' link to host memory, which offloading copies over (None: no host
    memory apart from the device's, offloading is ``none`` at no cost). ``selective_fwd``: per op, the
    forward seconds selective reruns where the graph records it (a folded group: its ops that are not
    matmul-like), negative where not.
    """
    matmul = np.array([is_matmul(f) for f in flops], dtype=bool)
    zero = np.zeros_like(fwd)
    # a folded group is matmul-like when one of its ops is; what selective reruns is its other ops' forward
    rerun = np.where(matmul, 0.0, fwd) if selective_fwd is None else np.where(selective_fwd >= 0, selective_fwd,
                                                                               np.where(matmul, 0.0, fwd))
    own_extra = np.maximum(saved - saved_output, 0.0)  # intermediates an op saves beside its output
    sel_kept = storage + own_extra
    sel_remade = zero.copy()
    sel_sent = zero.copy()
    if kernel is not None and exact:
        k_bytes, k_saved, k_output = kernel
        known = k_bytes >= 0
        sel_kept = np.where(known, k_bytes, sel_kept)
        sel_remade = np.where(known, np.maximum(saved - k_saved, 0.0), sel_remade)
        sel_sent = np.where(known, np.maximum(storage - k_output, 0.0), sel_sent)
    rec = OpRecompute(
        seconds={"none": zero, "selective": rerun, "full": fwd.copy()},
        kept={"none": saved.copy(), "selective": np.where(matmul, sel_kept, 0.0), "full": zero},
        remade={"none": zero, "selective": np.where(matmul, sel_remade, saved), "full": saved.copy()},
        sent={"none": np.maximum(storage - saved_output, 0.0) if exact else zero,
              "selective": np.where(matmul, sel_sent, storage), "full": storage.copy()},
        received={"none": exact, "selective": True, "full": True},
    )
    # offload: full's memory (what comes back during one backward is at most none's stash), copies for time
    like = "full" if host is not None else "none"
    rec.seconds[OFFLOAD] = offload_seconds(saved, host) if host is not None else zero
    for terms in (rec.kept, rec.remade, rec.sent, rec.received):
        terms[OFFLOAD] = terms[like]  # type: ignore[index]
    return rec


def peak_recomputing(kind: ScheduleKind | str, num_stages: int, num_microbatches: int, *,
                     num_ranks: int | None = None, training: bool = True) -> list[int]:
    """Most microbatches whose recomputed activations a stage holds at once.

    One (the microbatch whose backward runs) unless the backward is split: then B
    recomputes and the activations stay until the microbatch's W, which zero-bubble
    schedules defer, so the count is read off the schedule's own compute order.
    """
    if not training:
        return [0] * num_stages
    kind = ScheduleKind.parse(kind)
    if not kind.split_backward:
        return [1] * num_stages
    orders, _ = compute_orders(kind, num_stages, num_microbatches, num_ranks=num_ranks)
    return peak_held(orders, num_stages, True, taken_at=ActionKind.B)
