"""Write a benchmark's section of a markdown file (docs/benchmarks.md): the script's own output, never retyped."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace the section that starts with ``heading`` (up to the next ``## `` heading) with ``heading``
    and ``body``, or append it."""
    text = f"{heading}\n\n{body.strip()}\n"
    doc = path.read_text() if path.exists() else ""
    if heading in doc:
        start = doc.index(heading)
        end = doc.find("\n## ", start + len(heading))
        doc = doc[:start] + text + (doc[end:] if end >= 0 else "")
    else:
        doc = doc.rstrip() + "\n\n" + text
    path.write_text(doc)
