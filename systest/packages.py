"""The Debian packages the guest installs: the previous ones in the image, this tree's in the share.

Owns finding and checking the amd64 packages ``make dist-amd64``,
``make dist-previous-amd64`` and ``make dist-model`` build:
``dist/slmguard_<version>-1_amd64.deb`` (this tree) and
``dist/previous/slmguard_<older>-1_amd64.deb`` (the same tree built as an older
version: there is no earlier release to upgrade from), each with the packages
that move apart from it (``slmguard-deps``, ``slmguard-engine-avx2``: the newest
of each beside it) and the default model's (``slmguard-model-*_all.deb`` in
``dist/``). The image installs the previous set (``dpkg -i``, offline: the
postinst builds the venv from the wheels shipped); the scenario's
``package-upgrade`` step installs this tree's slmguard over it (its wheels and
engine are the same versions: an slmguard-only upgrade), with the deployment
applied and serving, and every later step runs from it. Each package's sha256
is part of the image key.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from slmguard.default_model import sha256_file

NAME = "slmguard"
ARCH = "amd64"


class PackageError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Package:
    path: Path
    version: str  # the Debian version, 0.1.0-1
    sha256: str
    #: installed with it: slmguard-deps, the engine, the model's package (path, sha256)
    companions: tuple[tuple[Path, str], ...] = ()


#: The packages installed with slmguard's, the newest of each in its directory.
COMPANIONS = ("slmguard-deps_*_amd64.deb", "slmguard-engine-avx2_*_amd64.deb")


def _newest(directory: Path, pattern: str) -> Path | None:
    found = sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def with_companions(package: Package, model_dir: Path) -> Package:
    """``package`` with slmguard-deps and the engine beside it, and the model's package."""
    wanted = [(package.path.parent, p) for p in COMPANIONS]
    wanted.append((model_dir, "slmguard-model-*_all.deb"))
    found = [_newest(directory, pattern) for directory, pattern in wanted]
    missing = [p for (_, p), f in zip(wanted, found, strict=True) if f is None]
    if missing:
        raise PackageError(
            f"no {', '.join(missing)} beside {package.path} (make dist-amd64 dist-model "
            "dist-previous-amd64)"
        )
    companions = tuple((f, sha256_file(f)) for f in found if f is not None)
    return Package(package.path, package.version, package.sha256, companions)


def _field(path: Path, name: str) -> str:
    done = subprocess.run(
        ["dpkg-deb", "--field", str(path), name], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise PackageError(f"{path}: not a Debian package ({done.stderr.strip()[:200]})")
    return done.stdout.strip()


def read_package(path: Path) -> Package:
    """The package at ``path``, checked to be slmguard for amd64."""
    if not path.is_file():
        raise PackageError(f"{path}: no such package (make dist-amd64 dist-previous-amd64)")
    name, arch = _field(path, "Package"), _field(path, "Architecture")
    if (name, arch) != (NAME, ARCH):
        raise PackageError(f"{path}: {name} for {arch}, need {NAME} for {ARCH}")
    return Package(path, _field(path, "Version"), sha256_file(path))


def older(previous: Package, current: Package) -> bool:
    """Whether dpkg orders ``previous`` before ``current`` (an upgrade, not a reinstall)."""
    done = subprocess.run(
        ["dpkg", "--compare-versions", previous.version, "lt", current.version], check=False
    )
    return done.returncode == 0


def find_packages(dist: Path, version: str) -> tuple[Package, Package]:
    """This tree's package for ``version`` and the newest older one in ``dist/previous``."""
    current = read_package(dist / f"{NAME}_{version}-1_{ARCH}.deb")
    found = [read_package(p) for p in sorted((dist / "previous").glob(f"{NAME}_*_{ARCH}.deb"))]
    candidates = [p for p in found if older(p, current)]
    if not candidates:
        raise PackageError(
            f"no package older than {current.version} in {dist / 'previous'} "
            "(make dist-previous-amd64)"
        )
    newest = candidates[0]
    for p in candidates[1:]:
        if older(newest, p):
            newest = p
    return current, with_companions(newest, dist)
