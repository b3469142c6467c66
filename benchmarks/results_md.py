"""benchmarks/RESULTS.md: the one writer every benchmark uses for its section.

Each benchmark owns one ``## name`` section; :func:`write_section` replaces
it (up to the next ``## `` heading) or appends it, leaving the others as they
are. Run from a benchmark script (its folder is on ``sys.path``).
"""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")


def write_section(title: str, section: str, path: Path = RESULTS) -> None:
    """Put ``section`` (starting with its ``title`` line) in place of the old one."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    section = section.rstrip("\n") + "\n"
    start = text.find(title + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(title))
        text = text[:start] + section + ("\n" + text[nxt + 1 :] if nxt >= 0 else "")
    path.write_text(text)
