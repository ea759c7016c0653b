"""``smp calibrate``: measure this machine (matmul FLOP/s, dispatch, memory bandwidth, links) and write a device profile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from smp.cli.options import DEVICE_CHOICES, JsonOpt, choice
from smp.cli.output import print_json, progress_bar, rich_console
from smp.cli.root import app, command

__all__ = ["calibrate_cmd"]


@app.command("calibrate", epilog="Example: smp calibrate -o profiles/my-laptop.json")
@command
def calibrate_cmd(
    output: Annotated[Path, typer.Option("--output", "-o", help="where to write the profile JSON")],
    name: Annotated[Optional[str], typer.Option("--name", help="profile name \\[default: the file's stem]")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="small sizes and few repeats (a few seconds; rougher)")] =
    False,
    device: Annotated[Optional[str], typer.Option(
        "--device", help="cpu | cuda \\[default: cuda when a GPU is present]")] = None,
    no_link: Annotated[bool, typer.Option("--no-link", help="skip the two-process link measurement")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Measure this machine (matmul FLOP/s per dtype and size, dispatch per op, memory bandwidth, gloo/NCCL
    point-to-point) as a profile."""
    from smp.calibrate import calibrate
    from smp.units import format_bytes, format_rate, format_time

    device = choice(device, DEVICE_CHOICES, "--device")
    con = rich_console(stderr=True)
    log = (lambda msg: None) if json_out else (lambda msg: con.print(f"[dim]{msg}[/]"))
    with progress_bar("calibrating", not json_out, unit="measurements") as progress:
        prof = calibrate(name=name or output.stem, quick=quick, device=device, link=not no_link, log=log,
                         progress=progress)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(prof, indent=1) + "\n")
    if json_out:
        print_json(prof)
        return
    out = rich_console()
    dev = prof["device"]
    out.print(f"[bold]{prof['name']}[/]: {dev['name']} ({dev['type']})")
    for dt, flops in dev["peak_flops"].items():
        out.print(f"  matmul {dt:<5} {format_rate(flops, 'FLOP')}")
    for dt, points in dev["gemm_efficiency"].items():
        out.print(f"  matmul {dt:<5} efficiency " + ", ".join(f"{eff:.2f} at 2^{log2:.0f} FLOP" for log2, eff in points))
    out.print(f"  dispatch per op: forward {format_time(dev['dispatch']['fwd'])}, "
              f"backward {format_time(dev['dispatch']['bwd'])}")
    out.print(f"  memory bandwidth {format_rate(dev['memory_bandwidth'])} (copy), memory {format_bytes(dev['memory_bytes'])}")
    intra = prof["links"]["intra_node"]
    if intra.get("bandwidth"):
        out.print(f"  link ({intra['name']}): {format_rate(intra['bandwidth'])}, latency {format_time(intra['latency'])}")
    out.print(f"wrote {output}; use it with `--cluster {output}`")
