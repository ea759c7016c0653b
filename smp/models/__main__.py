"""`python -m smp.models`: print the zoo's presets and their parameter counts as a Markdown table."""

from __future__ import annotations

import sys
import time

from smp.models import list_models, preset_table


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python -m smp.models   # presets of every zoo model, built on the meta device")
        return 0
    start = time.perf_counter()
    print("| model | preset | params | fp32 size | options |")
    print("| --- | --- | ---: | ---: | --- |")
    for row in preset_table():
        opts = ",".join(f"{k}={v}" for k, v in row["config"].items())  # type: ignore[union-attr]
        params = int(row["params"])  # type: ignore[call-overload]
        print(
            f"| {row['model']} | {row['preset']} | {params:,} ({_human(params)}) "
            f"| {int(row['bytes']) / 2**30:.2f} GiB | `{opts}` |"  # type: ignore[call-overload]
        )
    print(f"\n{len(list_models())} models; table built on the meta device in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
