"""Sizes and times for people (the one implementation lives in partitioner/units.py)."""

from partitioner.units import SIZE_UNITS, format_bytes, format_count, format_rate, format_time, parse_size

__all__ = ["parse_size", "format_bytes", "format_time", "format_count", "format_rate", "SIZE_UNITS"]
