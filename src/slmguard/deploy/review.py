"""The review tree ``render --out DIR`` writes: the deployment at its destinations under DIR.

Each rendered file goes to ``DIR/<destination>`` (symlinks as symlinks),
written atomically. Secrets are left out: a review tree holds no token
(``apply`` creates it).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from slmguard.deploy import writer
from slmguard.deploy.render import RenderedFile
from slmguard.deploy.target import under
from slmguard.errors import HostWriteError


def write_tree(files: Iterable[RenderedFile], out_dir: Path) -> list[Path]:
    """Write rendered files under ``out_dir`` at their destination paths (for review)."""
    written = []
    for f in files:
        if f.is_secret:
            continue
        path = under(out_dir, f.path)
        writer.make_dirs(writer.missing_dirs(path.parent, out_dir.parent))
        if path.is_dir() and not path.is_symlink():
            raise HostWriteError(path, "is a directory")
        if f.link is not None:
            writer.write_link(path, f.link)
        else:
            writer.write_file(path, f.content or b"", f.mode)
        written.append(path)
    return written
