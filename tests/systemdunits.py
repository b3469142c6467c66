"""Helpers for tests that check rendered units with systemd's own parser.

``systemd-analyze verify`` and ``systemd-analyze security --offline=yes``
(Debian package ``systemd``) check the real files. When the binary is missing
:func:`find_systemd_analyze` tries ``apt-get install systemd`` once; the tests
skip only when that is not possible, and fail instead under CI (where it must
be installed).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

from slmguard.deploy.render import RenderedFile
from slmguard.host.systemd import parse_exposure

# Words systemd-analyze uses when it ignores or rejects part of a unit.
PROBLEM = re.compile(
    r"Unknown (key|section|lvalue)|Invalid|Failed|ignoring|not executable|"
    r"[Ww]arning|[Ee]rror|deprecated|Unsupported",
)


def find_systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", "systemd"],
            capture_output=True,
            timeout=600,
            check=False,
        )
        exe = shutil.which("systemd-analyze")
    if exe is None:
        reason = "systemd-analyze is not installed and could not be (Debian package: systemd)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return exe


def materialize(files: Iterable[RenderedFile], unit_dir: Path) -> list[Path]:
    """Write the unit files (not symlinks) into one directory, keeping drop-in dirs."""
    out = []
    for f in files:
        if f.link is not None or not f.path.startswith("/etc/systemd/system/"):
            continue
        path = unit_dir / f.path.removeprefix("/etc/systemd/system/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f.content or b"")
        if path.parent == unit_dir:
            out.append(path)
    return out


def verify(analyze: str, units: list[Path]) -> str:
    """systemd-analyze verify's complaints about ``units`` ("" when it has none)."""
    proc = subprocess.run(
        [analyze, "verify", *[str(u) for u in units]],
        capture_output=True,
        text=True,
        cwd=units[0].parent,
        timeout=120,
        check=False,
    )
    out = proc.stdout + proc.stderr
    return out if proc.returncode != 0 or PROBLEM.search(out) else ""


def exposure(analyze: str, unit: Path) -> float:
    proc = subprocess.run(
        [analyze, "security", "--offline=yes", str(unit)],
        capture_output=True,
        text=True,
        cwd=unit.parent,
        timeout=120,
        check=False,
    )
    found = parse_exposure(proc.stdout)
    assert found, proc.stdout + proc.stderr
    return found.score


def sections(text: str) -> dict[str, list[tuple[str, str]]]:
    """A unit's settings by section, comments and blank lines left out."""
    out: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            out[current] = []
        else:
            key, _, value = line.partition("=")
            out[current].append((key, value))
    return out


def values(text: str, section: str, key: str) -> list[str]:
    return [v for k, v in sections(text).get(section, []) if k == key]
