"""Materialize host fixture trees (proc, sys, etc) under a temporary directory.

A tree is a literal dict ``{"proc/meminfo": "MemTotal: ...", ...}``; values are
text, bytes, ``None`` for an empty directory or :class:`Link` for a symlink
(systemd enablement and masking are symlinks). Captured trees from real
machines live in ``tests/fixtures/hosts/<name>/`` and are copied with
:func:`copy_captured`. Readers are then pointed at the returned root.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "hosts"


@dataclass(frozen=True)
class Link:
    """A symlink to ``target`` (absolute targets are kept as written, e.g. /dev/null)."""

    target: str


Tree = Mapping[str, str | bytes | Link | None]


def build_tree(root: Path, tree: Tree) -> Path:
    """Write every entry of ``tree`` below ``root`` and return ``root``."""
    for rel, content in tree.items():
        path = root / rel.lstrip("/")
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Link):
            if path.is_symlink() or path.exists():
                path.unlink()
            path.symlink_to(content.target)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root


def copy_captured(name: str, root: Path, extra: Tree | None = None) -> Path:
    """Copy ``tests/fixtures/hosts/<name>`` to ``root``, then apply ``extra`` on top."""
    shutil.copytree(FIXTURES / name, root, dirs_exist_ok=True)
    return build_tree(root, extra or {})
