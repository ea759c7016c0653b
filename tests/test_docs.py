"""Docs that cannot drift: docs/cli.md's console blocks and README.md's synthetic-graph example still hold.

docs/cli.md's commands are re-run through docs/console.py (the script that pasted their output) in a
scratch folder, and each output is compared with the page's in structure, not in numbers:

- a block whose output does not depend on this machine is compared line by line, with every number
  (and its time or size unit, and a model fingerprint) replaced by a placeholder and runs of spaces
  collapsed: a changed label, word, table column or line is a failure (e.g. the solver label
  `auto/cpsat→blocks+sim` where the command now prints `auto/moves→blocks+sim`);
- a block with measured figures (its text says "measured", or it uses the calibrated
  `this-machine` profile) keeps its table headers (in order) and the first words of its other
  lines (as a set: which stage, op or solver wins, and how stdout and stderr interleave, change
  from run to run);
- in both, the commands and their exit codes must be the page's exactly.

Re-run every time (about 55 s on the 2-core development machine: 5 s to start each command, 14 s
for `smp models`, 17 s for the 1B plan): the blocks in FAST, deterministic and needing no other
block's files: `smp models`, the 1B GPT planned on the meta device for 8 H100s (the block with the
solver label), and four user errors. Marked slow (CI runs them): every other block (the profiles,
the measured plans, inspect, simulate, compare, calibrate, the `--devices` search, the memory-limit
and plan-file errors and the three `smp train` runs; 5.4 minutes in all on that machine with other
jobs running), one test per group of blocks that share files (a plan file and the blocks that read
it), each group in page order in its own scratch folder, so pytest-xdist spreads them over workers.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cli.md"


def _load_console() -> ModuleType:
    """docs/console.py, which is a script, not a package module."""
    spec = importlib.util.spec_from_file_location("docs_console", ROOT / "docs" / "console.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


console = _load_console()

#: The commands re-run on every test run: deterministic, cheap, and independent of other blocks.
FAST = (
    "smp models",
    "smp plan gpt:size=1b --meta --stages 8 --microbatches 16 --cluster h100-sxm --memory-limit 40GiB",
    "smp plan gpt:layers=8,d_modle=256 --stages 4",
    "smp plan gpt --stages 4 --memory-limit 40G",
    "smp plan examples/my_model.py:make --stages 3 --batch-size 20 --microbatches 6",
    "smp plan bad.py:broken --stages 2",
)

NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")
FINGERPRINT = re.compile(r"\b[0-9a-f]{16}\b")
TIME_UNIT = re.compile(r"# ?(?:ns|µs|ms|s)\b")
SIZE_UNIT = re.compile(r"# ?(?:[KMGT]i?B|B)\b")
MEASURED = re.compile(r"measured|this-machine")
#: Lines of a measured block that a busy machine adds (the profile's unstable-timing warning, on stderr
#: and in the plan's warnings), and the warnings heading it turns from "warnings: none" to "warnings (1)".
LOAD_DEPENDENT = re.compile(r"unstable timings")
WARNINGS_HEADING = re.compile(r"^warnings(?:: .*| \(\d+\))$")


def normalised(line: str) -> str:
    """The line with numbers, units and fingerprints as placeholders and runs of spaces as one."""
    line = NUMBER.sub("#", FINGERPRINT.sub("<fingerprint>", line))
    line = SIZE_UNIT.sub("#size", TIME_UNIT.sub("#time", line))
    return " ".join(line.split())


def commands_and_exits(lines: list[str]) -> list[str]:
    """The command lines and `[exit N]` lines, as they are."""
    return [line for line in lines if line.startswith("$ ") or console.EXIT.match(line)]


def headers(lines: list[str]) -> list[str]:
    """Table header lines (those right above a rule), normalised, in order."""
    return [normalised(a) for a, b in zip(lines, lines[1:]) if b.startswith("─")]


def labels(lines: list[str]) -> set[str]:
    """First words of the lines outside tables (a table runs from its rule to a blank line), wrapped
    continuations, the load-dependent warnings and the plan warnings' items left out."""
    found: set[str] = set()
    in_table, previous = False, ""
    for line in lines:
        if line.startswith("warning: ") and LOAD_DEPENDENT.search(line):  # one unwrapped stderr line: no tail
            previous = ""
            continue
        if line.startswith("  ! "):  # a plan warning's item: measured times under load may add one (the heading
            previous = line  # "warnings" is compared either way)
            continue
        words = normalised(line).split()
        wrapped = bool(words) and len(previous) + 1 + len(line.split()[0]) > console.COLUMNS
        in_table = line.startswith("─") or (in_table and bool(words))
        if words and not in_table and not wrapped and not line.startswith("$ ") and not LOAD_DEPENDENT.search(line):
            found.add(words[0])
        previous = line
    return found


