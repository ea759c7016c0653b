"""The typer app the commands register on, its --debug and --version, and the wrapper turning errors into exit codes."""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from smp.cli.errors import click_exceptions, exit_code, usage_message, user_error
from smp.cli.output import echo_err, silence_stdout

__all__ = ["app", "STATE", "command"]


class _Group(TyperGroup):
    """typer's group, with bad usage reported as one ``error:`` line (exit 2) instead of typer's usage panel."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError:  # `smp` alone: the help is printed already
            sys.exit(2)
        except click_exceptions.UsageError as err:
            echo_err(f"error: {usage_message(err)}")
            sys.exit(2)
        except click_exceptions.ClickException as err:
            echo_err(f"error: {' '.join(err.format_message().split())}")
            sys.exit(err.exit_code)
        except typer.Abort:  # end of input at a prompt
            echo_err("error: aborted")
            sys.exit(1)
        # a command's typer.Exit(code) comes back as its code; a command that returns has succeeded
        sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)


app = typer.Typer(
    name="smp",
    cls=_Group,
    help="smp: an automatic model-partitioning compiler for PyTorch pipeline parallelism.\n\n"
         "Profile a model, plan its pipeline stages, inspect and re-time plans, compare solvers, "
         "measure this machine, and train with the runtime.",
    epilog="Example: smp plan gpt:layers=8,d_model=256 --stages 4 --microbatches 8 -o plan.json",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

STATE: dict[str, Any] = {"debug": False}


def command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a command body; turn user errors into one ``error:`` line on stderr and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with warnings.catch_warnings():
                if not STATE["debug"]:
                    warnings.showwarning = _show_warning
                return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except BrokenPipeError:  # `smp ... | head -1`: the reader has all it wanted
            silence_stdout()
            raise typer.Exit(0) from None
        except KeyboardInterrupt:
            if STATE["debug"]:
                raise
            echo_err("error: interrupted")
            raise typer.Exit(130) from None
        except Exception as err:  # noqa: BLE001 - the CLI's last line of defence
            if isinstance(err, click_exceptions.ClickException) or STATE["debug"]:
                raise
            message = user_error(err)
            if message is None:
                echo_err(f"error: internal error ({type(err).__name__}: {err}); this is a bug in smp: "
                         "rerun with `smp --debug ...` and report the traceback")
                raise typer.Exit(1) from None
            echo_err(f"error: {' '.join(message.split())}")
            raise typer.Exit(exit_code(err)) from None

    return wrapper


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """A Python warning raised under a command, as one ``warning:`` line on stderr (no source path; --debug keeps it)."""
    echo_err(f"warning: {' '.join(str(message).split())}")


def _print_version(value: bool) -> None:
    if value:
        from smp import __version__

        typer.echo(f"smp {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="show the full traceback on errors")] = False,
    version: Annotated[bool, typer.Option("--version", help="print the version and exit", is_eager=True,
                                          callback=_print_version)] = False,
) -> None:
    STATE["debug"] = debug
