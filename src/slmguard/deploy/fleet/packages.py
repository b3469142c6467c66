"""The Debian packages a fleet pins: slmguard, its wheels, each engine, each model, apart.

Owns ``render --package FILE`` for the Ansible target: a file named as
packaging names it (``packaging/debcontrol.py``): ``slmguard_V-1_ARCH.deb``
(the tool; V must be this slmguard), ``slmguard-deps_V_ARCH.deb`` (its
wheels), ``slmguard-engine-PROFILE_V_ARCH.deb`` (one llama-server build),
``slmguard-model-NAME_1+SHA16-1_all.deb`` (one model); each hashed, its sha256
the pin. Which engine a board kind installs (the build of its plan's CPU
profile when it is given, else every engine given for its architecture) and
which model package carries a kind's model (its version names the model's
sha256 prefix). Each package moves on its own: the role copies and installs
only the ones whose pinned version the board does not have.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from slmguard import __version__
from slmguard.deploy.fleet.kinds import BoardPlan
from slmguard.errors import UsageError
from slmguard.plan.boards import PROFILES

#: The Debian revision of the packages packaging builds.
DEBIAN_REVISION = "1"
TOOL = "slmguard"
DEPS = "slmguard-deps"
ENGINE_PREFIX = "slmguard-engine-"
MODEL_PREFIX = "slmguard-model-"
#: Where slmguard-model-NAME installs its GGUF on the board.
MODELS_DIR = "/usr/share/slmguard/models"
_DEB_NAME = re.compile(
    r"(slmguard|slmguard-deps|slmguard-engine-[a-z0-9][a-z0-9.+-]*|slmguard-model-[a-z0-9][a-z0-9.+-]*)"
    r"_([0-9][A-Za-z0-9.+~-]*)_(amd64|arm64|all)\.deb"
)
_MODEL_VERSION = re.compile(r"1\+([0-9a-f]{16})-[0-9]+")
#: The engine build of a board profile's instruction set (``plan.boards`` ``isa``).
ISA_ENGINE = {"x86_avx2": "avx2", "arm_dotprod": "dotprod", "arm_i8mm": "i8mm", "arm_v8": "armv8"}


@dataclass(frozen=True)
class Package:
    """One pinned Debian package: the file on the controller and its identity."""

    path: Path
    name: str
    version: str  # the Debian version, e.g. 0.1.0-1
    arch: str  # amd64, arm64 or all
    sha256: str


def package_file(path: Path) -> Package:
    """A .deb given with ``--package``: named as packaging names it, hashed (UsageError else)."""
    match = _DEB_NAME.fullmatch(path.name)
    if match is None:
        raise UsageError(
            f"--package {path}: not a slmguard package file (slmguard_VERSION_ARCH.deb, "
            "slmguard-deps_..., slmguard-engine-PROFILE_..., slmguard-model-NAME_..._all.deb; "
            "ARCH amd64 or arm64)"
        )
    name, version, arch = match.groups()
    if name == TOOL and version != f"{__version__}-{DEBIAN_REVISION}":
        raise UsageError(
            f"--package {path}: slmguard {version}, but this is slmguard {__version__}: the "
            "board must run the version that renders the role",
            hint=f"give slmguard_{__version__}-{DEBIAN_REVISION}_{arch}.deb",
        )
    if (arch == "all") != name.startswith(MODEL_PREFIX):
        raise UsageError(f"--package {path}: {name} is not built for {arch}")
    if name.startswith(MODEL_PREFIX) and _MODEL_VERSION.fullmatch(version) is None:
        raise UsageError(f"--package {path}: a model package's version is 1+SHA16-1")
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError as err:
        raise UsageError(f"--package {path}: {err.strerror or err}") from err
    return Package(path.resolve(), name, version, arch, digest.hexdigest())


def packages_for(paths: Sequence[Path]) -> tuple[Package, ...]:
    """The ``--package`` files, at most one per package and architecture."""
    packages = tuple(package_file(p) for p in paths)
    keys = [(p.name, p.arch) for p in packages]
    for key in set(keys):
        if keys.count(key) > 1:
            raise UsageError(f"--package: two files of {key[0]} for {key[1]}; give one")
    return packages


def pins(packages: Sequence[Package]) -> dict[str, dict[str, dict[str, str]]]:
    """package -> architecture -> {file, sha256, version}: the group vars' pins."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for p in sorted(packages, key=lambda p: (p.name, p.arch)):
        out.setdefault(p.name, {})[p.arch] = {
            "file": str(p.path),
            "sha256": p.sha256,
            "version": p.version,
        }
    return out


def engines_for(bp: BoardPlan, packages: Sequence[Package]) -> list[str]:
    """The engine packages a board kind installs: its CPU profile's build when it is given,
    else every engine given (``slmguard engine`` picks among them on the board)."""
    given = sorted({p.name for p in packages if p.name.startswith(ENGINE_PREFIX)})
    profile = PROFILES.get(bp.plan.board.name)
    wanted = ENGINE_PREFIX + ISA_ENGINE.get(profile.isa, "") if profile is not None else ""
    return [wanted] if wanted in given else given


def model_package_for(bp: BoardPlan, packages: Sequence[Package]) -> Package | None:
    """The given model package carrying this kind's model (by its sha256 prefix), if any."""
    for p in packages:
        match = _MODEL_VERSION.fullmatch(p.version) if p.name.startswith(MODEL_PREFIX) else None
        if match is not None and bp.model.sha256.startswith(match[1]):
            return p
    return None
