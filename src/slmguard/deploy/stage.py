"""A board's staging directory: the plan and the model a fleet rollout hands to apply.

Owns ``STAGE_DIR`` (the Ansible role's ``slmguard_stage_dir``, default
``/var/lib/slmguard-fleet``): ``plan.json``, the model as
``models/<sha256[:16]>/<NAME>`` (``NAME.part`` while it comes in), and
``gate.json``, the deployment that last passed the fleet's gate. The model is
taken, first that works, from: the staged file while apply's stamp
(:mod:`slmguard.deploy.digests`) vouches for it (nothing read); the staged
file hashed once (streamed) when unstamped, deleted when its bytes are wrong;
a file on the board a stamp vouches for with that sha256 (the installed model
of an earlier plan: a hard link, nothing moved); the mirror
(:mod:`slmguard.deploy.download`: resumed, retried, hashed as it arrives).
Whatever was hashed is stamped, so apply never reads the model again. A board
plan's other models and its vision projector (issues 39, 42) are staged the
same way, each beside the model. Files of other plans are removed from the
staging directory (apply keeps what a rollback needs as its own hard links).

Writes only under the staging directory and apply's stamps; never the
deployment (that is apply's), never outside the root.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard import atomicio
from slmguard.deploy import escape
from slmguard.deploy.digests import Digests
from slmguard.deploy.download import DEFAULT_RETRY, ProgressFn, Retry, SleepFn, fetch, part_path
from slmguard.deploy.manifest import Manifest, check_rollout
from slmguard.deploy.rootpath import confine
from slmguard.errors import HostReadError, HostWriteError, UsageError

PLAN_NAME = "plan.json"
GATE_NAME = "gate.json"
GATE_SCHEMA = "slmguard.gate/1"
MODELS = "models"
_HEX = re.compile(r"[0-9a-f]{64}")
_GATE_MAX_BYTES = 4096
#: The largest model staged (a 4-8 GB board's models are a few GB).
MAX_MODEL_BYTES = 1 << 40


@dataclass(frozen=True)
class WantedModel:
    """The model a plan deploys, as the fleet's render names it: file name, size, sha256."""

    name: str
    size_bytes: int
    sha256: str
    flag: str = field(default="--model", compare=False)  # its flags' prefix, for errors

    def __post_init__(self) -> None:
        if not _HEX.fullmatch(self.sha256):
            raise UsageError(
                f"{self.flag}-sha256 {self.sha256[:80]!r}: not a sha256 (64 hex digits)"
            )
        if not 0 < self.size_bytes <= MAX_MODEL_BYTES:
            raise UsageError(f"{self.flag}-size {self.size_bytes}: must be 1..{MAX_MODEL_BYTES}")

    @property
    def rel(self) -> str:
        """Its path in the staging directory."""
        return f"{MODELS}/{self.sha256[:16]}/{escape.file_name(self.name)}"


@dataclass(frozen=True)
class StagedModel:
    """Where the model is and how it got there: ``how`` is ``kept`` (its stamp), ``verified``
    (hashed once), ``linked`` (another file on the board), ``downloaded`` or ``missing``."""

    path: Path
    how: str
    read_bytes: int = 0  # read from the board's disk to hash it
    downloaded_bytes: int = 0
    resumed_bytes: int = 0
    attempts: int = 0
    discarded: bool = False  # a staged file of the wrong bytes was deleted


def stage_path(stage_dir: Path, rel: str) -> Path:
    """``rel`` under the staging directory, never through a link out of it."""
    return confine(stage_dir, "/" + rel, where="the staging directory")


def write_plan(stage_dir: Path, text: bytes) -> bool:
    """The plan as ``plan.json`` (0644); False when it holds these bytes already."""
    path = stage_path(stage_dir, PLAN_NAME)
    try:
        if path.is_file() and not path.is_symlink() and path.read_bytes() == text:
            return False
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        atomicio.write_atomic(path, text, 0o644)
    except OSError as err:
        raise HostWriteError(path, err.strerror or str(err)) from err
    return True


def _hash_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    done = 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
                done += len(block)
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err
    return h.hexdigest(), done


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        raise HostWriteError(path, err.strerror or str(err)) from err


