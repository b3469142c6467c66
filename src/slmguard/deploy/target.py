"""What the target root holds: the one reader of the files apply is about to change.

Owns reading, under a root, everything ``render --root`` and ``apply`` need
to know before they decide anything:

- MemTotal and the huge pages of ``<root>/proc/meminfo`` (parsed by
  :func:`slmguard.host.procfs.parse_meminfo`; a root without it, such as a
  mounted SD card image, has neither, and the plan's RAM is the bound);
- the running values of the sysctl keys the deployment sets
  (``<root>/proc/sys``, through :mod:`slmguard.host.procfs`);
- ``/etc/fstab`` and the boot file the plan's ``cma=`` goes into
  (:mod:`slmguard.host.bootfiles` finds it when the plan names none);
- the state of each destination (:class:`Current`: missing, a file with its
  bytes, mode, owner and mtime, a symlink and its target, a directory or
  another kind), never following the final symlink.

Refusals found while reading (:class:`~slmguard.errors.RefusedError`, exit 78,
before anything is written): a destination that leaves the root (``..``, or a
symlink on the way, checked by :mod:`slmguard.deploy.rootpath`), a file where a
directory must be, text that is not UTF-8, the plan's boot file missing.
Nothing here writes; what the files should become is :mod:`slmguard.deploy.render`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from slmguard.default_model import sha256_file
from slmguard.deploy.modelfile import ModelSource
from slmguard.deploy.rootpath import check_root, confine, dest_path
from slmguard.deploy.system import FSTAB_PATH, sysctl_settings
from slmguard.deploy.units import ADMIN_TOKEN_PATH, API_KEY_PATH
from slmguard.errors import BootFileError, HostReadError, RefusedError
from slmguard.host import bootfiles, files
from slmguard.host.procfs import parse_meminfo, read_sysctl, sysctl_path
from slmguard.plan.schema import Plan

if TYPE_CHECKING:
    from slmguard.deploy.digests import Digests


@dataclass(frozen=True)
class Current:
    """One destination as it is now (the final symlink is not followed)."""

    kind: str  # "missing" | "file" | "link" | "dir" | "other"
    data: bytes | None = None  # a regular file's bytes (not read for large files)
    link: str | None = None  # a symlink's target
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    mtime_ns: int | None = None
    size_bytes: int | None = None
    sha256: str | None = None  # only for the model (compared by digest, never read whole)

    @property
    def exists(self) -> bool:
        return self.kind != "missing"


MISSING = Current("missing")


@dataclass(frozen=True)
class BootFile:
    """The boot file ``cma=`` goes into: its destination, format and text."""

    dest: str  # absolute under the root, e.g. /boot/armbianEnv.txt
    kind: str  # a slmguard.host.bootfiles format
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8")


@dataclass(frozen=True)
class TargetState:
    """What render needs to know about the target besides the plan.

    The default is a target nothing is known about (``render`` without
    ``--root``): no host numbers, no fstab or boot file to edit.
    """

    mem_total_bytes: int | None = None
    hugetlb_bytes: int = 0
    fstab_text: str | None = None
    boot: BootFile | None = None
    boot_file_missing: bool = False  # the plan asks for cma= and no boot file was found
    running_sysctls: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, Current] = field(default_factory=dict)  # by destination


def under(root: Path, dest: str) -> Path:
    """The path of destination ``dest`` (absolute on the target) below ``root``."""
    return root / dest.lstrip("/")


def current_state(path: Path, *, read_limit: int | None = None) -> Current:
    """The state of ``path`` without following it when it is a symlink.

    ``read_limit``: a regular file larger than this is not read (``data`` None).
    """
    try:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            return Current("link", link=os.readlink(path))
        if stat.S_ISREG(st.st_mode):
            big = read_limit is not None and st.st_size > read_limit
            data = None if big else path.read_bytes()
        elif stat.S_ISDIR(st.st_mode):
            return Current("dir")
        else:
            return Current("other")
    except FileNotFoundError:
        return MISSING
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err
    return Current(
        "file",
        data=data,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        mtime_ns=st.st_mtime_ns,
        size_bytes=st.st_size,
    )


def _check_parent(parent: Path, wanted: str) -> None:
    """A directory on the way to a target: missing, a directory, or a link to one.

    Where links lead is :func:`slmguard.deploy.rootpath.confine`'s concern
    (checked first): here only whether a file is in the way.
    """
    kind = current_state(parent).kind
    if kind in ("missing", "dir") or (kind == "link" and parent.is_dir()):
        return
    raise RefusedError(
        f"{parent} is in the way of {wanted} (it is not a directory)",
        facts={"path": str(parent), "wanted": wanted},
    )


def _confined_way(root: Path, dest: str) -> Path:
    path = confine(root, dest, where=dest)
    parent = path.parent
    while parent != root and root in parent.parents:
        _check_parent(parent, dest)
        parent = parent.parent
    return path


def read_destination(root: Path, dest: str, *, read_limit: int | None = None) -> Current:
    """The state of one destination, after checking that it and its way stay in the root."""
    return current_state(_confined_way(root, dest), read_limit=read_limit)


def file_digest(path: Path, digests: Digests | None = None) -> str:
    """``path``'s sha256: from apply's stamp when it still matches, else hashed (and stamped)."""
    digest = digests.trusted(path) if digests is not None else None
    if digest is None:
        try:
            digest = sha256_file(path)
        except OSError as err:
            raise HostReadError(path, err.strerror or str(err)) from err
        if digests is not None:
            digests.remember(path, digest)
    return digest


def read_model_destination(
    root: Path, dest: str, model: ModelSource, digests: Digests | None = None
) -> Current:
    """The installed model's state: size and sha256, hashed only when it could be the same.

    The file is never read into memory; the same inode as the source, or a
    stamp that still matches (:mod:`slmguard.deploy.digests`), needs no hash.
    """
    path = _confined_way(root, dest)
    now = current_state(path, read_limit=0)
    if now.kind != "file" or now.size_bytes != model.size_bytes:
        return now
    try:
        same = os.path.samefile(path, model.source)
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err
    return replace(now, sha256=model.sha256 if same else file_digest(path, digests))


def read_destinations(
    root: Path,
    dests: Iterable[str],
    models: Mapping[str, ModelSource] | None = None,
    digests: Digests | None = None,
) -> dict[str, Current]:
    """The state of each destination, by destination (models by digest)."""
    models = models or {}
    return {
        dest: read_model_destination(root, dest, models[dest], digests)
        if dest in models
        else read_destination(root, dest)
        for dest in dests
    }


def _read_followed(root: Path, dest: str) -> bytes | None:
    """A file that is edited in place (fstab, boot file): followed, but only inside the root."""
    path = confine(root, dest, follow=True, where=dest)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RefusedError(
            f"{path}: not UTF-8 text, refusing to edit it",
            facts={"path": str(path), "problem": "not UTF-8"},
        ) from err


def _boot_file(plan: Plan, root: Path) -> BootFile | None:
    """The boot file the plan's ``cma=`` goes into; None when there is none to edit."""
    if plan.board.boot_file:
        dest = dest_path("/" + plan.board.boot_file.lstrip("/"), "plan.board.boot_file")
        path = confine(root, dest, follow=True, where="plan.board.boot_file")
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
            return None
        path, kind = found
        dest = "/" + str(path.relative_to(root))
    data = _read_followed(root, dest) or b""
    _decode(path, data)
    return BootFile(dest, kind, data)


