"""What the ``smp`` CLI and its training workers call a user's error, and the exit code it gets."""

from __future__ import annotations

import json

try:  # typer 0.24 and later carry their own copy of click, whose exceptions the commands raise
    from typer._click import exceptions as click_exceptions
except ImportError:  # older typer: click itself
    from click import exceptions as click_exceptions

__all__ = ["CLIUsageError", "user_error", "exit_code", "usage_message", "click_exceptions"]


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


def usage_message(err: click_exceptions.UsageError) -> str:
    """Bad command-line usage (an unknown option or command, a missing or malformed value) as one line: what is
    wrong, the nearest name when there is one, and the help to read."""
    if isinstance(err, click_exceptions.NoSuchOption):
        nearest = f" (did you mean {err.possibilities[0]}?)" if err.possibilities else ""
        text = f"no such option {err.option_name}{nearest}"
    else:  # click's own sentence ("Missing argument 'MODEL'."; typer adds ". Did you mean 'plan'?")
        text, _, nearest = " ".join(err.format_message().split()).partition(". Did you mean ")
        text = text[:1].lower() + text[1:].rstrip(".") + (f" (did you mean {nearest})" if nearest else "")
    where = f"smp {err.ctx.command_path.split(' ', 1)[1]}" if err.ctx and " " in err.ctx.command_path else "smp"
    return f"{text}; see `{where} --help`"
