"""One rank of ``smp train`` (started by torchrun; see smp/cli/train.py).

Builds the model from its spec (same seed on every rank, so every rank holds the same
initial weights), wraps it with ``smp.partition`` and trains on the spec's synthetic
batch. Every rank gets the loss back from ``step()``; rank 0 prints ``SMP_TRAIN_EVENT {json}`` lines.
A rank that fails prints an ``error`` event with its own message (the parent shows it as one
line instead of torchrun's summary) and its traceback on stderr (shown with ``smp --debug``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

EVENT_PREFIX = "SMP_TRAIN_EVENT "


def _emit(event: dict) -> None:
    sys.stdout.write(EVENT_PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    try:
        return _train(job)
    except Exception as err:  # noqa: BLE001 - every failure reaches the user as this rank's own message
        from partitioner.user_code import raised_by_user_code, user_code_message
        from smp.cli.errors import user_error

        message = user_code_message(err, "your code raised") if raised_by_user_code(err) else user_error(err)
        _emit({"event": "error", "rank": int(os.environ.get("RANK", "0")), "user_error": message is not None,
               "message": " ".join((message or f"{type(err).__name__}: {err}").split())})
        traceback.print_exc()
        return 1


def _train(job: dict) -> int:
    import torch
    import torch.distributed as dist
    from torch.utils._pytree import tree_map

    import smp
    from partitioner.microbatch import batch_size as sample_batch_size
    from smp.models import build_step

    bundle = build_step(job["spec"], microbatches=job["microbatches"], batch_size=job["batch_size"],
                        seq_len=job["seq_len"])
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    bundle.model.to(device)
    args, kwargs_in, target = tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v,
                                       (tuple(bundle.example_args), dict(bundle.example_kwargs), bundle.target))
    kwargs = {"loss_fn": bundle.loss_fn, "timeout": job.get("timeout", 300.0)}
    if job.get("plan"):  # the plan fixes its microbatches and schedule (checked against the flags by smp train)
        kwargs["plan"] = smp.Plan.load(job["plan"])
    else:
        kwargs.update(microbatches=job["microbatches"], schedule=job["schedule"])
    pipe = smp.partition(bundle.model, **kwargs)
    # Made before the first step (which partitions the model), as in any training script:
    # parameters that end up on other ranks get no gradient and are skipped.
    opt = torch.optim.Adam(pipe.parameters(), lr=job["lr"])
    reporting = int(os.environ.get("RANK", "0")) == 0
    batch = sample_batch_size(args, kwargs_in) or 1  # dim 0 of the first tensor input, positional or keyword
    times = []
    for step in range(1, job["steps"] + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(*args, target=target, **kwargs_in)
        opt.step()
        seconds = time.perf_counter() - t0
        times.append(seconds)
        if reporting:
            _emit({"event": "step", "step": step, "loss": float(loss), "seconds": seconds,
                   "samples_per_s": batch / seconds if seconds > 0 else 0.0})
    if reporting:
        steady = times[1:] or times
        _emit({"event": "summary", "measured_step_time": statistics.median(steady),
               "predicted_step_time": pipe.plan.step_time, "steps": len(times), "batch_size": batch,
               "world_size": dist.get_world_size() if dist.is_initialized() else 1,
               "backend": dist.get_backend() if dist.is_initialized() else None,
               "rank0_params": sum(p.numel() for p in pipe.parameters()),
               "model_params": pipe.plan.model.num_params})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
