"""The runtime's own error for a pipeline that cannot start as configured."""

from __future__ import annotations

__all__ = ["RuntimeConfigError"]


class RuntimeConfigError(ValueError):
    """The runtime cannot start as configured (world size, plan, loss); raised before any work."""
