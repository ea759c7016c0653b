"""What the ``smp`` CLI and its training workers call a user's error, and the exit code it gets."""

from __future__ import annotations

import json

__all__ = ["CLIUsageError", "user_error", "exit_code"]


class CLIUsageError(ValueError):
    """Bad command-line usage (a bad option value): exit code 2."""


def exit_code(err: BaseException) -> int:
    """2 for bad usage (an unknown model, a bad option value), 1 for every other error."""
    from partitioner.microbatch import MicrobatchError
    from smp.models import SpecError

    return 2 if isinstance(err, (CLIUsageError, SpecError, MicrobatchError)) else 1


def user_error(err: BaseException) -> str | None:
    """The one-line message for an error a user can fix, or None for a bug."""
    from partitioner.errors import PlanningError
    from partitioner.trace import TraceError
    from smp.models import SpecError

    if isinstance(err, (CLIUsageError, SpecError, PlanningError, TraceError)):
        return str(err)
    if isinstance(err, FileNotFoundError):
        return str(err) if not err.filename else f"no such file: {err.filename}"
    if isinstance(err, (IsADirectoryError, PermissionError)):
        return f"cannot use {err.filename}: {err.strerror}"
    if isinstance(err, (ValueError, json.JSONDecodeError)):
        return str(err)
    return None
