"""``make install`` puts the clone's CLI on PATH, and ``make uninstall`` takes only its own
link away (issue 38: after ``make`` every ``slmguard ...`` was "command not found").

Run in this tree with a temporary ``BINDIR``; ``-o .venv/.serve`` keeps make from
reinstalling the venv when pyproject.toml is newer than it (the link is what is tested).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from docblocks import ROOT, walk_env
from waiting import scaled

CLI = ROOT / ".venv" / "bin" / "slmguard"


def _make(target: str, bindir: Path, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = walk_env()
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.serve", target, f"BINDIR={bindir}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(60), check=False,
    )  # fmt: skip


@pytest.fixture
def bindir(tmp_path: Path) -> Path:
    if not CLI.exists():
        pytest.skip(f"{CLI} is not there (run `make`)")
    return tmp_path / "bin"


def test_install_links_the_cli_and_says_whether_it_is_on_path(bindir: Path) -> None:
    done = _make("install", bindir)
    assert done.returncode == 0, done.stdout + done.stderr
    link = bindir / "slmguard"
    assert link.is_symlink() and Path(os.readlink(link)) == CLI
    assert f"{bindir} is not on PATH" in done.stdout
    version = subprocess.run([str(link), "--version"], capture_output=True, text=True,
                             timeout=scaled(60), check=True)  # fmt: skip
    assert version.stdout.startswith("slmguard ")
    # Again, with BINDIR on PATH: the link is replaced in place and the answer changes.
    again = _make("install", bindir, path=f"{bindir}:{os.environ['PATH']}")
    assert again.returncode == 0 and f"slmguard is on PATH: {link}" in again.stdout


def test_install_leaves_a_file_that_is_not_its_link_alone(bindir: Path) -> None:
    bindir.mkdir()
    mine = bindir / "slmguard"
    mine.write_text("#!/bin/sh\necho mine\n")
    done = _make("install", bindir)
    assert done.returncode != 0 and "is not a link: left alone" in done.stdout
    assert mine.read_text() == "#!/bin/sh\necho mine\n"


def test_uninstall_removes_only_this_clones_link(bindir: Path, tmp_path: Path) -> None:
    assert _make("install", bindir).returncode == 0
    first = _make("uninstall", bindir)
    assert first.returncode == 0 and f"removed {bindir}/slmguard" in first.stdout
    assert not (bindir / "slmguard").is_symlink()
    # Another clone's link (or any other) stays.
    (bindir / "slmguard").symlink_to(tmp_path / "elsewhere" / "slmguard")
    second = _make("uninstall", bindir)
    assert second.returncode == 0 and "is not this clone's link: left alone" in second.stdout
    assert (bindir / "slmguard").is_symlink()
