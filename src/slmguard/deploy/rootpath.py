"""Paths under ``--root``: every file apply or rollback touches stays inside it.

Owns the rule. A destination is an absolute path on the target written
plainly (``/etc/fstab``): no ``.`` or ``..`` component, no empty component, no
control character. Below the root it must resolve, every symlink on the way
followed (links planted inside the root included), to a place inside the
root's real path. The last component is not followed when it is written or
removed (a symlink there is replaced or unlinked as a link, never written
through); it is followed, and must stay inside too, when a file is read to be
edited in place (fstab, the boot file).

Anything else is a :class:`~slmguard.errors.RefusedError` (exit 78). The
callers check every path before the first write: ``apply`` each destination,
its manifest and backups (while reading the target); ``rollback`` every path
its manifest names (the manifest is a file on the target, and as hostile as
any). A root that is not an existing directory is a
:class:`~slmguard.errors.UsageError` (exit 64).
"""

from __future__ import annotations

import os
from pathlib import Path

from slmguard.errors import RefusedError, UsageError


def check_root(root: Path) -> Path:
    """``root`` when it is an existing directory; UsageError otherwise."""
    if not root.is_dir():
        problem = "is not a directory" if root.exists() else "does not exist"
        raise UsageError(
            f"--root {root}: {problem}",
            hint="give the directory the target's / is mounted on (default /)",
        )
    return root


def dest_path(text: object, where: str = "path") -> str:
    """``text`` as a destination: absolute, plain, normalized; RefusedError otherwise."""
    if not isinstance(text, str) or not text.startswith("/"):
        raise _refuse(where, text, "is not an absolute path")
    if any(not ch.isprintable() for ch in text):
        raise _refuse(where, text, "holds a control character")
    parts = text.split("/")[1:]
    if any(p in ("", ".", "..") for p in parts) and text != "/":
        raise _refuse(where, text, "has an empty, '.' or '..' component")
    return text


def _refuse(where: str, value: object, why: str) -> RefusedError:
    shown = repr(value)[:120]
    return RefusedError(
        f"{where}: {shown} {why}; refusing to touch it", facts={"field": where, "path": shown}
    )


def _inside(real: Path, real_root: Path) -> bool:
    return real == real_root or real.is_relative_to(real_root)


def confine(root: Path, dest: str, *, follow: bool = False, where: str = "path") -> Path:
    """The path of ``dest`` below ``root``, after checking that it stays inside.

    ``follow``: the last component is followed too (a file read to be edited).
    """
    path = root / dest_path(dest, where).lstrip("/")
    real_root = Path(os.path.realpath(root))
    if follow:
        real = Path(os.path.realpath(path))
    else:
        real = Path(os.path.realpath(path.parent)) / path.name if dest != "/" else real_root
    if not _inside(real, real_root):
        raise RefusedError(
            f"{path} resolves to {real}, outside {root}: refusing to touch it",
            facts={"path": str(path), "target": str(real), "root": str(root)},
            hint="a symlink on the way leads out of --root; remove it or use another root",
        )
    return path


def relative_dest(root: Path, path: Path) -> str:
    """The destination of ``path`` (below ``root``) as it is on the target."""
    return "/" + str(path.relative_to(root)) if path != root else "/"