def _check_staged(
    path: Path, want: WantedModel, digests: Digests, verify: bool
) -> StagedModel | None:
    """The staged file when it is the model (by stamp, or hashed once); a wrong one goes."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size != want.size_bytes:
        _remove(path)
        return StagedModel(path, "missing", discarded=True)
    if not verify and digests.trusted(path) == want.sha256:
        return StagedModel(path, "kept")
    digest, read = _hash_file(path)
    if digest != want.sha256:
        _remove(path)
        return StagedModel(path, "missing", read_bytes=read, discarded=True)
    digests.remember(path, want.sha256)
    return StagedModel(path, "verified", read_bytes=read)


def _link_local(path: Path, want: WantedModel, digests: Digests) -> bool:
    """A file on the board its stamp vouches for, hard-linked as the staged model."""
    for source in digests.holding(want.sha256):
        if source == path or not source.is_file():
            continue
        try:
            os.link(source, path)
        except OSError:
            continue  # another file system, or a link refused: the mirror then
        digests.remember(path, want.sha256)
        return True
    return False


def stage_model(
    stage_dir: Path,
    want: WantedModel,
    digests: Digests,
    *,
    url: str | None = None,
    retry: Retry = DEFAULT_RETRY,
    verify: bool = False,
    progress: ProgressFn | None = None,
    sleep: SleepFn | None = None,
) -> StagedModel:
    """The model in the staging directory (see the module docstring); ``missing`` when it is
    not there and there is no ``url`` (the caller copies it, then stages again)."""
    path = stage_path(stage_dir, want.rel)
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as err:
        raise HostWriteError(path.parent, err.strerror or str(err)) from err
    found = _check_staged(path, want, digests, verify)
    if found is not None and found.how != "missing":
        return found
    discarded = found is not None and found.discarded
    read = 0 if found is None else found.read_bytes
    if _link_local(path, want, digests):
        return StagedModel(path, "linked", read_bytes=read, discarded=discarded)
    if url is None:
        return StagedModel(path, "missing", read_bytes=read, discarded=discarded)
    kwargs: dict[str, Any] = {} if sleep is None else {"sleep": sleep}
    got = fetch(url, path, want.size_bytes, want.sha256, retry=retry, progress=progress, **kwargs)
    digests.remember(path, want.sha256)
    return StagedModel(
        path,
        "downloaded",
        read_bytes=read + got.resumed_bytes,
        downloaded_bytes=got.downloaded_bytes,
        resumed_bytes=got.resumed_bytes,
        attempts=got.attempts,
        discarded=discarded,
    )


def prune_models(stage_dir: Path, wants: Sequence[WantedModel]) -> list[str]:
    """Remove the staged files of other plans (and their partial files), keeping every file
    of ``wants`` (the model, a board's other models, the projector); what went."""
    models = stage_path(stage_dir, MODELS)
    keep: dict[str, set[str]] = {}
    for want in wants:
        path = stage_path(stage_dir, want.rel)
        keep.setdefault(want.sha256[:16], set()).update({path.name, part_path(path).name})
    removed: list[str] = []
    if not models.is_dir() or models.is_symlink():
        return removed
    for child in sorted(models.iterdir()):
        if child.name in keep:
            for leftover in sorted(child.iterdir()):
                if leftover.name not in keep[child.name]:
                    _remove_tree(leftover)
                    removed.append(str(leftover))
            continue
        _remove_tree(child)
        removed.append(str(child))
    return removed


def _remove_tree(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as err:
        raise HostWriteError(path, err.strerror or str(err)) from err


# ----------------------------------------------------------------- the gate's record


def deployment_record(manifest: Manifest | None) -> dict[str, Any] | None:
    """The deployment in place, as the gate's record names it (None: no apply yet)."""
    if manifest is None:
        return None
    return {
        "gen": manifest.gen,
        "plan_sha256": manifest.plan_sha256,
        "rollout": manifest.rollout,
        "complete": manifest.complete,
    }


def read_gate(stage_dir: Path) -> dict[str, Any] | None:
    """The deployment that last passed the gate (None: none, or a file not of our shape)."""
    try:
        path = stage_path(stage_dir, GATE_NAME)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(_GATE_MAX_BYTES + 1)
        data = json.loads(raw) if len(raw) <= _GATE_MAX_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("schema") != GATE_SCHEMA:
        return None
    record = data.get("deployment")
    if not isinstance(record, dict) or not isinstance(record.get("gen"), int):
        return None
    try:
        check_rollout(record.get("rollout"))
    except ValueError:
        return None
    sha = record.get("plan_sha256")
    if sha is not None and not (isinstance(sha, str) and _HEX.fullmatch(sha)):
        return None
    return {k: record[k] for k in ("gen", "plan_sha256", "rollout")}


def gated(stage_dir: Path, manifest: Manifest | None) -> bool:
    """Whether the deployment in place is the one that last passed the gate."""
    now = deployment_record(manifest)
    if now is None or not now["complete"]:
        return False
    return read_gate(stage_dir) == {k: now[k] for k in ("gen", "plan_sha256", "rollout")}


def record_gate(stage_dir: Path, manifest: Manifest | None) -> bool:
    """Record the deployment in place as passed; False when it was already (or there is none)."""
    now = deployment_record(manifest)
    if now is None or gated(stage_dir, manifest):
        return False
    record = {k: now[k] for k in ("gen", "plan_sha256", "rollout")}
    data = json.dumps({"schema": GATE_SCHEMA, "deployment": record}, indent=1) + "\n"
    path = stage_path(stage_dir, GATE_NAME)
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        atomicio.write_atomic(path, data.encode(), 0o644)
    except OSError as err:
        raise HostWriteError(path, err.strerror or str(err)) from err
    return True
