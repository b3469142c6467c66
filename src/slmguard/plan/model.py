"""The planned model file: which file a plan deploys or serves, and that it is that file.

Owns a model file's identity (absolute path, size, SHA-256), hashed once per file
version through the descriptor it checked, with a digest cache in the state directory
keyed by device, inode, size, mtime and ctime (a cache file another user owns or may
write is ignored), and the one choice of file ``serve``, ``render`` and ``apply`` make:
:func:`verify_planned_model`, :func:`model_for_plan`, :func:`model_for_preset_plan`,
:func:`projector_for_plan` (each docstring states its checks and exit codes).

It must not parse GGUF itself (:mod:`slmguard.plan.ggufheader`, ``modelfacts``), read
or write the plan file (:mod:`slmguard.plan.planfile`), or install the model (``deploy``).

Example::

    path = verify_planned_model(load_plan(Path("plan.json")))
    spec = model_for_plan(plan, Path("qwen2.5-1.5b-instruct-q4_k_m.gguf"))
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard import atomicio
from slmguard.errors import (
    ConfigError,
    ModelError,
    ModelMismatchError,
    ModelNotFoundError,
    WrongModelError,
)
from slmguard.plan.ggufheader import open_regular
from slmguard.plan.schema import ModelSpec, Plan, ProjectorSpec

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
"""Called as ``progress(done_bytes, total_bytes)`` while hashing."""

CACHE_NAME = "model-digests.json"
CACHE_SCHEMA = "slmguard.digests/1"
CACHE_ENTRIES = 32
_CACHE_MAX_BYTES = 64 << 10
_CHUNK_BYTES = 4 << 20
PRESET_SIZE_SLACK = 1.05  # preset sizes are published to 2-3 significant digits


@dataclass(frozen=True)
class ModelFile:
    """A model file's identity: where it is and what is in it."""

    path: Path  # absolute, symlinks resolved
    file_bytes: int
    sha256: str


def _stamp(st: os.stat_result) -> dict[str, int]:
    return {
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


def _cache_path(state_dir: Path | None) -> Path:
    if state_dir is None:
        from slmguard import paths

        state_dir = paths.state_dir()
    return state_dir / CACHE_NAME


def _read_cache(cache: Path) -> list[dict[str, Any]]:
    try:
        fd = os.open(cache, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022):
            log.warning("ignoring the digest cache %s: not a private file of this user", cache)
            return []
        raw = f.read(_CACHE_MAX_BYTES + 1)
    try:
        data = json.loads(raw) if len(raw) <= _CACHE_MAX_BYTES else None
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict) or data.get("schema") != CACHE_SCHEMA:
        return []
    entries = data.get("entries")
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def _cached(cache: Path, path: Path, st: os.stat_result) -> str | None:
    stamp = _stamp(st)
    for e in _read_cache(cache):
        digest = e.get("sha256")
        if (
            e.get("path") == str(path)
            and all(e.get(k) == v for k, v in stamp.items())
            and isinstance(digest, str)
            and len(digest) == 64
        ):
            return digest
    return None


def _remember(cache: Path, path: Path, st: os.stat_result, digest: str) -> None:
    """Add the digest to the cache; a cache that cannot be written is only logged."""
    entry = {"path": str(path), **_stamp(st), "sha256": digest}
    kept = [e for e in _read_cache(cache) if e.get("path") != str(path)]
    data = {"schema": CACHE_SCHEMA, "entries": [entry, *kept][:CACHE_ENTRIES]}
    try:
        cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomicio.write_atomic(cache, json.dumps(data).encode(), mode=0o600)
    except OSError as err:
        log.info("not caching the digest of %s in %s: %s", path, cache, err.strerror or err)


