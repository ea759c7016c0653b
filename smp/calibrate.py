"""``smp calibrate``: measure this machine and write an ``smp.profile`` usable with ``--cluster``.

What is measured (docs/cli.md#smp-calibrate):

- ``device.peak_flops``: square matmul throughput per dtype (fp32, bf16, fp64; fp16 when it
  is not much slower than fp32), the best of a few timed runs after a warm-up. These
  are *achieved* figures, so ``efficiency`` is 1.0 (the shipped profiles hold vendor
  peaks with efficiency < 1).
- ``device.gemm_efficiency``: matmuls of a few smaller sizes per dtype (fp32, and bf16 where it
  is not emulated), each as a fraction of that dtype's ``peak_flops``, by log2 of its FLOPs.
- ``device.dispatch``: seconds per op the host takes to run a traced chain of tiny ops (Linear,
  LayerNorm, GELU, add: kernels too small to matter), forward with autograd recording, and its
  backward; on a GPU the kernels queue behind the host, which is the time the GPU waits.
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
import math
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["calibrate", "measure_matmul", "measure_copy", "measure_link", "measure_dispatch", "measure_gemm_table",
           "CalibrationError", "ProgressFn"]

#: Ping-pong message sizes in bytes (full and --quick).
LINK_SIZES = (8, 1024, 64 * 1024, 1 << 20, 16 << 20, 64 << 20)
LINK_SIZES_QUICK = (8, 1024, 64 * 1024, 1 << 20, 8 << 20)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
#: Square matmul sizes of the GEMM efficiency table, below the peak's size (full and --quick), per device type.
GEMM_SIZES = {"cpu": ((32, 64, 128, 256, 512), (32, 96)), "cuda": ((128, 256, 512, 1024, 2048, 4096), (256, 1024))}
#: Blocks of four tiny ops in the dispatch chain (full and --quick).
DISPATCH_BLOCKS = (100, 25)
ProgressFn = Callable[[int, int], None]


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


def measure_gemm_table(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...], peak: float, *,
                       budget: float) -> list[list[float]]:
    """[log2 FLOPs, fraction of ``peak``] of ``n x n`` matmuls at each of ``sizes``.

    On a GPU a matmul smaller than the host's dispatch is timed at the dispatch rate: its
    efficiency reads low, which the price's max(kernel, dispatch) makes harmless."""
    points = []
    for n in sizes:
        rate = measure_matmul(device, dtype, n, budget=budget)
        points.append([round(math.log2(2.0 * n ** 3), 3), float(f"{rate / peak:.4g}")])
    return points


