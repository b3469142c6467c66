"""The one writer: put the rendered deployment under a root, and take it back.

``apply_plan`` computes every destination's wanted state (``slmguard.deploy.render``
plus edits of the root's fstab and boot file), compares it with what is
there, and for each difference:

1. records the current state (bytes, mode, owner, mtime, or symlink target, or
   "did not exist") in a root-only manifest, with a copy of the bytes, *before*
   the first target is touched, so an interrupted apply can still be rolled back;
2. writes the new content atomically: a temporary file in the same directory,
   fsync, rename over the target, fsync of the directory.

A path already in the manifest keeps its first record, so rollback returns to
the state before the first apply, however many applies followed. Everything
that can refuse (the plan's numbers, an unparseable boot file, a directory in
the way) is checked before the first write: a refused apply touches no file.
A second apply of the same plan finds nothing to change and writes nothing.

Secrets (the admin token) are the one thing apply makes up: when the path is
missing it writes ``secrets.token_urlsafe`` text there, mode 0600 from the
first byte; a path that exists is never touched, whatever it holds. Diffs and
dry runs show ``<secret, N bytes>``, never the value; the manifest records it
as "did not exist", so rollback removes a token apply created and leaves one
it found.
``sysctl --system`` and ``systemctl daemon-reload`` run
only when the root is ``/`` and the tool exists.

``rollback`` restores every recorded path byte for byte (removing those that
did not exist), removes the directories apply created, then the manifest.

Deleting a sysctl file does not undo values the kernel already took from it
(``sysctl --system`` sets keys, nothing resets them). So before the first
apply that writes the sysctl file, the running values of its keys are read
from ``<root>/proc/sys`` into the manifest, and rollback writes them back
there after the files are restored: the running kernel returns to where it
was, not only /etc. Only keys whose ``/proc/sys`` file exists are touched (a
mounted board image has an empty /proc, and it stays empty).

Manifest: ``<root>/var/lib/slmguard-apply/manifest.json`` (mode 0700 directory,
owned by root), backups under ``backup/`` beside it. Not inside the services'
state directory ``/var/lib/slmguard``: systemd chowns a ``StateDirectory=``
recursively to the service user at every start, and a service user able to
rewrite the backups (and their checksums) could make root's next rollback
write anything into /etc or /boot.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard.deploy.render import (
    FSTAB_PATH,
    SYSCTL_PATH,
    RenderedFile,
    RenderOptions,
    check_numbers,
    render_boot_file,
    render_files,
    render_fstab,
    secret_file_bytes,
)
from slmguard.errors import BootFileError, HostReadError, HostWriteError, RefusedError
from slmguard.host import bootfiles
from slmguard.host.procfs import parse_meminfo, sysctl_path
from slmguard.plan.schema import Plan

log = logging.getLogger(__name__)

MANIFEST_SCHEMA = "slmguard.apply/1"
SYSTEM_ROOT = Path("/")


@dataclass(frozen=True)
class Change:
    """One destination that differs from what the deployment wants."""

    file: RenderedFile
    old_bytes: bytes | None  # current regular-file content
    old_link: str | None  # current symlink target

    @property
    def path(self) -> str:
        return self.file.path

    @property
    def action(self) -> str:
        return "create" if self.old_bytes is None and self.old_link is None else "replace"


@dataclass(frozen=True)
class ApplyResult:
    changes: tuple[Change, ...]
    notes: tuple[str, ...]
    manifest: Path | None  # None in dry-run or when nothing changed
    commands: tuple[tuple[str, ...], ...] = ()  # post-apply tools that ran
    failed_commands: tuple[str, ...] = ()
    dry_run: bool = False

    @property
    def diff(self) -> str:
        return unified_diff(self.changes)


@dataclass(frozen=True)
class RollbackResult:
    restored: tuple[str, ...]
    removed: tuple[str, ...]
    removed_dirs: tuple[str, ...]
    commands: tuple[tuple[str, ...], ...] = ()
    failed_commands: tuple[str, ...] = ()
    nothing: bool = False
    sysctls_restored: tuple[str, ...] = ()  # running values written back under /proc/sys


@dataclass
class _Manifest:
    root: str
    entries: list[dict[str, Any]] = field(default_factory=list)
    created_dirs: list[str] = field(default_factory=list)
    sysctl_before: dict[str, str] = field(default_factory=dict)  # running values, by key

    def paths(self) -> set[str]:
        return {str(e["path"]) for e in self.entries}

    def to_json(self) -> str:
        data = {
            "schema": MANIFEST_SCHEMA,
            "root": self.root,
            "entries": self.entries,
            "created_dirs": self.created_dirs,
            "sysctl_before": self.sysctl_before,
        }
        return json.dumps(data, indent=2) + "\n"


# -- locations ----------------------------------------------------------------------


APPLY_DIR = "/var/lib/slmguard-apply"


def apply_dir(root: Path) -> Path:
    """Where apply keeps its manifest and backups for this root (see module docstring)."""
    return root / APPLY_DIR.lstrip("/")


def _under(root: Path, dest: str) -> Path:
    return root / dest.lstrip("/")


# -- reading the current state ------------------------------------------------------------


def parse_hugetlb_bytes(meminfo_text: str) -> int:
    """Bytes held by huge pages from /proc/meminfo.

    ``Hugetlb:`` (all sizes, Linux >= 4.16) when present, else
    ``HugePages_Total * Hugepagesize`` (default size only); 0 when neither.
    """
    values: dict[str, list[str]] = {}
    for line in meminfo_text.splitlines():
        key, sep, rest = line.partition(":")
        if sep:
            values[key.strip()] = rest.split()
    if values.get("Hugetlb"):
        return int(values["Hugetlb"][0]) * 1024
    total = values.get("HugePages_Total")
    size = values.get("Hugepagesize")
    if total and size:
        return int(total[0]) * int(size[0]) * 1024
    return 0


def _read_optional(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err


def _read_in_root(root: Path, path: Path) -> bytes | None:
    """Like _read_optional, refusing a file that resolves outside the root (via a link)."""
    if path.is_symlink() or any(p.is_symlink() for p in path.parents if p != root):
        real = path.resolve()
        if not real.is_relative_to(root.resolve()):
            raise RefusedError(
                f"{path} resolves to {real}, outside {root}: refusing to edit it",
                facts={"path": str(path), "target": str(real)},
            )
    return _read_optional(path)


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RefusedError(
            f"{path}: not UTF-8 text, refusing to edit it",
            facts={"path": str(path), "problem": "not UTF-8"},
        ) from err


def _boot_edit(plan: Plan, root: Path, notes: list[str]) -> RenderedFile | None:
    if plan.kernel.cma_bytes is None:
        return None
    if plan.board.boot_file:
        dest = "/" + plan.board.boot_file.lstrip("/")
        path = _under(root, dest)
        if not path.is_file():
            raise RefusedError(
                f"the plan puts cma= in {dest}, which does not exist under {root}",
                facts={"path": str(path), "cma_bytes": plan.kernel.cma_bytes},
                hint="plan for this board, or check --root",
            )
        try:
            kind = bootfiles.kind_for_path(dest)
        except BootFileError as err:
            raise RefusedError(err.message, facts={"path": dest}) from err
    else:
        found = bootfiles.find_boot_file(root)
        if found is None:
            notes.append(
                "the plan asks for cma= but no boot file (armbianEnv.txt, uEnv.txt, "
                "extlinux.conf) is under this root: boot arguments left alone"
            )
            return None
        path, kind = found
        dest = "/" + str(path.relative_to(root))
    data = _read_in_root(root, path) or b""
    edited = render_boot_file(plan, dest, kind, _decode(path, data))
    if edited is not None and edited.content != data:
        notes.append(f"{dest}: {edited.why} takes effect at the next boot")
    return edited


def make_secret(entropy_bytes: int) -> bytes:
    """A fresh random secret as the file holds it (URL-safe text and a newline)."""
    return (secrets.token_urlsafe(entropy_bytes) + "\n").encode("ascii")


def _secret_notes(files: Iterable[RenderedFile], root: Path) -> list[str]:
    """Warnings about secrets that exist (apply keeps them) but will not work or leak."""
    notes = []
    for f in files:
        if not f.is_secret:
            continue
        path = _under(root, f.path)
        try:
            st = path.lstat()  # a link is kept as the operator made it, and not followed
            if not stat.S_ISREG(st.st_mode):
                continue
            blank = not path.read_bytes().strip()
        except FileNotFoundError:
            continue
        except OSError as err:
            raise HostReadError(path, err.strerror or str(err)) from err
        if blank:
            notes.append(
                f"{f.path} exists but is empty: the services will refuse it; remove it "
                "and apply again to get a new one"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            notes.append(
                f"{f.path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"chmod 600 {f.path}"
            )
    return notes


def wanted_files(
    plan: Plan, opts: RenderOptions, root: Path
) -> tuple[list[RenderedFile], list[str]]:
    """Every destination's wanted state under ``root``, and notes for the user.

    Reads the root's fstab, boot file and /proc/meminfo (MemTotal, huge pages);
    raises RefusedError for anything that must stop the apply.
    """
    notes: list[str] = []
    meminfo = _read_optional(root / "proc/meminfo")
    text = meminfo.decode("utf-8", "replace") if meminfo else ""
    try:
        mem_total: int | None = parse_meminfo(text).mem_total_bytes
    except ValueError:  # no /proc under this root (an image, a test tree)
        mem_total = None
    check_numbers(plan, hugetlb_bytes=parse_hugetlb_bytes(text), host_mem_total_bytes=mem_total)
    files = list(render_files(plan, opts))
    fstab = _read_in_root(root, _under(root, FSTAB_PATH))
    if fstab is not None:
        edited = render_fstab(_decode(_under(root, FSTAB_PATH), fstab))
        if edited is not None:
            files.append(edited)
            notes.append(
                "swap entries in /etc/fstab are commented out; swap stays on until "
                "reboot or `swapoff -a`"
            )
    boot = _boot_edit(plan, root, notes)
    if boot is not None:
        files.append(boot)
    notes += _secret_notes(files, root)
    return files, notes


def _current(path: Path) -> tuple[str, bytes | None, str | None]:
    """('missing'|'file'|'link'|'dir'|'other', bytes, link target) without following links."""
    try:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            return "link", None, os.readlink(path)
        if stat.S_ISREG(st.st_mode):
            return "file", path.read_bytes(), None
    except FileNotFoundError:
        return "missing", None, None
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err
    if stat.S_ISDIR(st.st_mode):
        return "dir", None, None
    return "other", None, None


def _check_parent(root: Path, parent: Path, wanted: str) -> None:
    """A directory on the way to a target: missing, a directory, or a link to one inside root.

    A symlinked directory is followed only when it resolves inside the root: an
    absolute link in an image (``boot -> /boot/firmware``) would otherwise make
    ``apply --root`` write into the host running it.
    """
    kind, _, _ = _current(parent)
    if kind in ("missing", "dir"):
        return
    if kind == "link":
        real = parent.resolve()
        if real.is_dir() and (real == root.resolve() or real.is_relative_to(root.resolve())):
            return
        raise RefusedError(
            f"{parent} links to {real}, outside {root}: refusing to write through it",
            facts={"path": str(parent), "target": str(real), "wanted": wanted},
        )
    raise RefusedError(
        f"{parent} is in the way of {wanted} (it is not a directory)",
        facts={"path": str(parent), "wanted": wanted},
    )


def compute_changes(files: Iterable[RenderedFile], root: Path) -> list[Change]:
    """The files whose current state differs; RefusedError if one cannot be replaced."""
    changes: list[Change] = []
    for f in files:
        path = _under(root, f.path)
        parent = path.parent
        while parent != root and root in parent.parents:
            _check_parent(root, parent, f.path)
            parent = parent.parent
        kind, data, link = _current(path)
        if kind in ("dir", "other"):
            raise RefusedError(
                f"{path} is a {'directory' if kind == 'dir' else 'special file'}; "
                "refusing to replace it",
                facts={"path": str(path), "kind": kind},
            )
        if f.is_secret and kind in ("file", "link"):
            continue  # an existing secret is kept, whatever it holds
        if f.link is not None and kind == "link" and link == f.link:
            continue
        if f.content is not None and kind == "file" and data == f.content:
            continue
        changes.append(Change(f, data, link))
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


# -- writing -----------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems (vfat on older kernels) refuse fsync on a dir
        pass
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.slmguard-tmp-{os.getpid()}")


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temporary name beside ``path``, renamed over it (and the directory synced) on exit.

    Readers see the old file or the new one, never half. An OSError removes the
    temporary and becomes a HostWriteError naming ``path``.
    """
    tmp = _tmp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise HostWriteError(path, err.strerror or str(err)) from err


