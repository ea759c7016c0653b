"""Start N local gloo ranks running one Python function (tests, benchmarks); never leaves a process behind."""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RankResult", "launch"]

_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RankResult:
    """How one rank ended: exit code (None when it had to be killed), its output, and how long it took."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def launch(target: str, nprocs: int, kwargs: Mapping[str, Any] | None = None, *, timeout: float = 120.0,
           pg_timeout: float = 60.0, threads: int = 1, env: Mapping[str, str] | None = None) -> list[RankResult]:
    """Run ``target`` (``"pkg.module:function"`` or ``"path/file.py:function"``) on ``nprocs`` gloo ranks.

    Each rank runs ``function(rank, world_size, **kwargs)`` after
    ``init_process_group("gloo")`` on a FileStore (which survives any rank's death,
    unlike a TCPStore hosted by rank 0). Every process runs in its own session and is
    killed (whole process group) if it is still alive after ``timeout`` seconds or
    when this call is interrupted.
    """
    with tempfile.TemporaryDirectory(prefix="smp-launch-") as tmp:
        args_path = Path(tmp) / "kwargs.pkl"
        args_path.write_bytes(pickle.dumps(dict(kwargs or {})))
        store = Path(tmp) / "store"
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        full_env["OMP_NUM_THREADS"] = str(threads)
        procs: list[subprocess.Popen] = []
        outs: list[tuple[Any, Any]] = []
        started = time.monotonic()
        try:
            for r in range(nprocs):
                out = open(Path(tmp) / f"out{r}.txt", "w+")
                err = open(Path(tmp) / f"err{r}.txt", "w+")
                outs.append((out, err))
                cmd = [sys.executable, "-m", "runtime.launch", "--target", target, "--rank", str(r), "--world",
                       str(nprocs), "--init", f"file://{store}", "--kwargs", str(args_path), "--pg-timeout",
                       str(pg_timeout), "--threads", str(threads)]
                procs.append(subprocess.Popen(cmd, cwd=str(_ROOT), env=full_env, stdout=out, stderr=err,
                                              start_new_session=True))
            ended: dict[int, float] = {}
            deadline = started + timeout
            while len(ended) < nprocs and time.monotonic() < deadline:
                for r, p in enumerate(procs):
                    if r not in ended and p.poll() is not None:
                        ended[r] = time.monotonic() - started
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait(timeout=10)
        results = []
        for r, (p, (out, err)) in enumerate(zip(procs, outs)):
            out.seek(0)
            err.seek(0)
            rc = p.returncode if r in ended else None
            results.append(RankResult(r, rc, out.read(), err.read(), ended.get(r, time.monotonic() - started)))
            out.close()
            err.close()
        return results


def _resolve(target: str) -> Any:
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_smp_launch_{Path(where).stem}", where)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _worker(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m runtime.launch")
    ap.add_argument("--target", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--kwargs", required=True)
    ap.add_argument("--pg-timeout", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(a.threads)
    kwargs = pickle.loads(Path(a.kwargs).read_bytes())
    fn = _resolve(a.target)
    dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.pg_timeout))
    try:
        fn(a.rank, a.world, **kwargs)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # no destroy_process_group: a peer that already failed would make it wait; exit is enough
    os._exit(0)


if __name__ == "__main__":
    _worker()