def _meminfo(root: Path) -> tuple[int | None, int]:
    """(MemTotal, huge page bytes) of the root; (None, 0) when it has no /proc/meminfo."""
    text = files.read(root / "proc/meminfo").optional()
    if text is None:
        return None, 0
    try:
        info = parse_meminfo(text)
    except ValueError:  # no MemTotal: not a usable /proc under this root
        return None, 0
    return info.mem_total_bytes, info.hugetlb_bytes


def _running_sysctls(root: Path, keys: Iterable[str]) -> dict[str, str]:
    """The running values of ``keys`` under ``root/proc/sys``; keys it lacks are left out."""
    return {key: read_sysctl(root, key) for key in keys if (root / sysctl_path(key)).is_file()}


def read_target(root: Path, plan: Plan) -> TargetState:
    """Everything render needs from ``root`` for ``plan`` (see the module docstring)."""
    check_root(root)
    mem_total, hugetlb = _meminfo(root)
    fstab_path = under(root, FSTAB_PATH)
    fstab = _read_followed(root, FSTAB_PATH)
    boot = _boot_file(plan, root) if plan.kernel.cma_bytes is not None else None
    return TargetState(
        mem_total_bytes=mem_total,
        hugetlb_bytes=hugetlb,
        fstab_text=None if fstab is None else _decode(fstab_path, fstab),
        boot=boot,
        boot_file_missing=plan.kernel.cma_bytes is not None and boot is None,
        running_sysctls=_running_sysctls(root, (key for key, _ in sysctl_settings(plan))),
        secrets={p: current_state(under(root, p)) for p in (ADMIN_TOKEN_PATH, API_KEY_PATH)},
    )
