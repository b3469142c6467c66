"""Materialize host fixture trees (proc, sys, etc) under a temporary directory.

A tree is a literal dict ``{"proc/meminfo": "MemTotal: ...", ...}``; values are
text, bytes, or ``None`` for an empty directory. Captured trees from real
machines live in ``tests/fixtures/hosts/<name>/`` and are copied with
:func:`copy_captured`. Readers are then pointed at the returned root.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "hosts"

Tree = Mapping[str, str | bytes | None]


def build_tree(root: Path, tree: Tree) -> Path:
    """Write every entry of ``tree`` below ``root`` and return ``root``."""
    for rel, content in tree.items():
        path = root / rel.lstrip("/")
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root


def copy_captured(name: str, root: Path, extra: Tree | None = None) -> Path:
    """Copy ``tests/fixtures/hosts/<name>`` to ``root``, then apply ``extra`` on top."""
    shutil.copytree(FIXTURES / name, root, dirs_exist_ok=True)
    return build_tree(root, extra or {})
