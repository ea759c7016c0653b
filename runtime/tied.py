"""Weights tied across pipeline ranks: each holder's gradient becomes the sum of every holder's, in place."""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.comm import Comm, Pending
from runtime.program import Ownership
from runtime.sharding import local

__all__ = ["sum_tied_grads"]


def sum_tied_grads(comm: Comm, ownership: Ownership, rank: int, tag_for: Callable[[int], int]) -> None:
    """A parameter held by several ranks gets the sum of their gradients (lowest rank adds, in rank order);
    ``tag_for(j)``: the message tag of the tie's j-th parameter.

    In place in each rank's ``.grad``: the lead holds one receive buffer, the others none
    (a copy of the sum and of each part would be two or three more gradients' worth at the
    step's peak: an LM head tied to the embedding is a vocabulary-sized matrix)."""
    for ranks, params in sorted(ownership.ties.items()):
        for j, p in enumerate(params):
            tag = tag_for(j)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif not local(p.grad).is_contiguous():  # sent and received in place
                p.grad = p.grad.contiguous()
            # sharded: the ranks holding the tie shard it alike (same shape, same replicas), so the sum
            # of the whole gradients is the sum of each replica's shards
            total = local(p.grad)
            lead = ranks[0]
            what = f"the gradient sum of tied parameter {ownership.canonical[id(p)]}"
            if rank == lead:
                buf = torch.empty_like(total)
                for r in ranks[1:]:
                    comm.wait(Pending([comm.irecv(buf, r, tag)], [buf], what, r))
                    total += buf
                del buf
                sends = [Pending([comm.isend(total, r, tag)], [total], what, r) for r in ranks[1:]]
                for s in sends:
                    comm.wait(s)
            else:
                comm.wait(Pending([comm.isend(total, lead, tag)], [total], what, lead))
                comm.wait(Pending([comm.irecv(total, lead, tag)], [total], what, lead))
