"""``smp models``: the built-in model zoo, its presets with their sizes, and each model's options."""

from __future__ import annotations

from smp.cli.options import JsonOpt
from smp.cli.output import print_json, rich_console
from smp.cli.root import app, command

__all__ = ["models_cmd"]


@app.command("models", epilog="Example: smp models --json")
@command
def models_cmd(json_out: JsonOpt = False) -> None:
    """The built-in model zoo: every model, its presets with parameter counts and sizes, and its options."""
    from smp.models import list_models, preset_table
    from smp.units import format_bytes, format_count

    infos = list_models()
    rows = preset_table()
    if json_out:
        print_json({
            "kind": "smp.models",
            "models": [{
                "name": i.name, "description": i.description, "aliases": list(i.aliases),
                "options": [{"name": o.name, "default": o.default, "type": o.type.__name__, "help": o.help}
                            for o in i.options],
                "presets": [{"preset": r["preset"], "params": r["params"], "bytes": r["bytes"], "config": r["config"]}
                            for r in rows if r["model"] == i.name],
            } for i in infos],
        })
        return
    from rich import box
    from rich.table import Table

    con = rich_console()
    t = Table(title="smp model zoo (spec: NAME[:option=value,...], NAME-PRESET, or path/to/file.py:factory)",
              title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, kw in (("model", {}), ("preset", {}), ("params", {"justify": "right"}),
                    ("fp32 size", {"justify": "right"}), ("config", {"overflow": "fold"})):
        t.add_column(col, **kw)
    last = None
    for r in rows:
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items())  # type: ignore[union-attr]
        t.add_row(r["model"] if r["model"] != last else "", str(r["preset"]),
                  f"{int(r['params']):,} ({format_count(int(r['params']))})",  # type: ignore[call-overload]
                  format_bytes(int(r["bytes"])), cfg)  # type: ignore[call-overload]
        last = r["model"]
    con.print(t)
    con.print()
    d = Table(header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    d.add_column("model")
    d.add_column("what it is", overflow="fold", max_width=70)
    d.add_column("options (defaults)", overflow="fold", max_width=60)
    for i in infos:
        opts = ", ".join(f"{o.name}={o.default}" for o in i.options if o.name != "size")
        d.add_row(i.name, i.description, opts)
    con.print(d)
    missing = sorted({i.name for i in infos} - {r["model"] for r in rows})
    if missing:
        con.print(f"(no presets shown for {', '.join(missing)}: they need the `transformers` package)")