def mismatch(page: list[str], fresh: list[str]) -> str | None:
    """How the fresh output differs from the page's in structure, or None."""
    if commands_and_exits(page) != commands_and_exits(fresh):
        return f"commands or exit codes: page {commands_and_exits(page)}, now {commands_and_exits(fresh)}"
    if any(MEASURED.search(line) for line in page):
        # the load-dependent lines are dropped after the wrapping is seen (a wrapped warning's tail is no label)
        page, fresh = ([WARNINGS_HEADING.sub("warnings", line) for line in lines] for lines in (page, fresh))
        if headers(page) != headers(fresh):
            return f"table headers: page {headers(page)}, now {headers(fresh)}"
        if labels(page) != labels(fresh):
            return f"line labels only on the page {sorted(labels(page) - labels(fresh))}, only now " \
                   f"{sorted(labels(fresh) - labels(page))}"
        return None
    for k, (a, b) in enumerate(zip(page, fresh)):
        if normalised(a) != normalised(b):
            return f"line {k + 1}: page\n    {a}\nnow\n    {b}"
    if len(page) != len(fresh):
        return f"{len(page)} lines on the page, {len(fresh)} now:\n" + "\n".join(fresh)
    return None


def stale_blocks(selected: Callable[[console.Block], bool], workdir: Path) -> list[str]:
    """Re-run the page's selected console blocks in workdir; what no longer matches, one entry per block."""
    blocks = console.parse(PAGE.read_text().splitlines())
    console.rerun_blocks(blocks, selected, workdir)
    stale = []
    for b in blocks:
        if b.fresh is not None:
            # paths in user errors name the scratch folder the page was made in
            fresh = [line.replace(str(workdir), str(console.WORKDIR)) for line in b.fresh]
            if why := mismatch(b.lines, fresh):
                stale.append(f"{b.lines[0]}\n  {why}")
    return stale


def is_fast(block: console.Block) -> bool:
    return any(command in FAST for command, _ in console.commands(block))


def test_fast_commands_are_on_the_page() -> None:
    shown = {c for b in console.parse(PAGE.read_text().splitlines()) for c, _ in console.commands(b)}
    assert set(FAST) <= shown, f"FAST names commands the page no longer shows: {set(FAST) - shown}"


def test_cli_page_deterministic_blocks(tmp_path: Path) -> None:
    stale = stale_blocks(is_fast, tmp_path / "docrun")
    assert not stale, ("docs/cli.md no longer matches what these commands print (regenerate it with "
                       "`python docs/console.py docs/cli.md`):\n" + "\n".join(stale))


WRITTEN = re.compile(r"(?:(?<![\w-])-o\s+|>\s*)([^&\s]\S*)")  # `-o NAME`, `> NAME` (not `2>&1`)


def related_groups(blocks: list[console.Block]) -> list[list[int]]:
    """The console blocks (by index) in groups that share files: a block reading a file another block's
    command (or ``before`` line) writes runs in the writer's group, in page order; the groups need nothing
    from each other, so each re-runs alone in its own scratch folder."""
    texts = {i: [c for c, _ in console.commands(b)] + b.before for i, b in enumerate(blocks)
             if b.lang == "console" and console.commands(b)}
    parent = {i: i for i in texts}

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    writers: dict[str, int] = {}
    for i, lines in texts.items():
        for name in (n for line in lines for n in WRITTEN.findall(line)):
            parent[root(i)] = root(writers.setdefault(name, i))
    for i, lines in texts.items():
        for name, writer in writers.items():
            if any(re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", line) for line in lines):
                parent[root(i)] = root(writer)
    groups: dict[int, list[int]] = {}
    for i in texts:
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values())


