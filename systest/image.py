"""The full guest image: the Debian base plus slmguard and the model.

Owns the second cached layer, ``<key>/`` under the systest cache:
``disk.ext4`` (a copy of the base rootfs with slmguard installed in one of two
ways, and the default model assembled by ``slmguard model prepare``),
``vmlinuz``, ``initrd.img`` and ``inputs.json``:

- ``Wheels`` (``make systest``, CI): a venv at ``VENV`` holding the wheels,
  installed offline with ``pip --no-index``, and the Makefile's engine beside its
  Python; ``/usr/local/bin/slmguard``.
- ``DebPackage`` (``make systest-deb``): the previous slmguard package installed
  by ``dpkg -i`` (offline: its postinst builds the venv ``/opt/slmguard`` from the
  wheels it ships; the engines land in ``/usr/lib/slmguard/engines``);
  ``/usr/bin/slmguard``.

Its key covers the base key, this file and what is installed (each wheel's
contents, or the package's sha256: ``cachekey.image_key``). The ext4 file system is
written with ``mkfs.ext4 -d`` (no loop mount). Built in a ``.tmp`` sibling and
renamed into place; ``prune`` keeps the newest entries only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from systest import cachekey
from systest.base import ImageError, chroot_mounts, run_logged

log = logging.getLogger(__name__)

VENV = "/opt/slmguard/venv"  # the wheels' (the package's venv is /opt/slmguard)
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


class Install(Protocol):
    """How slmguard gets into the image: what keys it, and the install itself."""

    @property
    def slmguard(self) -> str:
        """The command's path in the guest."""

    def digests(self) -> dict[str, str]: ...

    def install(self, chroot: list[str], rootfs: Path, logfile: Path) -> None: ...


@dataclass(frozen=True)
class Wheels:
    """slmguard[serve] from wheels into a venv, and the Makefile's engine beside it."""

    wheels: Sequence[Path]
    engine: Path
    version: str
    slmguard: str = "/usr/local/bin/slmguard"

    def digests(self) -> dict[str, str]:
        out = {w.name: cachekey.wheel_digest(w.read_bytes()) for w in self.wheels}
        out["llama-server"] = hashlib.sha256(self.engine.read_bytes()).hexdigest()
        return out

    def install(self, chroot: list[str], rootfs: Path, logfile: Path) -> None:
        staged = rootfs / "tmp" / "systest-wheels"
        staged.mkdir(parents=True)
        for w in self.wheels:
            shutil.copyfile(w, staged / w.name)
        run_logged([*chroot, "/usr/bin/python3", "-m", "venv", VENV], logfile, "guest venv")
        pip = [f"{VENV}/bin/pip", "install", "-q", "--no-index", "--no-cache-dir",
               "--disable-pip-version-check", "--find-links", "/tmp/systest-wheels"]  # fmt: skip
        run_logged([*chroot, *pip, f"slmguard[serve]=={self.version}"], logfile,
                   "offline pip install in the guest")  # fmt: skip
        shutil.rmtree(staged)
        (rootfs / self.slmguard.lstrip("/")).symlink_to(f"{VENV}/bin/slmguard")
        guest_engine = rootfs / VENV.lstrip("/") / "bin" / "llama-server"
        shutil.copyfile(self.engine, guest_engine)
        guest_engine.chmod(0o755)
        run_logged([*chroot, f"{VENV}/bin/llama-server", "--version"], logfile,
                   "engine in the guest")  # fmt: skip


@dataclass(frozen=True)
class DebPackage:
    """The slmguard Debian package and those installed with it (slmguard-deps, the engine,
    the default model's), installed with one ``dpkg -i`` (no network)."""

    path: Path
    sha256: str
    slmguard: str = "/usr/bin/slmguard"
    companions: tuple[tuple[Path, str], ...] = ()

    def digests(self) -> dict[str, str]:
        return {self.path.name: self.sha256, **{p.name: d for p, d in self.companions}}

    def install(self, chroot: list[str], rootfs: Path, logfile: Path) -> None:
        paths = [self.path, *(p for p, _ in self.companions)]
        for path in paths:
            shutil.copyfile(path, rootfs / "tmp" / path.name)
        run_logged([*chroot, "dpkg", "-i", *(f"/tmp/{p.name}" for p in paths)], logfile,
                   "dpkg -i in the guest")  # fmt: skip
        for path in paths:
            (rootfs / "tmp" / path.name).unlink()
        run_logged([*chroot, self.slmguard, "engine"], logfile, "the engine for the guest's CPU")


def build_image(cache: Path, base: Path, key: str, what: Install, logdir: Path) -> Image:
    """The full image for ``key``, built from ``base`` with slmguard installed as
    ``what`` says (in a chroot, no network) when not cached."""
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
    with chroot_mounts(rootfs):
        ch = ["chroot", str(rootfs)]
        what.install(ch, rootfs, logfile)
        prepare = [*ch, what.slmguard, "model", "prepare"]
        run_logged(prepare, logfile, "default model")
        # mkfs.ext4 -d may not carry nanosecond mtimes into the image, and the
        # model's stamp records mtime_ns: with a whole-second mtime the stamp
        # still matches in the guest, which then skips re-hashing 240 MB under
        # emulation. A second prepare re-stamps after the truncation.
        for model in (rootfs / MODEL_DIR.lstrip("/")).glob("*.gguf"):
            whole = model.stat().st_mtime_ns // 10**9 * 10**9
            os.utime(model, ns=(whole, whole))
        run_logged(prepare, logfile, "default model (re-stamp)")
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
        json.dumps({"key": key, "base": base.name, "installed": sorted(what.digests())}, indent=2)
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
