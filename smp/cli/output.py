"""Where the CLI writes: rich consoles that end quietly on a closed pipe, JSON on stdout, progress on stderr."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

__all__ = ["rich_console", "echo_err", "silence_stdout", "print_json", "progress_bar", "spinner", "spec_name"]


class _Console(Console):
    """A rich console that ends quietly with exit code 0 when its reader goes away (``smp ... | head -1``)."""

    def on_broken_pipe(self) -> None:  # rich's own exits with 1
        self.quiet = True
        silence_stdout()
        raise SystemExit(0)


def rich_console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    width = None if tty else int(os.environ.get("COLUMNS", "160"))
    return _Console(file=stream, width=width, highlight=False, soft_wrap=False)


def echo_err(message: str) -> None:
    typer.echo(message, err=True)


def silence_stdout() -> None:
    """Point stdout at /dev/null after its reader went away, so that the flush at exit cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (a test runner's capture): nothing to flush
        pass


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return str(value)


@contextmanager
def progress_bar(label: str, enabled: bool, unit: str = "ops") -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr; yields the ``progress(done, total)`` callback (None when disabled)."""
    con = rich_console(stderr=True)
    if not enabled or not con.is_terminal:  # no bar in logs and pipes: it would only leave blank lines
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn(unit), TimeElapsedColumn(), console=con, transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@contextmanager
def spinner(message: str, enabled: bool) -> Iterator[None]:
    """A spinner on stderr for steps without a progress count (the solver)."""
    con = rich_console(stderr=True)
    if not enabled or not con.is_terminal:
        yield
        return
    with con.status(message):
        yield


def spec_name(spec: str) -> str:
    return spec if len(spec) <= 48 else spec[:47] + "…"