def model_file(
    path: Path,
    *,
    state_dir: Path | None = None,
    progress: ProgressFn | None = None,
    cache: bool = True,
) -> ModelFile:
    """``path``'s identity, hashed (or taken from the digest cache when unchanged).

    ``cache=False`` neither reads nor writes the digest cache (``apply``, which
    must not write outside its target root). Raises ModelNotFoundError (66), or
    ModelError (65) for anything but a readable regular file, or a file that
    changes while it is hashed.
    """
    resolved = Path(os.path.realpath(path))
    cache_file = _cache_path(state_dir) if cache else None
    with open_regular(resolved) as f:
        before = os.fstat(f.fileno())
        digest = _cached(cache_file, resolved, before) if cache_file is not None else None
        if digest is not None:
            return ModelFile(resolved, before.st_size, digest)
        h = hashlib.sha256()
        done = 0
        try:
            while block := f.read(_CHUNK_BYTES):
                h.update(block)
                done += len(block)
                if progress is not None:
                    progress(done, before.st_size)
        except OSError as err:
            raise ModelError(resolved, f"cannot read: {err.strerror or err}") from err
        after = os.fstat(f.fileno())
    if _stamp(after) != _stamp(before) or done != before.st_size:
        raise ModelError(
            resolved,
            "changed while it was being hashed",
            hint="wait until the copy or download has finished",
        )
    if cache_file is not None:
        _remember(cache_file, resolved, after, h.hexdigest())
    return ModelFile(resolved, after.st_size, h.hexdigest())


def _check_identity(
    path: Path,
    spec: ModelSpec | ProjectorSpec,
    *,
    state_dir: Path | None,
    progress: ProgressFn | None,
    hint: str,
    cache: bool = True,
) -> ModelFile:
    """``path`` has the planned size and sha256 (size first: it costs no hashing)."""
    if spec.sha256 is None:
        raise ConfigError(
            f"the plan names {spec.path} without its sha256",
            hint="re-run `slmguard plan --model FILE` to record it",
        )
    resolved = Path(os.path.realpath(path))
    with open_regular(resolved) as f:
        size = os.fstat(f.fileno()).st_size
    if size != spec.file_bytes:
        raise ModelMismatchError(
            resolved, "size", f"{spec.file_bytes:,} bytes", f"{size:,} bytes", hint=hint
        )
    found = model_file(resolved, state_dir=state_dir, progress=progress, cache=cache)
    if found.sha256 != spec.sha256:
        raise ModelMismatchError(resolved, "sha256", spec.sha256, found.sha256, hint=hint)
    return found


def verify_planned_model(
    plan: Plan,
    *,
    state_dir: Path | None = None,
    progress: ProgressFn | None = None,
    cache: bool = True,
) -> Path:
    """The plan's model file, checked to be the file the plan was made for.

    Raises ConfigError (78) for a preset plan (no file: pass ``--model``),
    ModelNotFoundError (66) when the file is missing, ModelError (65) when it
    is not a regular file, ModelMismatchError (65) naming the expected and
    found size or sha256.
    """
    m = plan.model
    if m.path is None:
        raise ConfigError(
            f"the plan is for preset {m.preset} {m.quant or ''}".rstrip()
            + ": it names no model file",
            hint="pass the GGUF file with --model FILE (it is checked against the preset)",
        )
    path = Path(m.path)
    if not path.exists() and not path.is_symlink():
        raise ModelNotFoundError(
            path,
            hint="the plan was made for this file: put it back, or re-run "
            "`slmguard plan --model FILE`",
        )
    found = _check_identity(
        path,
        m,
        state_dir=state_dir,
        progress=progress,
        hint="the file changed since `slmguard plan`: put the planned file back, or re-run "
        "`slmguard plan --model FILE`",
        cache=cache,
    )
    return found.path