def write_atomic(
    path: Path,
    data: bytes,
    mode: int = 0o644,
    owner: tuple[int, int] | None = None,
    mtime_ns: int | None = None,
) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never half."""
    with _replacing(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
            if owner is not None and os.geteuid() == 0:
                os.fchown(fd, *owner)
            os.fsync(fd)
        finally:
            os.close(fd)
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))


def symlink_atomic(path: Path, target: str) -> None:
    """Point ``path`` at ``target`` in one rename (a link there before is replaced)."""
    with _replacing(path) as tmp:
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)


def _missing_dirs(path: Path, stop: Path) -> list[Path]:
    """Ancestors of ``path`` (itself included) below ``stop`` that do not exist, top first."""
    missing: list[Path] = []
    p = path
    while p != stop and p != p.parent and not p.exists():
        missing.append(p)
        p = p.parent
    return list(reversed(missing))


def _mkdirs(dirs: list[Path]) -> None:
    for d in dirs:
        try:
            d.mkdir(mode=0o755, exist_ok=True)
        except OSError as err:
            raise HostWriteError(d, err.strerror or str(err)) from err


def _dest(root: Path, p: Path) -> str:
    return "/" + str(p.relative_to(root)) if p != root else "/"


def _load_manifest(root: Path) -> _Manifest | None:
    path = apply_dir(root) / "manifest.json"
    data = _read_optional(path)
    if data is None:
        return None
    try:
        raw = json.loads(data)
    except json.JSONDecodeError as err:
        raise RefusedError(
            f"{path}: not valid JSON ({err.msg}); refusing to guess what apply changed",
            facts={"path": str(path)},
        ) from err
    if not isinstance(raw, dict) or raw.get("schema") != MANIFEST_SCHEMA:
        raise RefusedError(f"{path}: not an slmguard apply manifest", facts={"path": str(path)})
    before = raw.get("sysctl_before", {})
    return _Manifest(
        str(raw["root"]),
        list(raw["entries"]),
        list(raw["created_dirs"]),
        {str(k): str(v) for k, v in before.items()} if isinstance(before, dict) else {},
    )


def sysctl_keys(conf_text: str) -> list[str]:
    """The keys a sysctl.d file sets (``key = value`` lines; comments skipped)."""
    keys = []
    for line in conf_text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, _ = line.lstrip("-").partition("=")
        if sep and key.strip():
            keys.append(key.strip())
    return keys


def _running_sysctls(root: Path, keys: Iterable[str]) -> dict[str, str]:
    """The running values of ``keys`` under ``root/proc/sys``; unreadable keys are left out."""
    values = {}
    for key in keys:
        data = _read_optional(root / sysctl_path(key))
        if data is not None:
            values[key] = data.decode("utf-8", "replace").strip()
    return values


def _restore_sysctls(root: Path, values: dict[str, str]) -> tuple[list[str], list[str]]:
    """Write recorded values back to ``root/proc/sys``; (restored keys, failures)."""
    restored, failed = [], []
    for key, value in values.items():
        path = root / sysctl_path(key)
        if not path.is_file():
            continue
        try:
            with path.open("w") as f:
                f.write(value + "\n")
        except OSError as err:
            failed.append(f"{key}={value}: {err.strerror or err}")
            continue
        restored.append(key)
    return restored, failed


def _record(root: Path, backup_root: Path, change: Change, manifest: _Manifest) -> None:
    path = _under(root, change.path)
    entry: dict[str, Any] = {"path": change.path}
    if change.old_link is not None:
        entry.update(existed=True, kind="link", target=change.old_link)
    elif change.old_bytes is not None:
        try:
            st = path.lstat()
        except OSError as err:
            raise HostReadError(path, err.strerror or str(err)) from err
        rel = change.path.lstrip("/")
        backup = backup_root / rel
        _mkdirs(_missing_dirs(backup.parent, backup_root.parent))
        write_atomic(backup, change.old_bytes, 0o600)
        entry.update(
            existed=True,
            kind="file",
            backup=f"backup/{rel}",
            sha256=hashlib.sha256(change.old_bytes).hexdigest(),
            mode=stat.S_IMODE(st.st_mode),
            uid=st.st_uid,
            gid=st.st_gid,
            mtime_ns=st.st_mtime_ns,
        )
    else:
        entry.update(existed=False)
    manifest.entries.append(entry)


def post_commands(
    root: Path,
    changed: Iterable[str],
    which: Callable[[str], str | None] = shutil.which,
) -> list[tuple[str, ...]]:
    """The tools to run after writing: only for root ``/`` and only those installed."""
    if root.resolve() != SYSTEM_ROOT:
        return []
    changed = set(changed)
    cmds: list[tuple[str, ...]] = []
    if SYSCTL_PATH in changed and which("sysctl"):
        cmds.append(("sysctl", "--system"))
    if any(p.startswith("/etc/systemd/") for p in changed) and which("systemctl"):
        cmds.append(("systemctl", "daemon-reload"))
    return cmds


def _run(cmds: list[tuple[str, ...]]) -> list[str]:
    failed = []
    for cmd in cmds:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            failed.append(f"{' '.join(cmd)}: {err}")
            continue
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            failed.append(f"{' '.join(cmd)} exited {proc.returncode}: {tail[0]}")
    return failed


def apply_plan(
    plan: Plan,
    opts: RenderOptions,
    root: Path = SYSTEM_ROOT,
    *,
    dry_run: bool = False,
    run_tools: bool = True,
) -> ApplyResult:
    """Bring ``root`` to the deployment ``plan`` describes (see the module docstring)."""
    files, notes = wanted_files(plan, opts, root)
    changes = compute_changes(files, root)
    if dry_run or not changes:
        return ApplyResult(tuple(changes), tuple(notes), None, dry_run=dry_run)

    adir = apply_dir(root)
    manifest = _load_manifest(root) or _Manifest(str(root))
    known = manifest.paths()
    known_dirs = set(manifest.created_dirs)
    # Directories this apply creates: its own state directory, then the targets' parents.
    new_dirs = _missing_dirs(adir / "backup", root)
    for c in changes:
        for d in _missing_dirs(_under(root, c.path).parent, root):
            if d not in new_dirs:
                new_dirs.append(d)
    for d in new_dirs:
        dest = _dest(root, d)
        if dest not in known_dirs:
            manifest.created_dirs.append(dest)
            known_dirs.add(dest)
    _mkdirs(_missing_dirs(adir / "backup", root))
    try:
        adir.chmod(0o700)  # backups of /etc and /boot: root's eyes only
    except OSError as err:
        raise HostWriteError(adir, err.strerror or str(err)) from err
    for c in changes:
        if c.path not in known:
            _record(root, adir / "backup", c, manifest)
        if c.path == SYSCTL_PATH and not manifest.sysctl_before:
            keys = sysctl_keys((c.file.content or b"").decode("utf-8", "replace"))
            manifest.sysctl_before = _running_sysctls(root, keys)
    write_atomic(adir / "manifest.json", manifest.to_json().encode(), 0o600)

    for c in changes:
        path = _under(root, c.path)
        _mkdirs(_missing_dirs(path.parent, root))
        if c.file.link is not None:
            symlink_atomic(path, c.file.link)
        elif c.file.secret_bytes is not None:  # only ever created, never replaced
            write_atomic(path, make_secret(c.file.secret_bytes), c.file.mode)
        else:
            mode, owner = c.file.mode, None
            if c.old_bytes is not None:  # keep the replaced file's mode and owner
                st = path.lstat()
                mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
            write_atomic(path, c.file.content or b"", mode, owner)
        log.info("%s %s", c.action, c.path)

    cmds = post_commands(root, (c.path for c in changes)) if run_tools else []
    failed = _run(cmds)
    return ApplyResult(
        tuple(changes), tuple(notes), adir / "manifest.json", tuple(cmds), tuple(failed)
    )


def rollback(root: Path = SYSTEM_ROOT, *, run_tools: bool = True) -> RollbackResult:
    """Restore every path apply recorded, byte for byte, and remove what it created."""
    manifest = _load_manifest(root)
    if manifest is None:
        return RollbackResult((), (), (), nothing=True)
    adir = apply_dir(root)
    # Verify every backup before touching anything.
    backups: dict[str, bytes] = {}
    for e in manifest.entries:
        if e.get("existed") and e.get("kind") == "file":
            data = _read_optional(adir / str(e["backup"]))
            if data is None or hashlib.sha256(data).hexdigest() != e["sha256"]:
                raise RefusedError(
                    f"backup of {e['path']} is missing or damaged; nothing was restored",
                    facts={"path": e["path"], "backup": str(adir / str(e["backup"]))},
                )
            backups[str(e["path"])] = data
    restored, removed = [], []
    for e in manifest.entries:
        dest = str(e["path"])
        path = _under(root, dest)
        if not e.get("existed"):
            kind, _, _ = _current(path)
            if kind in ("file", "link"):
                try:
                    path.unlink()
                except OSError as err:
                    raise HostWriteError(path, err.strerror or str(err)) from err
                removed.append(dest)
            continue
        _mkdirs(_missing_dirs(path.parent, root))
        if e["kind"] == "link":
            symlink_atomic(path, str(e["target"]))
        else:
            write_atomic(
                path,
                backups[dest],
                int(e["mode"]),
                (int(e["uid"]), int(e["gid"])),
                int(e["mtime_ns"]),
            )
        restored.append(dest)
    try:
        shutil.rmtree(adir)
    except OSError as err:
        raise HostWriteError(adir, err.strerror or str(err)) from err
    removed_dirs = []
    for dest in sorted(manifest.created_dirs, key=lambda d: d.count("/"), reverse=True):
        d = _under(root, dest)
        try:
            d.rmdir()
            removed_dirs.append(dest)
        except FileNotFoundError:
            continue
        except OSError:  # not empty: something else was put there since
            log.info("left %s in place: not empty", d)
    cmds = post_commands(root, restored + removed) if run_tools else []
    failed = _run(cmds)
    # After `sysctl --system`: it re-reads the remaining files, and only the
    # recorded values put the running kernel back where apply found it.
    sysctls, sysctl_failed = _restore_sysctls(root, manifest.sysctl_before)
    return RollbackResult(
        tuple(restored),
        tuple(removed),
        tuple(removed_dirs),
        tuple(cmds),
        tuple(failed + sysctl_failed),
        sysctls_restored=tuple(sysctls),
    )


def write_tree(files: Iterable[RenderedFile], out_dir: Path) -> list[Path]:
    """Write rendered files under ``out_dir`` at their destination paths (for review).

    Secrets are left out: a review tree holds no token (apply creates it).
    """
    written = []
    for f in files:
        if f.is_secret:
            continue
        path = _under(out_dir, f.path)
        _mkdirs(_missing_dirs(path.parent, out_dir.parent))
        if path.is_dir() and not path.is_symlink():
            raise HostWriteError(path, "is a directory")
        if f.link is not None:
            symlink_atomic(path, f.link)
        else:
            write_atomic(path, f.content or b"", f.mode)
        written.append(path)
    return written
