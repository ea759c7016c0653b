"""Point-to-point transfers of cut tensors over torch.distributed, with bounded waits and named failures."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import PipelineError
from .faults import FailureNote
from .teardown import destroy_groups_at_exit, mark_failed

__all__ = ["Comm", "LocalComm", "Pending"]

#: The tag of the receive that :meth:`Comm.sever` posts and abandons (no transfer ever uses it).
_SEVER_TAG = 2**31 - 7


@dataclass
class Pending:
    """Posted transfers of one action: the works, the tensors they fill or read, and what they are."""

    works: list[Any]
    tensors: list[torch.Tensor]
    what: str
    peer: int
    #: For a collective: the other ranks of its group (global ranks), named if it fails.
    group: tuple[int, ...] = ()


class Comm:
    """isend/irecv per tensor on the default process group; every wait is bounded by ``timeout``.

    Gloo and NCCL take the same path (only the backend differs: tensors on CUDA go
    through NCCL, CPU tensors through gloo). ``batch_isend_irecv`` is not used: with gloo
    it can hang. Each transfer carries a tag unique within a step, so early-posted
    receives can never match the wrong send (gloo matches on (peer, tag)); they are also
    posted in the schedule's order, which is what NCCL (tag-blind) needs.

    Ranks here are the pipeline's own (0 .. P-1, as the schedule numbers them);
    ``global_ranks[r]`` is pipeline rank r's rank in the default group (with data-parallel
    replicas, each replica's pipeline is P ranks of a larger world). Collectives over a
    group (:meth:`all_reduce`) are waited for in the same bounded way. Messages name
    global ranks.

    A failed wait raises :class:`PipelineError` naming the peer. The first rank to fail
    writes its reason on the pipeline's ``note`` (runtime/faults.py); the others report that
    root cause. A rank whose process dies closes its gloo connections, so peers blocked on it
    fail at once; a rank that fails and lives on closes them itself (:meth:`sever`); a rank
    that hangs is detected by the timeout.
    """

    def __init__(self, rank: int, timeout: float, stage_of_rank: Sequence[Sequence[int]] = (),
                 global_ranks: Sequence[int] | None = None, note: FailureNote | None = None) -> None:
        self.rank = rank
        self.timeout = float(timeout)
        self.stage_of_rank = [list(s) for s in stage_of_rank]
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(len(self.stage_of_rank)))
        self.me = self.global_ranks[rank] if rank < len(self.global_ranks) else rank
        self.note = note
        self.groups: list[Any] = []  # the groups of the collectives started here: severed with the default one
        destroy_groups_at_exit()

    # ------------------------------------------------------------------ transfers

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "a send") -> Any:
        return self._p2p(lambda: dist.isend(tensor, self.global_ranks[peer], tag=tag), tensor, peer, what)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "a receive") -> Any:
        return self._p2p(lambda: dist.irecv(tensor, self.global_ranks[peer], tag=tag), tensor, peer, what)

    def _p2p(self, start: Callable[[], Any], tensor: torch.Tensor, peer: int, what: str) -> Any:
        """Post a send or receive: a peer already gone fails here (gloo raises at once), named as in the wait.
        Was: gloo's raw "Connection closed" escaped and became the step's root cause, naming no rank."""
        try:
            return start()
        except Exception as err:  # noqa: BLE001 - turned into a named PipelineError
            raise self._failed(Pending([], [tensor], what, peer), err) from None

    def all_reduce(self, tensor: torch.Tensor, group: Any, what: str, op: Any = dist.ReduceOp.SUM) -> Pending:
        """Start a reduction (a sum) over ``group``; its wait is bounded and names the group's other ranks if it fails."""
        return self._collective(lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True), tensor, group,
                                what)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any, what: str) -> Pending:
        """Start a broadcast of ``tensor`` from global rank ``src`` over ``group``; bounded and named as all_reduce."""
        return self._collective(lambda: dist.broadcast(tensor, src=src, group=group, async_op=True), tensor, group,
                                what)

    def _collective(self, start: Callable[[], Any], tensor: torch.Tensor, group: Any, what: str) -> Pending:
        """Launch a collective over ``group``: a peer already gone fails here, named, as it would in the wait."""
        others = tuple(r for r in dist.get_process_group_ranks(group) if r != self.me)
        if not any(g is group for g in self.groups):
            self.groups.append(group)
        pending = Pending([], [tensor], what, -1, others)
        try:
            pending.works.append(start())
        except Exception as err:  # noqa: BLE001 - turned into a named PipelineError
            raise self._failed(pending, err) from None
        return pending

    def wait(self, pending: Pending) -> list[torch.Tensor]:
        """Wait (bounded) for every work of ``pending``; returns its tensors."""
        for work in pending.works:
            try:
                ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
            except Exception as err:  # noqa: BLE001 - turned into a named PipelineError
                raise self._failed(pending, err) from None
            if ok is False:
                raise self._failed(pending, TimeoutError("wait returned False"))
        return pending.tensors

    def _peer_text(self, pending: Pending) -> str:
        peer = pending.peer
        if peer < 0:
            return f"the data-parallel group ({_ranks_text(pending.group)})"
        if peer < len(self.stage_of_rank):
            stages = self.stage_of_rank[peer]
            return (f"rank {self.global_ranks[peer]} "
                    f"(stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))})")
        return f"rank {peer}"

    def _failed(self, pending: Pending, err: BaseException) -> PipelineError:
        mark_failed()
        text = str(err)
        peer = pending.peer
        who = self._peer_text(pending)
        if peer < 0:
            them = _ranks_text(pending.group) if len(pending.group) == 1 else f"one of {_ranks_text(pending.group)}"
        else:
            them = f"rank {self.global_ranks[peer]}" if peer < len(self.global_ranks) else f"rank {peer}"
        if "imed out" in text or isinstance(err, TimeoutError):
            desc = (f"rank {self.me} timed out after {self.timeout:g} s waiting for {pending.what} "
                    f"with {who}: {them} is dead or stuck")
        elif "closed" in text.lower() or "connection" in text.lower() or "reset" in text.lower():
            desc = (f"rank {self.me} lost its connection to {who} during {pending.what}: "
                    f"{them} exited or crashed")
        else:
            first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
            desc = f"rank {self.me} failed during {pending.what} with {who}: {first}"
        cause = self.failure()
        if cause is None:
            self.report_failure(desc)
            return PipelineError(f"pipeline step failed: {desc}", rank=self.rank, peer=peer)
        self.sever()  # the peers blocked on this rank learn it now too
        return PipelineError(f"pipeline step failed: {cause} (seen on rank {self.me}: {desc})",
                             rank=self.rank, peer=peer)

    # ------------------------------------------------------------------ failure notes

    def report_failure(self, message: str) -> None:
        """Record why the pipeline stopped (first writer wins), so that the other ranks can say it, and close this
        rank's connections so that a peer blocked on it fails now, not after the timeout."""
        mark_failed()
        if self.note is not None:
            self.note.publish(message)
        self.sever()

    def failure(self) -> str | None:
        """The root cause another rank recorded, if any."""
        return self.note.read() if self.note is not None else None

    def sever(self) -> None:
        """Close this rank's gloo connections (the default group's, and those of the groups of its collectives):
        every peer blocked on a transfer with it fails at once with a closed connection, and reads the cause.

        A gloo wait that times out closes its connections; a receive no one will ever match, waited for 1 ms, is
        that. The groups are of no further use after a failure. An NCCL group refuses the CPU tensor: its peers
        still see the failure when this process exits, or after the timeout.
        """
        tiny = datetime.timedelta(milliseconds=1)
        for group in [None, *self.groups]:
            try:
                peers = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            except Exception:  # noqa: BLE001 - the groups are gone (destroyed at exit)
                return
            for peer in peers:
                if peer == self.me:
                    continue
                try:  # the first closes the group's connections (gloo); the others then fail at once
                    dist.irecv(torch.empty(1), peer, group=group, tag=_SEVER_TAG).wait(timeout=tiny)
                except Exception:  # noqa: BLE001 - the expected timeout, or a connection already closed
                    pass


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class LocalComm:
    """The transfers between ranks that live in one process: a shared mailbox, same interface as :class:`Comm`.

    The single-process engine walks every rank's program in the walk's order, in which a
    SEND always runs right before its RECV; the receive copies the sent tensor into its
    buffer at once, as a matched point-to-point transfer would.
    """

    def __init__(self, rank: int, mailbox: dict[tuple[int, int, int], torch.Tensor]) -> None:
        self.rank = rank
        self.mailbox = mailbox

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "a send") -> None:
        self.mailbox[(self.rank, peer, tag)] = tensor

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "a receive") -> None:
        sent = self.mailbox.pop((peer, self.rank, tag), None)
        if sent is None:
            raise RuntimeError(f"rank {self.rank}: nothing was sent by rank {peer} under tag {tag} before this "
                               "receive; the walk's order guarantees it, so this is a bug in smp")
        tensor.copy_(sent)

    def wait(self, pending: Pending) -> list[torch.Tensor]:
        return pending.tensors

    def report_failure(self, message: str) -> None:
        """Nothing to tell: every rank of this process raises the same exception."""
