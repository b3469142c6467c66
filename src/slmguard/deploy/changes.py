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
        return "create" if self.current.kind == "missing" else "replace"


@dataclass(frozen=True)
class Removal:
    """A file an earlier apply created that this deployment no longer has (a stale drop-in)."""

    path: str
    current: Current

    @property
    def action(self) -> str:
        return "remove"


def _unchanged(f: RenderedFile, current: Current) -> bool:
    if f.is_secret:
        return current.kind in ("file", "link")  # an existing secret is kept
    if f.model is not None:  # compared by size and digest, never read whole
        return (
            current.kind == "file"
            and current.size_bytes == f.model.size_bytes
            and current.sha256 == f.model.sha256
        )
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


def stale_paths(created: Iterable[str], wanted: Iterable[str]) -> list[str]:
    """Paths an earlier apply created (recorded "did not exist") that are no longer wanted."""
    keep = set(wanted)
    return [p for p in created if p not in keep]


def _described(current: Current) -> list[str]:
    """The current content for a diff; large files (the model) as a size."""
    if current.kind == "file" and current.data is None:
        return [f"<{current.size_bytes} bytes>\n"]
    return _lines(current.data if current.kind == "file" else None, current.link)


def _wanted(f: RenderedFile) -> list[str]:
    if f.secret_bytes is not None:
        return [f"<secret, {secret_file_bytes(f.secret_bytes)} bytes>\n"]
    if f.model is not None:
        m = f.model
        return [f"<{m.kind}, {m.size_bytes} bytes, sha256 {m.sha256}, from {m.source}>\n"]
    return _lines(f.content, f.link)


def _diff(path: str, old: list[str], new: list[str], existed: bool, exists: bool) -> list[str]:
    a = f"a{path}" if existed else "/dev/null"
    b = f"b{path}" if exists else "/dev/null"
    out = []
    for line in difflib.unified_diff(old, new, a, b):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return out or [f"--- {a}\n", f"+++ {b}\n"]  # an empty file created or removed


def unified_diff(changes: Iterable[Change], removals: Iterable[Removal] = ()) -> str:
    out: list[str] = []
    for c in changes:
        out += _diff(c.path, _described(c.current), _wanted(c.file), c.action == "replace", True)
    for r in removals:
        out += _diff(r.path, _described(r.current), [], True, False)
    return "".join(out)
