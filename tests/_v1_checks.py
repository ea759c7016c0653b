"""Checks of smp.v1 on 2 ranks started the way mpirun starts them (OMPI_* variables, no torchrun), one JSON per rank.

Run: OMPI_COMM_WORLD_RANK=r OMPI_COMM_WORLD_SIZE=2 MASTER_PORT=p python tests/_v1_checks.py OUT_DIR (r = 0, 1).
Checked: rank helpers, send / broadcast / recv_from / allgather, manual partitions across ranks, GradScaler's
agreement on a step with an inf on one rank only, an evaluation function raising on the rank holding the
output, and a state_dict() that only rank 0 calls (the last check: it leaves the ranks out of step).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import smp.v1 as smp

TIMEOUT = 5.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with smp.partition(0):
            self.a = nn.Linear(8, 8)
        with smp.partition(1):
            self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def main(out: Path) -> None:
    smp.init({"partitions": 2, "microbatches": 2, "auto_partition": False, "timeout": TIMEOUT})
    me = smp.rank()
    res: dict = {"rank": me, "size": smp.size(), "local_rank": smp.local_rank(), "pp_rank": smp.pp_rank(),
                 "dp_rank": smp.dp_rank(), "dp_size": smp.dp_size(), "mp_group": smp.get_mp_group()}
    res["allgather"] = smp.allgather(me * 10)
    if me == 0:
        smp.broadcast({"from": 0}, smp.WORLD)
        res["received"] = smp.recv_from(1)
    else:
        res["received"] = smp.recv_from(0)
        smp.send("hello from 1", 0)
    smp.barrier()

    torch.manual_seed(0)
    model = smp.DistributedModel(Net())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler()

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    x, y = torch.randn(4, 8), torch.randn(4, 4)
    losses = train_step(model, x, y)
    res["loss"] = losses.reduce_mean().item()
    res["local"] = [n for n, _ in model.local_named_parameters()]
    if me == 1:  # an overflow in rank 1's gradients only: both ranks must skip the step
        next(model.local_parameters()).grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.local_parameters()]
    scaler.step(opt)
    scaler.update()
    res["stepped"] = any(not torch.equal(a, p) for a, p in zip(before, model.local_parameters()))
    res["scale"] = scaler.get_scale()

    @smp.step
    def broken_eval(model, x):
        model(x)
        raise ValueError("a bug in the evaluation function")

    with torch.no_grad():
        try:
            broken_eval(model, x)
        except Exception as err:  # noqa: BLE001 - what each rank sees is the result
            res["eval_error"] = f"{type(err).__name__}: {err}"

    if me == 0:
        start = time.monotonic()
        try:
            model.state_dict()
        except smp.V1Error as err:
            res["state_dict_error"] = str(err)
        res["state_dict_waited"] = time.monotonic() - start
    (out / f"rank{me}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
