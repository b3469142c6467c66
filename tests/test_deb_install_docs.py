"""The docs' install from the Debian packages is the one ``make deb-install-test`` runs.

``tests/debinstall.py`` runs the install (and the repair of a ``dpkg -i``) for real in a
fresh Debian 12 root, on purpose (minutes, as root); these fast checks keep the READMEs
and docs/install.md saying exactly those commands, so that what a reader types is what
was run (issue 38).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import debinstall
from docblocks import ROOT, Block, shell_blocks

#: Where a reader meets the .deb install.
DOCS = (ROOT / "README.md", ROOT / "README.zh-CN.md", ROOT / "docs/install.md")


def _commands(block: Block) -> tuple[str, ...]:
    return tuple(block.command_text(c) for c in block.commands)


def _paragraphs(path: Path) -> list[str]:
    """The file's paragraphs, each with its line breaks as spaces."""
    text = path.read_text(encoding="utf-8")
    return [re.sub(r"\s*\n\s*", " ", p) for p in re.split(r"\n\s*\n", text)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_the_docs_install_the_packages_as_the_target_does(path: Path) -> None:
    """One block of the doc is exactly the install the target runs; no other block installs
    a package file another way."""
    blocks = [_commands(b) for b in shell_blocks(path)]
    assert debinstall.INSTALL in blocks, f"{path.name}: no block is {debinstall.INSTALL}"
    for commands in blocks:
        for command in commands:
            if ".deb" in command:
                assert command == debinstall.INSTALL[0], f"{path.name}: {command}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_dpkg_i_of_the_docs_comes_with_the_repair_the_target_runs(path: Path) -> None:
    """Wherever a doc speaks of ``dpkg -i`` as a reader's command, the same paragraph gives
    the repair as the target runs it, whole on one line of the source (so it is copied
    whole), and the error it mends as dpkg prints it."""
    text = path.read_text(encoding="utf-8")
    assert any(debinstall.RECOVERY in line for line in text.splitlines()), path.name
    spoken = [p for p in _paragraphs(path) if "`dpkg -i" in p and "make dist-test" not in p]
    assert spoken, f"{path.name} does not say what a dpkg -i needs"
    for paragraph in spoken:
        if "dependency problems" in paragraph:
            assert debinstall.RECOVERY in paragraph or debinstall.RECOVERY in text, paragraph
            assert debinstall.UNCONFIGURED in paragraph, paragraph


def test_troubleshooting_quotes_what_the_target_checks() -> None:
    """The READMEs' entries quote the messages the target's friction steps check."""
    for path in DOCS[:2]:
        text = re.sub(r"\s*\n\s*", " ", path.read_text(encoding="utf-8"))
        for quoted in (debinstall.NOT_INSTALLABLE, debinstall.DEPS_MISSING,
                       debinstall.UNCONFIGURED):  # fmt: skip
            assert f"`{quoted}`" in text, f"{path.name} does not quote {quoted!r}"
        assert f"`{debinstall.RECOVERY}`" in text, path.name
