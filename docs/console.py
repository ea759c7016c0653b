"""Re-run the commands of a docs page's ```console blocks and paste their real output in place.

    .venv/bin/python docs/console.py docs/cli.md [--only TEXT] [--check]

Every ``$ command`` line of a ```console block runs, in page order, with bash in one scratch
directory (``/tmp/docrun``, holding a copy of ``examples/``), stdout and stderr together, the
folder of the Python running this script first on PATH (so ``smp`` is that environment's) and
this checkout first on PYTHONPATH (so the commands run this checkout's code, from a worktree
too); the lines under it are replaced by what it printed, and by ``[exit N]`` where the page
showed an exit code. Two HTML comments prepare what a block needs without showing it:

- ``<!-- file: NAME -->`` right before a fenced block: the block's text is written to NAME
  before anything runs (e.g. the ``bad.py`` the error examples load);
- ``<!-- before: COMMAND -->``: COMMAND runs (output discarded) just before the next console
  block (e.g. ``smp calibrate -o this-machine.json`` for a block that plans on it).

``--only TEXT`` re-runs only the blocks whose commands contain TEXT (the others keep their text,
and nothing they would create is made); ``--check`` prints what would change and writes nothing.
Outputs with measured times differ from run to run: that is what the page should show.
tests/test_docs.py re-runs the blocks through ``rerun_blocks`` and checks their structure.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKDIR = Path("/tmp/docrun")
FENCE = re.compile(r"^```(\w*)\s*$")
FILE = re.compile(r"^<!-- file: (\S+) -->\s*$")
BEFORE = re.compile(r"^<!-- before: (.+) -->\s*$")
EXIT = re.compile(r"^\[exit \d+\]$")
TIMEOUT_S = 900
COLUMNS = 160  # the terminal width the commands see: rich wraps and pads to it


@dataclass
class Block:
    """One fenced block: where it lies in the page, its language, and its text."""

    start: int  # index of the opening fence line
    end: int  # index of the closing fence line
    lang: str
    lines: list[str]
    file: str | None = None
    before: list[str] = field(default_factory=list)
    fresh: list[str] | None = None  # the re-run text, when it was re-run


def parse(lines: list[str]) -> list[Block]:
    """The page's fenced blocks, with the file/before directives that precede them."""
    blocks: list[Block] = []
    file, before = None, []
    i = 0
    while i < len(lines):
        if m := FILE.match(lines[i]):
            file = m.group(1)
        elif m := BEFORE.match(lines[i]):
            before.append(m.group(1))
        elif m := FENCE.match(lines[i]):
            j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            blocks.append(Block(i, j, m.group(1), lines[i + 1:j], file, before if m.group(1) == "console" else []))
            file = None
            if m.group(1) == "console":
                before = []
            i = j
        i += 1
    return blocks


def commands(block: Block) -> list[tuple[str, bool]]:
    """The block's commands, each with whether the page shows its exit code."""
    found: list[tuple[str, bool]] = []
    for line in block.lines:
        if line.startswith("$ "):
            found.append((line[2:], False))
        elif EXIT.match(line) and found:
            found[-1] = (found[-1][0], True)
    return found


def environment() -> dict[str, str]:
    """The commands' environment: this interpreter's bin folder on PATH, this checkout on PYTHONPATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PATH=path, PYTHONPATH=pythonpath, COLUMNS=str(COLUMNS), PYTHONUNBUFFERED="1")


def run(command: str, env: dict[str, str], workdir: Path) -> tuple[str, int]:
    """What the command prints (stdout and stderr, in order) and its exit code."""
    proc = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    return proc.stdout.rstrip("\n"), proc.returncode


def rerun_blocks(blocks: list[Block], selected: Callable[[Block], bool], workdir: Path = WORKDIR) -> None:
    """Re-run the selected console blocks in page order in a fresh workdir; each one's ``fresh`` is its new text."""
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(ROOT / "examples", workdir / "examples")
    for b in blocks:
        if b.file:
            (workdir / b.file).write_text("\n".join(b.lines) + "\n")
    env = environment()
    for b in blocks:
        if b.lang != "console" or not selected(b):
            continue
        for prep in b.before:
            run(prep, env, workdir)
        text: list[str] = []
        for command, show_exit in commands(b):
            print(f"$ {command}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            printed, code = run(command, env, workdir)
            print(f"  ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
            # rich pads table rows to the console width: the padding is not output worth keeping
            text += [f"$ {command}", *(line.rstrip() for line in printed.splitlines())] + (
                [f"[exit {code}]"] if show_exit else [])
        b.fresh = text


def rerun(page: Path, only: str | None) -> str:
    """The page with its console blocks' outputs replaced by fresh ones."""
    lines = page.read_text().splitlines()
    blocks = parse(lines)
    rerun_blocks(blocks, lambda b: not only or any(only in c for c, _ in commands(b)))
    out = list(lines)
    for b in reversed(blocks):  # from the end, so that earlier indices stay valid
        if b.fresh is not None:
            out[b.start + 1:b.end] = b.fresh
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", type=Path)
    ap.add_argument("--only", help="re-run only the blocks whose commands contain this text")
    ap.add_argument("--check", action="store_true", help="show the changes, write nothing")
    a = ap.parse_args()
    new = rerun(a.page, a.only)
    old = a.page.read_text()
    if a.check:
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(a.page),
                                                   f"{a.page} (re-run)"))
    elif new != old:
        a.page.write_text(new)
        print(f"wrote {a.page}", file=sys.stderr)


if __name__ == "__main__":
    main()
