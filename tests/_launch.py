"""Start N local gloo ranks running one Python function (tests, benchmarks); never leaves a process behind.

Not shipped: users launch with torchrun. Tests import it as ``_launch`` (this folder is on their path);
benchmarks put this folder on ``sys.path`` first.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import pickle
import signal
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


#: Imported once by the fork server, so that each rank starts in milliseconds instead of
#: re-importing torch and this project (seconds of CPU per rank; tests start hundreds of ranks).
#: Fixed rather than a parameter: a process has one fork server, started with the first launch's list.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "partitioner", "runtime.engine", "smp"]


def _start_method(fresh: bool) -> multiprocessing.context.BaseContext:
    """A new interpreter per rank, or the forkserver start method with torch preloaded (no torch
    op has run there, so no thread pool exists when a rank is forked from it: forking a process
    that ran ops is unsafe)."""
    if fresh:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def launch(target: str, nprocs: int, kwargs: Mapping[str, Any] | None = None, *, timeout: float = 120.0,
           pg_timeout: float = 60.0, threads: int = 1, env: Mapping[str, str] | None = None,
           fresh: bool = False) -> list[RankResult]:
    """Run ``target`` (``"pkg.module:function"`` or ``"path/file.py:function"``) on ``nprocs`` gloo ranks.

    Each rank runs ``function(rank, world_size, **kwargs)`` after
    ``init_process_group("gloo")`` on a FileStore (which survives any rank's death,
    unlike a TCPStore hosted by rank 0), in a process forked from a server that has
    imported torch, with ``env`` added to this process's environment. Every rank runs in
    its own session and is killed (whole process group) if it is still alive after
    ``timeout`` seconds or when this call is interrupted.

    ``fresh``: start each rank in a new interpreter instead (seconds slower), for measuring a
    rank's resident memory: a forked rank maps the server's libraries lazily, so its RSS grows
    by the library code it touches, which a new interpreter has counted before its baseline.
    """
    ctx = _start_method(fresh)
    with tempfile.TemporaryDirectory(prefix="smp-launch-") as tmp:
        store = Path(tmp) / "store"
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["OMP_NUM_THREADS"] = str(threads)
        rank_args = _RankArgs(target, nprocs, f"file://{store}", pickle.dumps(dict(kwargs or {})), pg_timeout,
                              threads, full_env)
        procs: list[multiprocessing.process.BaseProcess] = []
        logs = [(Path(tmp) / f"out{r}.txt", Path(tmp) / f"err{r}.txt") for r in range(nprocs)]
        started = time.monotonic()
        try:
            for r in range(nprocs):
                proc = ctx.Process(target=_rank_process, args=(rank_args, r, *map(str, logs[r])), daemon=False)
                proc.start()
                procs.append(proc)
            ended: dict[int, float] = {}
            deadline = started + timeout
            while len(ended) < nprocs and time.monotonic() < deadline:
                for r, p in enumerate(procs):
                    if r not in ended and p.exitcode is not None:
                        ended[r] = time.monotonic() - started
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.exitcode is None:
                    _kill_session(p)
        results = []
        for r, p in enumerate(procs):
            out, err = (path.read_text(errors="replace") if path.exists() else "" for path in logs[r])
            rc = p.exitcode if r in ended else None
            results.append(RankResult(r, rc, out, err, ended.get(r, time.monotonic() - started)))
            p.close()
        return results


def _kill_session(proc: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL a rank and everything it started (its session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # not yet its own session leader: the rank alone
        proc.kill()
    proc.join(timeout=10)


@dataclass(frozen=True)
class _RankArgs:
    """What every rank of one launch shares."""

    target: str
    world: int
    init_method: str
    kwargs: bytes
    pg_timeout: float
    threads: int
    env: Mapping[str, str]


def _rank_process(a: _RankArgs, rank: int, out_path: str, err_path: str) -> None:
    """A rank's process (forked or new): its own session, environment and output files, then the target."""
    os.setsid()
    os.environ.clear()
    os.environ.update(a.env)
    for fd, path in ((1, out_path), (2, err_path)):
        target_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target_fd, fd)
        os.close(target_fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(_ROOT)
    if str(_ROOT) not in sys.path:
        sys.path.insert(0, str(_ROOT))
    _run_rank(a.target, rank, a.world, a.init_method, pickle.loads(a.kwargs), a.pg_timeout, a.threads)


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


def _run_rank(target: str, rank: int, world: int, init_method: str, kwargs: dict[str, Any], pg_timeout: float,
              threads: int) -> None:
    """Join the gloo group and run the target; exit without tearing the group down."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    fn = _resolve(target)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        fn(rank, world, **kwargs)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # no destroy_process_group: a peer that already failed would make it wait; exit is enough
    os._exit(0)
