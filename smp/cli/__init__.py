"""The ``smp`` command line: see what the compiler decides, and why, without writing Python.

Commands: models, profile, plan, inspect, simulate, compare, calibrate, train
(docs/cli.md has each one with real output). Output for people goes to stdout through
rich; progress bars and errors go to stderr; ``--json`` prints one JSON document on
stdout and nothing else. User errors print one ``error: ...`` line and exit 1 (2 for
bad usage: unknown model or option, bad option value); ``smp --debug CMD`` shows the traceback.
Each command module registers its commands on ``app`` when imported: the imports below,
in the order ``smp --help`` lists the commands.
"""

from __future__ import annotations

from smp.cli import models, profile, plan, calibrate, train  # noqa: F401 - each registers its commands on app
from smp.cli.root import app

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> int:
    """The console script ``smp``."""
    try:
        app(args=argv, prog_name="smp", standalone_mode=True)
    except SystemExit as exc:  # click exits through SystemExit in standalone mode
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
