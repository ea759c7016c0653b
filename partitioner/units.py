"""Sizes and times for people: parse ``40GiB`` / ``512 MB``, print bytes and seconds in sensible units."""

from __future__ import annotations

import math
import re

__all__ = ["parse_size", "format_bytes", "format_time", "format_count", "format_rate", "SIZE_UNITS"]

#: Unit -> bytes. Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) of 1000.
SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Bytes in a size such as ``40GiB``, ``40 GB``, ``1.5TiB``, ``512MiB`` or a plain byte count.

    Units are case-insensitive: ``GiB``/``MiB``/``KiB``/``TiB`` are binary (1024-based),
    ``GB``/``MB``/``KB``/``TB`` decimal, ``B`` bytes. A bare ``G`` or ``M`` is refused
    because it is ambiguous. Raises ``ValueError`` with the accepted forms.
    """
    if isinstance(text, bool):
        raise ValueError(f"bad size {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), "b"
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise ValueError(f"bad size {text!r}: write a number and a unit, e.g. 40GiB, 80GB, 512MiB")
        value = float(m.group(1)) * (10 ** int(m.group(2)) if m.group(2) else 1)
        unit = (m.group(3) or "b").lower()
        if unit not in SIZE_UNITS:
            hint = " (ambiguous: write GiB or GB)" if unit in ("g", "m", "k", "t") else ""
            raise ValueError(f"bad size {text!r}: unknown unit {m.group(3)!r}{hint}; "
                             "use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB")
    size = value * SIZE_UNITS[unit]
    if not math.isfinite(size) or size <= 0:
        raise ValueError(f"bad size {text!r}: must be more than 0 bytes")
    return int(round(size))


def format_bytes(n: float | None, *, none: str = "unlimited") -> str:
    """``1.50 GiB``, ``800.0 KiB``, ``12 B``; ``none`` (default ``unlimited``) for None or infinity."""
    if n is None or (isinstance(n, float) and math.isinf(n)):
        return none
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.2f} {unit}" if abs(value) < 100 else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def format_time(seconds: float | None, *, digits: int = 3) -> str:
    """Seconds in the unit that reads best: ``1.23 s``, ``45.6 ms``, ``789 µs``, ``12 ns``."""
    if seconds is None:
        return "-"
    if isinstance(seconds, float) and (math.isnan(seconds) or math.isinf(seconds)):
        return str(seconds)
    s = abs(seconds)
    if s == 0:
        return "0 s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if s >= scale:
            return f"{_sig(seconds / scale, digits)} {unit}"
    return f"{_sig(seconds / 1e-9, digits)} ns"


def format_rate(per_second: float, unit: str = "B") -> str:
    """A throughput: ``12.3 GB/s``, ``950 MFLOP/s`` (decimal prefixes, as vendors quote them)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(per_second) >= scale:
            return f"{_sig(per_second / scale, 3)} {prefix}{unit}/s"
    return f"{_sig(per_second, 3)} {unit}/s"


def format_count(n: float) -> str:
    """``6.39M``, ``1.11B``, ``15.2K``, ``42``."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{int(n)}"


def _sig(x: float, digits: int) -> str:
    """``x`` with about ``digits`` significant figures, no exponent (1.23, 45.6, 789)."""
    a = abs(x)
    if a >= 10 ** digits:
        return f"{x:.0f}"
    decimals = max(0, digits - 1 - (int(math.floor(math.log10(a))) if a > 0 else 0))
    return f"{x:.{decimals}f}"