def model_for_preset_plan(
    plan: Plan,
    model_file_path: Path,
    *,
    state_dir: Path | None = None,
    progress: ProgressFn | None = None,
    cache: bool = True,
) -> ModelSpec:
    """The spec of ``model_file_path`` served under a preset plan, if its header fits.

    Its architecture, layer count and trained context must be the preset's
    and its size at most 5 % above the preset's published size (more is
    another quantization: the budget would be wrong). Raises WrongModelError
    (78) with the numbers, ConfigError (78) when the plan is not a preset
    plan, and the model errors (65, 66) of reading the header.
    """
    from slmguard.plan.modelfacts import read_model_facts

    m = plan.model
    if m.preset is None:
        raise ConfigError(
            f"the plan is for the file {m.path}, not a preset",
            hint="give that file (or a copy with the same sha256), or re-run `slmguard plan`",
        )
    facts = read_model_facts(Path(model_file_path))
    planned = (m.arch, m.n_layer, m.n_ctx_train)
    found = (facts.arch, facts.n_layer, facts.n_ctx_train)
    if planned != found:
        raise WrongModelError(
            f"is {facts.arch} with {facts.n_layer} layers and a trained context of "
            f"{facts.n_ctx_train}; the plan (preset {m.preset}) is for {m.arch} with "
            f"{m.n_layer} layers and {m.n_ctx_train}",
            path=model_file_path,
            facts={
                "arch": (m.arch, facts.arch),
                "n_layer": (m.n_layer, facts.n_layer),
                "n_ctx_train": (m.n_ctx_train, facts.n_ctx_train),
            },
            hint=f"pass the {m.preset} GGUF, or plan for this file: slmguard plan --model FILE",
        )
    if facts.file_bytes > m.file_bytes * PRESET_SIZE_SLACK:
        raise WrongModelError(
            f"has {facts.file_bytes:,} bytes, more than the {m.file_bytes:,} the plan budgets "
            f"for preset {m.preset} {m.quant or ''} (+5%): another quantization?",
            path=model_file_path,
            facts={"file_bytes": (m.file_bytes, facts.file_bytes)},
            hint="pass the planned quantization, or plan for this file: slmguard plan --model FILE",
        )
    ident = model_file(Path(model_file_path), state_dir=state_dir, progress=progress, cache=cache)
    return ModelSpec(
        name=facts.name,
        arch=facts.arch,
        file_bytes=ident.file_bytes,
        n_layer=facts.n_layer,
        n_ctx_train=facts.n_ctx_train,
        path=str(ident.path),
        preset=m.preset,
        quant=m.quant,
        sha256=ident.sha256,
    )


def model_for_plan(
    plan: Plan,
    model_file_path: Path | None = None,
    *,
    state_dir: Path | None = None,
    progress: ProgressFn | None = None,
    cache: bool = True,
) -> ModelSpec:
    """The model a plan deploys or serves, checked (see the module docstring).

    ``model_file_path`` is ``--model`` (None when not given). The returned
    spec's ``path`` is absolute and resolved.
    """
    m = plan.model
    if model_file_path is None:
        path = verify_planned_model(plan, state_dir=state_dir, progress=progress, cache=cache)
        return dataclasses.replace(m, path=str(path))
    if m.preset is not None and m.path is None:
        return model_for_preset_plan(
            plan, model_file_path, state_dir=state_dir, progress=progress, cache=cache
        )
    found = _check_identity(
        Path(model_file_path),
        m,
        state_dir=state_dir,
        progress=progress,
        hint=f"the plan was made for {m.path}: pass that file (or a copy), or re-run "
        "`slmguard plan --model FILE` for this one",
        cache=cache,
    )
    return dataclasses.replace(m, path=str(found.path))


def projector_for_plan(
    plan: Plan,
    mmproj: Path | None = None,
    *,
    state_dir: Path | None = None,
    progress: ProgressFn | None = None,
    cache: bool = True,
) -> ProjectorSpec | None:
    """The vision projector a plan serves or deploys, checked like its model: the plan's
    file, or ``mmproj`` (a copy elsewhere is fine), with the plan's size and sha256 (66,
    65). None for a plan without one; ``mmproj`` given for such a plan is a ConfigError
    (78): its images were never budgeted. The returned spec's ``path`` is the file
    checked, absolute and resolved."""
    v = plan.projector
    if v is None:
        if mmproj is None:
            return None
        raise ConfigError(
            f"--mmproj {mmproj}: the plan has no vision projector, so its budget holds no images",
            hint="plan with it: slmguard plan --model FILE --mmproj FILE",
        )
    path = Path(mmproj) if mmproj is not None else Path(v.path)
    if not path.exists() and not path.is_symlink():
        raise ModelNotFoundError(
            path,
            hint="the plan was made for this projector: put it back, or re-run "
            "`slmguard plan --mmproj FILE`",
        )
    found = _check_identity(
        path, v, state_dir=state_dir, progress=progress, cache=cache,
        hint=f"the plan was made for the projector {v.path}: pass that file (or a copy), or "
        "re-run `slmguard plan --mmproj FILE` for this one",
    )  # fmt: skip
    return dataclasses.replace(v, path=str(found.path))
