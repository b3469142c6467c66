"""The review tree ``render --out DIR`` writes: the deployment at its destinations under DIR.

Each rendered file goes to ``DIR/<destination>`` (symlinks as symlinks),
written atomically. Secrets are left out: a review tree holds no token
(``apply`` creates it); so is the model file (``apply`` installs it).

A review directory is often one a user made or reuses, so render checks the
whole tree before it writes anything, and refuses (exit 78):

- ``DIR`` itself, or any directory inside it on the way to a file, being a
  symlink (writing through it would write elsewhere);
- a directory, or a special file, where a file goes;
- a file or link at a destination that an earlier render into ``DIR`` did not
  write, unless ``force`` (``render --force``). Render records what it wrote
  in ``DIR/.slmguard-render.json``, so rendering again into the same
  directory replaces its own files without asking. Replacing never follows a
  link: the link itself is replaced.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterable
from pathlib import Path

from slmguard.deploy.render import RenderedFile
from slmguard.deploy.target import current_state, under
from slmguard.deploy.writer import RootWriter, writing
from slmguard.errors import HostReadError, RefusedError

RECORD_NAME = ".slmguard-render.json"
RECORD_SCHEMA = "slmguard.render/1"


def _refuse(path: Path, why: str, hint: str | None = None) -> RefusedError:
    return RefusedError(f"render --out: {path} {why}", facts={"path": str(path)}, hint=hint)


def _written_before(out_dir: Path) -> set[str]:
    """The destinations an earlier render wrote into ``out_dir`` (its record)."""
    record = out_dir / RECORD_NAME
    kind = current_state(record).kind
    if kind == "missing":
        return set()
    if kind != "file":
        raise _refuse(record, "is not a regular file")
    try:
        data = json.loads(record.read_bytes())
    except (OSError, ValueError) as err:
        raise HostReadError(record, f"not render's record: {err}") from err
    if not isinstance(data, dict) or data.get("schema") != RECORD_SCHEMA:
        raise _refuse(record, "is not render's record of what it wrote")
    files = data.get("files")
    return {f for f in files if isinstance(f, str)} if isinstance(files, list) else set()


def _check_dirs(out_dir: Path, path: Path) -> None:
    """Every directory from ``out_dir`` down to ``path``'s parent: missing or a real directory."""
    for d in [out_dir, *reversed([p for p in path.parents if out_dir in p.parents])]:
        try:
            mode = d.lstat().st_mode
        except FileNotFoundError:
            return
        if stat.S_ISLNK(mode):
            raise _refuse(d, "is a symlink: refusing to write through it")
        if not stat.S_ISDIR(mode):
            raise _refuse(d, "is in the way (not a directory)")


def check_tree(files: Iterable[RenderedFile], out_dir: Path, *, force: bool = False) -> None:
    """Refuse, before anything is written, a tree render must not write into."""
    _check_dirs(out_dir, out_dir / RECORD_NAME)
    before = _written_before(out_dir)
    for f in files:
        if f.content is None and f.link is None:
            continue  # secrets and the model are not written
        path = under(out_dir, f.path)
        _check_dirs(out_dir, path)
        kind = current_state(path).kind
        if kind in ("dir", "other"):
            raise _refuse(path, f"is a {'directory' if kind == 'dir' else 'special file'}")
        if kind != "missing" and f.path not in before and not force:
            raise _refuse(
                path,
                "exists and was not written by an earlier render",
                hint="choose an empty directory, or give --force to replace it",
            )


def write_tree(files: Iterable[RenderedFile], out_dir: Path, *, force: bool = False) -> list[Path]:
    """Write rendered files under ``out_dir`` at their destination paths (for review)."""
    files = [f for f in files if f.content is not None or f.link is not None]
    check_tree(files, out_dir, force=force)
    with writing(out_dir):
        out_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    w = RootWriter(out_dir)
    before = _written_before(out_dir)
    written = []
    for f in files:
        w.make_dirs(f.path.rsplit("/", 1)[0] or "/")
        if f.link is not None:
            w.link(f.path, f.link)
        else:
            w.write(f.path, f.content or b"", f.mode)
        written.append(under(out_dir, f.path))
    record = {"schema": RECORD_SCHEMA, "files": sorted(before | {f.path for f in files})}
    w.write("/" + RECORD_NAME, (json.dumps(record, indent=1) + "\n").encode())
    return written
