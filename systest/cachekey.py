"""The image cache key: a digest of everything the guest image is built from.

Owns turning the image inputs into a short hex key. Pure: callers read the
files; this module only hashes what it is given.

Two keys, because the Debian bootstrap is the slow part and does not depend on
the project: ``base`` covers the base recipe (``systest/base.py`` and the files
baked into the guest), the Debian suite and the package list (the kernel
package among them); ``image`` adds the image recipe (``systest/image.py``) and
the wheels installed into the guest's venv.

A wheel is keyed by its *contents* (member names and their bytes), not by the
zip file's bytes: a wheel rebuilt from the same sources in a fresh clone has
other zip timestamps but must hit the same cache entry.
"""

from __future__ import annotations

import hashlib
import io
import re
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

KEY_CHARS = 16
"""Hex digits of a key (64 bits: plenty for a handful of cached images)."""

FORMAT = "slmguard-systest-image/1"
"""Bump when the layout of a cached image changes, to invalidate old entries."""


@dataclass(frozen=True)
class BaseInputs:
    """What the Debian base (bootstrap, configuration, initramfs) depends on."""

    suite: str
    packages: tuple[str, ...]
    recipe_files: Mapping[str, bytes]  # relative name -> file content


def _feed(h: hashlib._Hash, *parts: str | bytes) -> None:
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        # length-prefixed so ("ab", "c") and ("a", "bc") differ
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)


def base_key(inputs: BaseInputs) -> str:
    """Key of the Debian base; package order does not matter, duplicates neither."""
    h = hashlib.sha256()
    _feed(h, FORMAT, "suite", inputs.suite, "packages", *sorted(set(inputs.packages)))
    for name in sorted(inputs.recipe_files):
        _feed(h, "file", name, inputs.recipe_files[name])
    return h.hexdigest()[:KEY_CHARS]


def wheel_digest(wheel_bytes: bytes) -> str:
    """Digest of a wheel's members (names and contents), ignoring zip metadata.

    Raises ``zipfile.BadZipFile`` for a file that is not a zip archive.
    """
    h = hashlib.sha256()
    with zipfile.ZipFile(io.BytesIO(wheel_bytes)) as zf:
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            if info.is_dir():
                continue
            _feed(h, info.filename, hashlib.sha256(zf.read(info)).digest())
    return h.hexdigest()


def image_key(base: str, recipe: bytes, wheel_digests: Mapping[str, str]) -> str:
    """Key of the full image: the base key, the image recipe, each wheel (name -> digest)."""
    h = hashlib.sha256()
    _feed(h, FORMAT, "base", base, "recipe", recipe)
    for name in sorted(wheel_digests):
        _feed(h, "wheel", name, wheel_digests[name])
    return h.hexdigest()[:KEY_CHARS]


IMAGE_DIR = re.compile(f"[0-9a-f]{{{KEY_CHARS}}}")
BASE_DIR = re.compile(f"base-[0-9a-f]{{{KEY_CHARS}}}")


def stale_entries(
    entries: Iterable[tuple[str, float]], kind: re.Pattern[str], keep: int
) -> list[str]:
    """Cache entries to delete: those whose name matches ``kind``, but the ``keep`` newest.

    ``entries`` are (directory name, mtime) pairs; other names are left alone.
    """
    mine = sorted((e for e in entries if kind.fullmatch(e[0])), key=lambda e: e[1], reverse=True)
    return [name for name, _ in mine[keep:]]
