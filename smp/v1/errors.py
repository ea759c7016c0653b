"""The one error type of the v1 layer: a v1 script asked for what smp cannot do as asked; the message says the fix."""

from __future__ import annotations

__all__ = ["V1Error"]


class V1Error(RuntimeError):
    """A v1 call or configuration smp cannot honour as given; the message names the cause and the fix."""