def _slow_groups() -> list[list[int]]:
    blocks = console.parse(PAGE.read_text().splitlines())
    return [g for g in related_groups(blocks) if not any(is_fast(blocks[i]) for i in g)]


SLOW_GROUPS = _slow_groups()


def test_blocks_reading_another_blocks_file_share_its_group() -> None:
    page = ["```console", "$ smp plan m -o p.json", "```", "```console", "$ smp inspect p.json", "```",
            "<!-- before: head -c 4 p.json > broken.json -->", "```console", "$ smp inspect broken.json", "```",
            "```console", "$ smp plan m --plan other.json", "```"]
    assert related_groups(console.parse(page)) == [[0, 1, 2], [3]]


@pytest.mark.slow
@pytest.mark.parametrize("group", SLOW_GROUPS, ids=lambda g: "+".join(str(i) for i in g))
def test_cli_page_other_blocks(group: list[int], tmp_path: Path) -> None:
    """Every block not in FAST, re-run with the blocks it shares files with (one test per group, so
    pytest-xdist spreads the page's five minutes over its workers)."""
    blocks = console.parse(PAGE.read_text().splitlines())
    chosen = {blocks[i].start for i in group}
    stale = stale_blocks(lambda b: b.start in chosen, tmp_path / "docrun")
    assert not stale, ("docs/cli.md no longer matches what these commands print (regenerate it with "
                       "`python docs/console.py docs/cli.md`):\n" + "\n".join(stale))


def test_every_block_is_fast_or_in_a_slow_group() -> None:
    blocks = console.parse(PAGE.read_text().splitlines())
    grouped = {i for g in SLOW_GROUPS for i in g}
    for i, b in enumerate(blocks):
        if b.lang == "console" and console.commands(b):
            assert is_fast(b) or i in grouped, b.lines[0]


def test_normalised_keeps_labels_and_drops_numbers() -> None:
    assert normalised("solver   auto/moves→blocks+sim, 9.22 s: gap 0.2%") == \
        "solver auto/moves→blocks+sim, #time: gap #%"
    assert normalised("bottleneck 1.01e+03 MiB, 64 KiB 0 s") == normalised("bottleneck 58.8 GiB, 1 B 12 µs")
    assert normalised("solver auto/cpsat→blocks+sim") != normalised("solver auto/moves→blocks+sim")


def test_a_measured_block_on_a_busy_machine_still_matches() -> None:
    # CI's busy machine added the unstable-timing warning to `smp profile`'s output: not a structural change
    page = ["$ smp profile m.py:make", "profile of Net (measured, 1 thread, sweeps spread 9%)", "  op time",
            "warnings: none (stages within 70% of the bottleneck)"]
    busy = ["$ smp profile m.py:make", "warning: profiling Net: unstable timings: the sweeps differed by 83%" + " " * 160,
            "profile of Net (measured, 1 thread, sweeps spread 83%)", "  op time", "warnings (1)",
            "  ! unstable timings: the profile's sweeps differed by 83% of their median (over 50%, after more "
            "sweeps); is the machine busy? Its times, and the plan's predicted step time, may be",
            "off by that much"]
    assert mismatch(page, busy) is None
    assert mismatch(page, busy + ["stage 0 is busy 12% of the bottleneck"]) is not None
    # measured times under load may also unbalance the stages: a plan warning's item CI's run added (its label
    # "!" failed the page, though the heading was already taken as load-dependent)
    unbalanced = [*busy[:5], "  ! stage 1 is idle 45% of the step: consider re-planning with more microbatches"]
    assert mismatch(page, unbalanced) is None


def python_block(page: Path, heading: str) -> str:
    """The first ```python block of the page's section with that heading."""
    lines = page.read_text().splitlines()
    start = lines.index(heading)
    end = next((k for k in range(start + 1, len(lines)) if lines[k].startswith("## ")), len(lines))
    blocks = [b for b in console.parse(lines[start:end]) if b.lang == "python"]
    assert blocks, f"no python block under {heading!r} in {page.name}"
    return "\n".join(blocks[0].lines)


def test_readme_synthetic_example_runs() -> None:
    code = python_block(ROOT / "README.md", "## Testing cut quality on synthetic graphs")
    exec(compile(code, "README.md (synthetic graphs)", "exec"), {})
