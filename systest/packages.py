"""The Debian packages the guest installs: the previous one in the image, this tree's in the share.

Owns finding and checking the two amd64 packages ``make dist-amd64`` and
``make dist-previous-amd64`` build: ``dist/slmguard_<version>-1_amd64.deb`` (this
tree) and ``dist/previous/slmguard_<older>-1_amd64.deb`` (the same tree built as
an older version: there is no earlier release to upgrade from). The image installs
the previous package (``dpkg -i``, offline: its postinst builds the venv from the
wheels it ships); the scenario's ``package-upgrade`` step installs this tree's
over it, with the deployment applied and serving, and every later step runs
from it. Each package's sha256 is part of the image key.
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
    return current, newest
