"""Size parsing and human-readable units (smp/units.py)."""

import math

import pytest

from smp.units import format_bytes, format_count, format_rate, format_time, parse_size


@pytest.mark.parametrize("text, expected", [
    ("40GiB", 40 * 2**30),
    ("40 GiB", 40 * 2**30),
    ("40gib", 40 * 2**30),
    ("80GB", 80 * 10**9),
    ("512MiB", 512 * 2**20),
    ("1.5TiB", int(1.5 * 2**40)),
    ("100MB", 10**8),
    ("64KiB", 65536),
    ("1024", 1024),
    ("1024B", 1024),
    ("1e3MB", 10**9),
    (2048, 2048),
])
def test_parse_size_accepts_binary_and_decimal_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "40XB", "40 G", "-1GiB", "0", "forty GiB", "1.2.3GB", "nanGB"])
def test_parse_size_rejects_bad_sizes_with_a_hint(text):
    with pytest.raises(ValueError, match="bad size"):
        parse_size(text)


def test_ambiguous_single_letter_unit_says_why():
    with pytest.raises(ValueError, match="ambiguous"):
        parse_size("40G")


def test_format_time_picks_a_sensible_unit():
    assert format_time(1.234) == "1.23 s"
    assert format_time(0.0456) == "45.6 ms"
    assert format_time(0.000789) == "789 µs"
    assert format_time(12e-9) == "12.0 ns"
    assert format_time(0) == "0 s"
    assert format_time(None) == "-"
    assert format_time(1234.4) == "1234 s"


def test_format_bytes_and_counts():
    assert format_bytes(40 * 2**30) == "40.00 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(None) == "unlimited"
    assert format_bytes(math.inf) == "unlimited"
    assert format_bytes(300 * 2**20) == "300.0 MiB"
    assert format_count(6_392_320) == "6.39M"
    assert format_count(42) == "42"
    assert format_rate(2.5e9) == "2.50 GB/s"
    assert format_rate(1.6e11, "FLOP") == "160 GFLOP/s"
