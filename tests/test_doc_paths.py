"""The files the READMEs and docs tell a user to pass exist where they say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", ROOT / "README.zh-CN.md", *sorted((ROOT / "docs").glob("*.md"))]
# `--unit FILE` with a relative path: a file of the clone (rendered trees live under deploy/,
# which `slmguard render --out deploy/` makes first).
UNIT_ARG = re.compile(r"--unit\s+(\.{0,2}/?[\w./-]*/[\w./-]+)")


def _unit_paths() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for match in UNIT_ARG.finditer(doc.read_text(encoding="utf-8")):
            path = match.group(1)
            if not path.startswith(("/", "deploy/")):
                found.append((doc.name, path))
    return found


def test_some_unit_paths_are_checked() -> None:
    assert ("tour.md", "tests/fixtures/units/slm_inference.service") in _unit_paths()


@pytest.mark.parametrize(("doc", "path"), _unit_paths())
def test_doctor_unit_examples_name_files_of_the_clone(doc: str, path: str) -> None:
    assert (ROOT / path).is_file(), f"{doc}: `--unit {path}` names no file of the clone"
