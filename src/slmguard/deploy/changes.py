"""What differs: the rendered deployment against the target's current files.

Pure. :func:`compute_changes` pairs each :class:`~slmguard.deploy.render.RenderedFile`
with the :class:`~slmguard.deploy.target.Current` state of its destination and
keeps those that differ; :func:`unified_diff` is what ``apply --dry-run``
prints. A secret that exists is never a change (apply keeps it, whatever it
holds), and its value never appears in a diff: only ``<secret, N bytes>``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from slmguard.deploy.render import RenderedFile, secret_file_bytes
from slmguard.deploy.target import MISSING, Current
from slmguard.errors import RefusedError


@dataclass(frozen=True)
class Change:
    """One destination that differs from what the deployment wants."""

    file: RenderedFile
    current: Current = MISSING

    @property
    def path(self) -> str:
        return self.file.path

    @property
    def old_bytes(self) -> bytes | None:
        """The regular file there now, if any."""
        return self.current.data if self.current.kind == "file" else None

    @property
    def old_link(self) -> str | None:
        """The symlink target there now, if any."""
        return self.current.link if self.current.kind == "link" else None

    @property
    def action(self) -> str:
        return "create" if self.old_bytes is None and self.old_link is None else "replace"


def _unchanged(f: RenderedFile, current: Current) -> bool:
    if f.is_secret:
        return current.kind in ("file", "link")  # an existing secret is kept
    if f.link is not None:
        return current.kind == "link" and current.link == f.link
    return current.kind == "file" and current.data == f.content


def compute_changes(files: Iterable[RenderedFile], current: Mapping[str, Current]) -> list[Change]:
    """The files whose current state differs; RefusedError if one cannot be replaced."""
    changes: list[Change] = []
    for f in files:
        now = current.get(f.path, MISSING)
        if now.kind in ("dir", "other"):
            raise RefusedError(
                f"{f.path} is a {'directory' if now.kind == 'dir' else 'special file'} on "
                "the target; refusing to replace it",
                facts={"path": f.path, "kind": now.kind},
            )
        if not _unchanged(f, now):
            changes.append(Change(f, now))
    return changes


def _lines(data: bytes | None, link: str | None) -> list[str]:
    if link is not None:
        return [f"symlink -> {link}\n"]
    if data is None:
        return []
    return data.decode("utf-8", "replace").splitlines(keepends=True)


def unified_diff(changes: Iterable[Change]) -> str:
    out: list[str] = []
    for c in changes:
        old = _lines(c.old_bytes, c.old_link)
        if c.file.secret_bytes is not None:
            new = [f"<secret, {secret_file_bytes(c.file.secret_bytes)} bytes>\n"]
        else:
            new = _lines(c.file.content, c.file.link)
        a = f"a{c.path}" if c.action == "replace" else "/dev/null"
        diff = difflib.unified_diff(old, new, a, f"b{c.path}")
        for line in diff:
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)
