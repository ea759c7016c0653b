"""One rank of ``smp train`` (started by torchrun; see smp/_cli_train.py).

Builds the model from its spec (same seed on every rank, so every rank holds the same
initial weights), wraps it with ``smp.partition`` and trains on the spec's synthetic
batch. The rank that returns the loss prints ``SMP_TRAIN_EVENT {json}`` lines.
"""

from __future__ import annotations

import inspect
import json
import statistics
import sys
import time

EVENT_PREFIX = "SMP_TRAIN_EVENT "


def _emit(event: dict) -> None:
    sys.stdout.write(EVENT_PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    import torch

    import smp
    from smp.cli import _build

    bundle = _build(job["spec"], batch_size=job["batch_size"], seq_len=job["seq_len"], meta=False,
                    microbatches=job["microbatches"])
    kwargs = {"microbatches": job["microbatches"], "schedule": job["schedule"], "loss_fn": bundle.loss_fn}
    params = inspect.signature(smp.partition).parameters
    if job.get("plan") and "plan" in params:
        kwargs["plan"] = smp.Plan.load(job["plan"])
    if "example_args" in params:
        kwargs["example_args"] = bundle.example_args
    if "example_kwargs" in params and bundle.example_kwargs:
        kwargs["example_kwargs"] = bundle.example_kwargs
    if "device" in params:
        kwargs["device"] = job["device"]
    pipe = smp.partition(bundle.model, **kwargs)
    opt = torch.optim.Adam(pipe.parameters(), lr=job["lr"])
    batch = next((int(a.shape[0]) for a in bundle.example_args if isinstance(a, torch.Tensor) and a.dim() > 0), 1)
    times = []
    reporting = False
    for step in range(1, job["steps"] + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(*bundle.example_args, target=bundle.target, **bundle.example_kwargs)
        opt.step()
        seconds = time.perf_counter() - t0
        times.append(seconds)
        if loss is not None:
            reporting = True
            _emit({"event": "step", "step": step, "loss": float(loss), "seconds": seconds,
                   "samples_per_s": batch / seconds if seconds > 0 else 0.0})
    if reporting:
        plan = getattr(pipe, "plan", None)
        predicted = getattr(plan, "step_time", None)
        steady = times[1:] or times
        _emit({"event": "summary", "measured_step_time": statistics.median(steady),
               "predicted_step_time": float(predicted) if predicted else None, "steps": len(times),
               "batch_size": batch})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
