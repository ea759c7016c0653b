"""``smp calibrate``: measure this machine and write an ``smp.profile`` usable with ``--cluster``.

What is measured (docs/cli.md#smp-calibrate):

- ``device.peak_flops``: square matmul throughput per dtype (fp32, bf16, fp64; fp16 when it
  is not much slower than fp32), the best of a few timed runs after a warm-up. These
  are *achieved* figures, so ``efficiency`` is 1.0 (the shipped profiles hold vendor
  peaks with efficiency < 1).
- ``device.memory_bandwidth``: a large tensor copy, counted as bytes read + bytes written.
- ``device.memory_bytes``: physical RAM (CPU) or the GPU's total memory.
- ``links.intra_node``: a point-to-point ping-pong between two local processes
  (torch.distributed; gloo over loopback TCP, NCCL when there are two GPUs) at several
  sizes: latency is half the round trip of the smallest message, bandwidth comes from
  the largest ones. ``links.inter_node`` is a copy (one machine cannot measure its
  network to another), with a note saying so.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["calibrate", "measure_matmul", "measure_copy", "measure_link", "CalibrationError"]

#: Ping-pong message sizes in bytes (full and --quick).
LINK_SIZES = (8, 1024, 64 * 1024, 1 << 20, 16 << 20, 64 << 20)
LINK_SIZES_QUICK = (8, 1024, 64 * 1024, 1 << 20, 8 << 20)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


class CalibrationError(ValueError):
    """A measurement could not be made; the message says which and how to skip it."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], Any], device: torch.device, *, budget: float, min_runs: int = 3,
               warmup: int = 1) -> float:
    """The fastest of repeated runs of ``fn`` (at least ``min_runs``, until ``budget`` seconds pass)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if len(times) >= 1000:
            break
    return min(times)


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int, *, budget: float) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` matmul (2 n^3 FLOPs) in ``dtype`` on ``device``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _best_time(lambda: torch.mm(a, b), device, budget=budget)
    return 2.0 * n ** 3 / seconds


def measure_copy(device: torch.device, nbytes: int, *, budget: float) -> float:
    """Bytes/s of copying a ``nbytes`` tensor into another (read + write = 2 x nbytes moved)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device, budget=budget)
    return 2.0 * src.numel() * 4 / seconds


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _link_worker(rank: int, port: int, backend: str, sizes: tuple[int, ...], iters_small: int, iters_large: int,
                 queue: Any) -> None:
    """One side of the ping-pong; rank 0 puts {size: one-way seconds} (or an error string) on ``queue``."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=_dt.timedelta(seconds=60))
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        results: dict[int, float] = {}
        for size in sizes:
            buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
            iters = iters_small if size <= 64 * 1024 else iters_large
            times = []
            for i in range(iters + 2):  # two warm-up round trips
                _sync(device)
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                _sync(device)
                if i >= 2:
                    times.append((time.perf_counter() - t0) / 2)
            results[buf.numel() * 4] = statistics.median(times)
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            queue.put(results)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises
        if rank == 0:
            queue.put(f"{type(err).__name__}: {err}")


def measure_link(*, quick: bool = False, backend: str | None = None, timeout: float = 90.0) -> dict[str, Any]:
    """Ping-pong between two local processes: one-way time per size, latency and bandwidth."""
    import torch.multiprocessing as mp

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    sizes = LINK_SIZES_QUICK if quick else LINK_SIZES
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_link_worker, args=(r, port, backend, sizes, 10 if quick else 30, 3 if quick else 6,
                                                    queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=timeout)
    except Exception:  # queue.Empty
        result = f"no answer from the two processes within {timeout:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if isinstance(result, str):
        raise CalibrationError(f"the two-process {backend} link measurement failed ({result}); "
                               "rerun with --no-link to skip it")
    one_way = {int(k): float(v) for k, v in result.items()}
    latency = one_way[min(one_way)]
    large = sorted(one_way)[-2:]
    bandwidth = max(s / max(one_way[s] - latency, 1e-12) for s in large)
    return {"backend": backend, "one_way_seconds": one_way, "latency": latency, "bandwidth": bandwidth}


def _host_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _measure_flops(dev: torch.device, n: int, budget: float, quick: bool,
                   log: Callable[[str], None]) -> tuple[dict[str, float], dict[str, str]]:
    """Achieved matmul FLOP/s per dtype, and why a dtype was left out (emulated half precision)."""
    gpu = dev.type == "cuda"
    flops: dict[str, float] = {}
    notes: dict[str, str] = {}
    for key in ("fp32", "bf16", "fp16", "fp64"):
        if gpu and key == "fp64" and quick:
            continue
        t0 = time.perf_counter()
        n_half = n
        if not gpu and key in ("bf16", "fp16") and "fp32" in flops:
            # Half precision is emulated (very slowly) on CPUs without native units: one small run first.
            probe = measure_matmul(dev, _DTYPES[key], 256, budget=0.0)
            if probe < 0.25 * flops["fp32"]:
                if key == "fp16":
                    notes["fp16"] = (f"fp16 matmul ran at {probe / 1e9:.2f} GFLOP/s (256x256), under a quarter of "
                                     "fp32: left out, so analytic timing prices fp16 at the fp32 rate")
                    log(f"matmul {key}: {probe / 1e9:.1f} GFLOP/s at 256x256, too slow (emulated): left out")
                    continue
                n_half = 256
        size = n_half if key != "fp64" else n // 2
        rate = measure_matmul(dev, _DTYPES[key], size, budget=budget)
        log(f"matmul {key}: {rate / 1e9:.1f} GFLOP/s ({size}x{size}, {time.perf_counter() - t0:.1f} s)")
        if key == "fp16" and not gpu and rate < 0.25 * flops["fp32"] and "fp16" not in notes:
            notes["fp16"] = (f"fp16 matmul measured {rate / 1e9:.2f} GFLOP/s, under a quarter of fp32: "
                             "left out, so analytic timing prices fp16 at the fp32 rate")
            continue
        flops[key] = rate
    return flops, notes


def _device_identity(dev: torch.device) -> tuple[str, int, int]:
    """(device name, memory bytes, devices on this node)."""
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return props.name, int(props.total_memory), torch.cuda.device_count()
    return f"{_cpu_name()} ({torch.get_num_threads()} threads)", _host_memory() or 0, 1


def _links(link_info: dict[str, Any] | None, where: str) -> tuple[dict, dict, str, str]:
    """(intra-node link, inter-node link, and the source of each) from a measurement, or the cpu profile's."""
    if link_info is None:
        from partitioner.devices import load_profile

        base = load_profile("cpu")["links"]
        src = "not measured (--no-link): copied from the built-in cpu profile"
        return dict(base["intra_node"]), dict(base["inter_node"]), src, src
    backend = link_info["backend"]
    transport = "NVLink/PCIe (NCCL)" if backend == "nccl" else "loopback TCP"
    intra = {"name": f"{backend} over {transport} (measured)", "bandwidth": link_info["bandwidth"],
             "latency": link_info["latency"]}
    inter = dict(intra, name=f"{backend} (copy of the measured local link)")
    link_src = (f"{where}: {backend} send/recv ping-pong between two local processes, sizes "
                f"{', '.join(str(s) for s in sorted(link_info['one_way_seconds']))} bytes; latency is half the "
                "round trip of the smallest, bandwidth from the largest")
    inter_src = ("not measured: one machine cannot measure the network to another; a copy of the local link. "
                 "Edit it for a multi-node cluster")
    return intra, inter, link_src, inter_src