class _TinyBlock(torch.nn.Module):
    """Four ops a transformer is made of, on tensors small enough that their kernels cost nothing."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.norm(self.linear(x)))


def measure_dispatch(device: torch.device, blocks: int, *, budget: float) -> tuple[float, float, int]:
    """(forward, backward) host seconds per op of a traced chain of ``blocks`` tiny blocks, and its op count.

    The chain runs as smp runs a stage, a ``torch.fx`` program; ops are counted as the profile counts
    them (each call node). The forward records autograd's graph, as training does; the backward is
    timed on its own, from a graph built beforehand. On a CPU it runs on one intra-op thread: tensors
    this small never use more, and on a busy machine waking idle threads would be timed instead."""
    import torch.fx as fx

    from partitioner.profile_measured import profiling_threads

    with profiling_threads(1 if device.type == "cpu" else None):
        return _time_chain(fx.symbolic_trace(torch.nn.Sequential(*(_TinyBlock(8) for _ in range(blocks)))).to(device),
                           device, budget)


def _time_chain(chain: Any, device: torch.device, budget: float) -> tuple[float, float, int]:
    """(forward, backward) best seconds per op of ``chain`` (a traced program), and its op count."""
    ops = sum(1 for node in chain.graph.nodes if node.op.startswith("call_"))
    x = torch.randn(1, 8, device=device, requires_grad=True)
    fwd = _best_time(lambda: chain(x), device, budget=budget)
    times: list[float] = []
    start = time.perf_counter()
    for i in range(1000):
        out = chain(x).sum()
        _sync(device)
        t0 = time.perf_counter()
        out.backward()
        _sync(device)
        if i > 0:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
        if len(times) >= 3 and time.perf_counter() - start >= budget:
            break
    return fwd / ops, min(times) / ops, ops


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


def _measure_flops(dev: torch.device, n: int, budget: float, quick: bool, log: Callable[[str], None],
                   tick: Callable[[], None]) -> tuple[dict[str, float], dict[str, str]]:
    """Achieved matmul FLOP/s per dtype, and why a dtype was left out (emulated half precision)."""
    gpu = dev.type == "cuda"
    flops: dict[str, float] = {}
    notes: dict[str, str] = {}
    for key in ("fp32", "bf16", "fp16", "fp64"):
        tick()
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
              log: Callable[[str], None] = lambda msg: None, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Measure this machine and return an ``smp.profile`` dict (see the module docstring).

    ``progress(done, total)`` is called as each measurement starts and once at the end."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CalibrationError("--device cuda asked for, but torch sees no GPU here")
    gpu = dev.type == "cuda"
    n = (4096 if quick else 8192) if gpu else (384 if quick else 1024)
    budget = 0.1 if quick else 0.4
    total, done = 4 + 2 + 2 + (1 if link else 0), [0]  # matmul dtypes, table dtypes, copy + dispatch, link

    def tick() -> None:
        if progress is not None:
            progress(done[0], total)
        done[0] += 1

    flops, notes = _measure_flops(dev, n, budget, quick, log, tick)
    gemm_sizes = GEMM_SIZES[dev.type][1 if quick else 0]
    gemm_table: dict[str, list[list[float]]] = {}
    for key in ("fp32", "bf16"):
        tick()
        if key not in flops or flops[key] < 0.25 * flops["fp32"]:  # emulated: no curve worth pricing
            continue
        gemm_table[key] = measure_gemm_table(dev, _DTYPES[key], gemm_sizes, flops[key], budget=budget / 4)
        gemm_table[key].append([round(math.log2(2.0 * n ** 3), 3), 1.0])
        log(f"matmul {key} efficiency: " + ", ".join(f"{s}x{s} {eff:.2f}" for s, (_, eff) in
                                                     zip(gemm_sizes, gemm_table[key])))
    tick()
    nbytes = (256 << 20) if gpu else ((32 << 20) if quick else (256 << 20))
    bandwidth = measure_copy(dev, nbytes, budget=budget)
    log(f"copy {nbytes >> 20} MiB: {bandwidth / 1e9:.1f} GB/s")
    tick()
    blocks = DISPATCH_BLOCKS[1 if quick else 0]
    dispatch_fwd, dispatch_bwd, chain_ops = measure_dispatch(dev, blocks, budget=budget)
    log(f"dispatch per op: forward {dispatch_fwd * 1e6:.1f} µs, backward {dispatch_bwd * 1e6:.1f} µs "
        f"({chain_ops} tiny ops)")
    dev_name, memory, count = _device_identity(dev)
    link_info = None
    if link:
        tick()
        log("ping-pong between two local processes…")
        link_info = measure_link(quick=quick)
        log(f"{link_info['backend']}: latency {link_info['latency'] * 1e6:.1f} µs, "
            f"bandwidth {link_info['bandwidth'] / 1e9:.2f} GB/s")
    if progress is not None:
        progress(total, total)
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
            "gemm_efficiency": gemm_table,
            "dispatch": {"fwd": dispatch_fwd, "bwd": dispatch_bwd},
        },
        "topology": {"nodes": 1, "devices_per_node": count},
        "links": {"intra_node": intra, "inter_node": inter},
        "sources": {
            "device.peak_flops": f"{where}: best of timed {n}x{n} matmuls per dtype (fp64 at {n // 2}); achieved, "
                                 "not vendor peak" + ("; " + notes["fp16"] if "fp16" in notes else ""),
            "device.memory_bytes": f"{where}: " + ("torch.cuda total_memory" if gpu else "physical RAM (sysconf)"),
            "device.memory_bandwidth": f"{where}: best copy of a {nbytes >> 20} MiB tensor, read + write bytes",
            "device.efficiency": "1.0 because peak_flops are measured achieved throughput, not vendor peaks",
            "device.gemm_efficiency": f"{where}: best of timed square matmuls of "
                                      f"{', '.join(str(s) for s in gemm_sizes)} per dtype, each over that dtype's "
                                      f"peak_flops (the {n}x{n} point is 1.0); by log2 of the matmul's FLOPs",
            "device.dispatch": f"{where}: host seconds per op of a torch.fx chain of {chain_ops} tiny ops (Linear, "
                               "LayerNorm, GELU, add on 1x8 tensors), forward recording autograd's graph, and its "
                               "backward; best of repeated runs",
            "topology": f"{where}: one node, {count} device(s)",
            "links.intra_node": link_src,
            "links.inter_node": inter_src,
        },
        "measurements": {
            "matmul_size": n,
            "gemm_sizes": list(gemm_sizes),
            "dispatch_ops": chain_ops,
            "copy_bytes": nbytes,
            "threads": torch.get_num_threads(),
            "link": None if link_info is None else {
                "backend": link_info["backend"],
                "one_way_seconds": {str(k): v for k, v in sorted(link_info["one_way_seconds"].items())},
            },
        },
    }
