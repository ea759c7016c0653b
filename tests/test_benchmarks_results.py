"""benchmarks/results/ holds only what the docs cite: every file there is cited by a doc, every cited one exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
#: A results file as a doc cites it, by its path from the repository root; a path read from a commit
#: (``git show 3ddb428:benchmarks/results/...``) is history, not a file of this tree.
CITED = re.compile(r"(?<![\w:/.-])benchmarks/results/([\w.-]*\w)")


def cited() -> dict[str, set[str]]:
    """Each cited results file's name, with the docs that cite it."""
    names: dict[str, set[str]] = {}
    for doc in DOCS:
        for name in CITED.findall(doc.read_text()):
            names.setdefault(name, set()).add(doc.name)
    return names


def test_every_results_file_is_cited_by_a_doc() -> None:
    kept = {path.name for path in RESULTS.iterdir() if path.is_file() and not path.name.startswith(".")}
    uncited = sorted(kept - cited().keys())
    assert not uncited, f"cited by no doc (docs/*.md, README.md): remove them or cite them: {uncited}"


def test_every_results_file_a_doc_cites_exists() -> None:
    missing = sorted(f"{name} (cited by {', '.join(sorted(docs))})" for name, docs in cited().items()
                     if not (RESULTS / name).is_file())
    assert not missing, f"cited but not in benchmarks/results/: {missing}"