def calibrate(*, name: str = "this-machine", quick: bool = False, device: str | None = None, link: bool = True,
              log: Callable[[str], None] = lambda msg: None) -> dict[str, Any]:
    """Measure this machine and return an ``smp.profile`` dict (see the module docstring)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CalibrationError("--device cuda asked for, but torch sees no GPU here")
    gpu = dev.type == "cuda"
    n = (4096 if quick else 8192) if gpu else (384 if quick else 1024)
    budget = 0.1 if quick else 0.4
    flops, notes = _measure_flops(dev, n, budget, quick, log)
    nbytes = (256 << 20) if gpu else ((32 << 20) if quick else (256 << 20))
    bandwidth = measure_copy(dev, nbytes, budget=budget)
    log(f"copy {nbytes >> 20} MiB: {bandwidth / 1e9:.1f} GB/s")
    dev_name, memory, count = _device_identity(dev)
    link_info = None
    if link:
        log("ping-pong between two local processes…")
        link_info = measure_link(quick=quick)
        log(f"{link_info['backend']}: latency {link_info['latency'] * 1e6:.1f} µs, "
            f"bandwidth {link_info['bandwidth'] / 1e9:.2f} GB/s")
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    where = f"measured by smp calibrate on {socket.gethostname()} at {when}" + (" (--quick)" if quick else "")
    intra, inter, link_src, inter_src = _links(link_info, where)
    return {
        "kind": "smp.profile",
        "schema": 1,
        "name": name,
        "description": f"{dev_name}, {where}.",
        "device": {
            "name": dev_name,
            "type": dev.type,
            "peak_flops": flops,
            "memory_bytes": memory,
            "memory_bandwidth": bandwidth,
            "efficiency": 1.0,
        },
        "topology": {"nodes": 1, "devices_per_node": count},
        "links": {"intra_node": intra, "inter_node": inter},
        "sources": {
            "device.peak_flops": f"{where}: best of timed {n}x{n} matmuls per dtype (fp64 at {n // 2}); achieved, "
                                 "not vendor peak" + ("; " + notes["fp16"] if "fp16" in notes else ""),
            "device.memory_bytes": f"{where}: " + ("torch.cuda total_memory" if gpu else "physical RAM (sysconf)"),
            "device.memory_bandwidth": f"{where}: best copy of a {nbytes >> 20} MiB tensor, read + write bytes",
            "device.efficiency": "1.0 because peak_flops are measured achieved throughput, not vendor peaks",
            "topology": f"{where}: one node, {count} device(s)",
            "links.intra_node": link_src,
            "links.inter_node": inter_src,
        },
        "measurements": {
            "matmul_size": n,
            "copy_bytes": nbytes,
            "threads": torch.get_num_threads(),
            "link": None if link_info is None else {
                "backend": link_info["backend"],
                "one_way_seconds": {str(k): v for k, v in sorted(link_info["one_way_seconds"].items())},
            },
        },
    }
