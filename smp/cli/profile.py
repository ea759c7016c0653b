"""``smp profile``: trace and profile a model op by op, its totals and heaviest ops, and the op graph file."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from smp.cli.options import (DEVICE_CHOICES, DeviceOpt, DtypeOpt, JsonOpt, MetaOpt, ModelArg, RepeatsOpt, SeqOpt,
                             TimingOpt, check_cluster, choice, positive, timing_for)
from smp.cli.output import print_json, progress_bar, rich_console, spec_name
from smp.cli.root import app, command

__all__ = ["profile_cmd"]


@app.command("profile", epilog="Example: smp profile gpt:layers=4 --batch-size 4 -o graph.json")
@command
def profile_cmd(
    model: ModelArg,
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", "-b", help="batch profiled (one microbatch; a file model's sample rows are repeated or cut "
                                   "to it) \\[default: the spec's sample batch]")] = None,
    seq_len: SeqOpt = None,
    device: DeviceOpt = None,
    timing: TimingOpt = None,
    cluster: Annotated[Optional[str], typer.Option(
        "--cluster", "-c", help="device profile that analytic timing prices ops on (built-in name or path)")] = None,
    meta: MetaOpt = False,
    dtype: DtypeOpt = None,
    repeats: RepeatsOpt = 3,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="write the op graph JSON here")] = None,
    top: Annotated[int, typer.Option("--top", help="how many of the heaviest ops to list")] = 10,
    json_out: JsonOpt = False,
) -> None:
    """Trace and profile a model op by op: op count, totals, the heaviest ops; -o writes the op graph."""
    positive(batch_size, "--batch-size")
    positive(repeats, "--repeats")
    device = choice(device, DEVICE_CHOICES, "--device")
    check_cluster(cluster)
    timing_, profile_name = timing_for(timing, meta, cluster)
    from partitioner.profile import profile
    from partitioner.program import fingerprint
    from partitioner.trace import trace
    from smp.models import build

    bundle = build(model, batch_size=batch_size, seq_len=seq_len, meta=meta)
    t0 = time.perf_counter()
    gm = trace(bundle.model, bundle.example_args, bundle.example_kwargs)
    with progress_bar("profiling", not json_out) as cb:
        graph = profile(bundle.model, bundle.example_args, bundle.example_kwargs, timing=timing_, device=device,
                        repeats=repeats, device_profile=profile_name, dtype=dtype, training=bundle.model.training,
                        graph_module=gm if device in (None, "cpu") else None, progress=cb)
    seconds = time.perf_counter() - t0
    from partitioner.microbatch import batch_size as batch_of

    graph.meta.update({
        "name": model, "class": f"{type(bundle.model).__module__}.{type(bundle.model).__qualname__}",
        "fingerprint": fingerprint(gm, bundle.model), "num_params": bundle.num_params(),
        "param_bytes": bundle.param_bytes(),
        "batch_size": batch_of(bundle.example_args, bundle.example_kwargs),
    })
    if output is not None:
        graph.to_json(output)
    if json_out:
        print_json(_profile_json(graph, model, top, output, seconds))
        return
    _print_profile(graph, model, top, output, seconds)


def _heavy_rows(graph, top: int) -> list[dict[str, Any]]:
    return [{"name": n, "op": d["op"], "module": d["module"], "fwd_s": d["fwd"], "bwd_s": d["bwd"],
             "out_bytes": d["out_bytes"], "params_bytes": d["params"], "flops": d["flops"]}
            for n, d in graph.heaviest(top, key="fwd")]


def _profile_json(graph, spec: str, top: int, output: Path | None, seconds: float) -> dict[str, Any]:
    m = graph.meta
    return {
        "kind": "smp.profile_summary", "schema": 1, "model": spec, "graph_file": str(output) if output else None,
        "ops": len(graph), "edges": graph.nx.number_of_edges(),
        "timing": m.get("timing"), "device": m.get("device"), "device_profile": m.get("device_profile"),
        "batch_size": m.get("batch_size"), "fingerprint": m.get("fingerprint"),
        "num_params": m.get("num_params"),
        "totals": {"fwd_s": graph.total_fwd, "bwd_s": graph.total_bwd, "params_bytes": graph.total_params,
                   "buffers_bytes": graph.total_buffers, "activation_bytes": graph.total_out_bytes,
                   "flops": graph.total_flops},
        "heaviest": _heavy_rows(graph, top),
        "seconds": seconds,
    }


def _print_profile(graph, spec: str, top: int, output: Path | None, seconds: float) -> None:
    from rich import box
    from rich.table import Table

    from smp.units import format_bytes, format_count, format_time

    m = graph.meta
    con = rich_console()
    how = m.get("timing")
    if how == "analytic":
        how += f" on the {m.get('device_profile')} profile" + (f" ({m['dtype']})" if m.get("dtype") else "")
    else:
        how += f" on {m.get('device')}, median of {m.get('repeats')}"
    con.print(f"[bold]{spec_name(spec)}[/]: {len(graph)} ops, {graph.nx.number_of_edges()} edges, "
              f"{format_count(m.get('num_params') or 0)} parameters; batch {m.get('batch_size')}; timing {how}; "
              f"profiled in {format_time(seconds)}")
    con.print(f"totals per batch: forward {format_time(graph.total_fwd)}, backward {format_time(graph.total_bwd)}, "
              f"parameters {format_bytes(graph.total_params)}, activations {format_bytes(graph.total_out_bytes)}, "
              f"{graph.total_flops / 1e9:.3g} GFLOP forward")
    t = Table(title=f"the {min(top, len(graph))} heaviest ops (forward time)", title_justify="left",
              header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, kw in (("op", {}), ("kind", {}), ("module", {"overflow": "fold", "max_width": 32}),
                    ("fwd", {"justify": "right"}), ("bwd", {"justify": "right"}), ("output", {"justify": "right"}),
                    ("params", {"justify": "right"}), ("GFLOP", {"justify": "right"}), ("share", {"justify": "right"})):
        t.add_column(col, **kw)
    total = graph.total_fwd or 1.0
    for r in _heavy_rows(graph, top):
        t.add_row(r["name"], r["op"], r["module"] or "-", format_time(r["fwd_s"]), format_time(r["bwd_s"]),
                  format_bytes(r["out_bytes"]), format_bytes(r["params_bytes"]) if r["params_bytes"] else "-",
                  f"{r['flops'] / 1e9:.3g}", f"{r['fwd_s'] / total:.1%}")
    con.print(t)
    if output is not None:
        con.print(f"wrote the op graph to {output} (plan it with `smp plan {output} --stages N`)")
