"""Build slmguard's Debian packages (``make dist``) and the lock they install from.

    python packaging/debbuild.py deb --arch arm64 --version 0.1.0 \\
        --wheel dist/slmguard-0.1.0-py3-none-any.whl \\
        --engine dotprod=DIR --engine armv8=DIR --engine i8mm=DIR --out dist/
    python packaging/debbuild.py lock --wheel dist/slmguard-0.1.0-py3-none-any.whl

``deb`` stages the package tree and runs ``dpkg-deb``:

- ``/usr/lib/slmguard/wheels/``: the project's wheel and every wheel of
  ``packaging/requirements.lock`` for each CPython of ``debcontrol.PYTHONS`` on
  this architecture (``pip download --no-deps`` for the target's interpreter and
  glibc floor, cached in ``~/.cache/slmguard/dist/wheels/<arch>/<python>``), and
  ``requirements.lock``: the lock plus ``slmguard[serve,top]==VERSION``, which
  the postinst installs offline into the venv ``/opt/slmguard``;
- ``/usr/lib/slmguard/engines/<profile>/``: each engine build's ``llama-server``
  and its ``build.json`` (``debcontrol.engine_build_info``; the schema
  ``slmguard.engines`` reads);
- ``/usr/lib/slmguard/{maint.py,pythons,fingerprint}``: the maintainer logic,
  the Python versions the wheels cover, and the stamp of what the venv and the
  engines are built from (the postinst restarts applied units when it changes);
- ``/usr/bin/slmguard`` (a link to the venv's script), the man page, the
  copyright file and the Debian changelog; ``DEBIAN/`` with the control file
  (Depends: python3 of a shipped version, python3-venv, and the engines'
  libraries from their ELF symbol versions), the maintainer scripts and md5sums.

``lock`` resolves ``slmguard[serve,top]`` from the wheel for every Python of
``PYTHONS`` and both architectures and writes ``packaging/requirements.lock``
(run it when a dependency changes in pyproject.toml; the tests check the lock
covers pyproject's pins).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from subprocess import CompletedProcess

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # systest.wheels: the platform tags

import debcontrol  # noqa: E402
from debcontrol import PYTHONS, PackagingError  # noqa: E402
from systest.wheels import guest_platforms  # noqa: E402

from slmguard.default_model import sha256_file  # noqa: E402
from slmguard.engines import BuildInfo  # noqa: E402

LOCK = HERE / "requirements.lock"
DEBIAN = HERE / "debian"
EXTRAS = "serve,top"
LIB = "usr/lib/slmguard"
CACHE = Path.home() / ".cache" / "slmguard" / "dist" / "wheels"
# binutils for each architecture's ELF files (the cross toolchain's for arm64)
OBJCOPY = {"amd64": "objcopy", "arm64": "aarch64-linux-gnu-objcopy"}
SOURCE_DATE_EPOCH = 1767225600  # 2026-01-01: fixed mtimes, the same bytes for the same inputs


def log(message: str) -> None:
    print(f"dist: {message}", file=sys.stderr, flush=True)


def _run(argv: Sequence[str], env: Mapping[str, str] | None = None) -> CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        what = " ".join(map(str, argv[:3]))
        raise PackagingError(f"`{what} ...` failed ({done.returncode}): {tail}")
    return done


# ------------------------------------------------------------------ wheels


def _download_args(python: str, machine: str) -> list[str]:
    abi = "cp" + python.replace(".", "")
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp",
            "--abi", abi]  # fmt: skip
    for tag in guest_platforms(machine, debcontrol.GLIBC_FLOOR_MINOR):
        args += ["--platform", tag]
    return args


def pip(python_exe: str, args: Sequence[str]) -> None:
    _run([python_exe, "-m", "pip", "--disable-pip-version-check", "-q", *args])


def download_wheels(arch: str, python_exe: str, cache: Path = CACHE) -> dict[str, list[Path]]:
    """Every locked wheel per Python version for ``arch``; checks none is missing."""
    machine = debcontrol.DEB_ARCH[arch]
    lock = LOCK.read_text()
    out: dict[str, list[Path]] = {}
    for python in PYTHONS:
        wanted = debcontrol.lock_for(lock, python)
        directory = cache / arch / python
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as req:
            req.write("\n".join(wanted) + "\n")
            req.flush()
            pip(python_exe, ["download", "--no-deps", "-d", str(directory), "-r", req.name,
                             *_download_args(python, machine)])  # fmt: skip
        have = {debcontrol.wheel_name_version(w.name): w for w in directory.glob("*.whl")}
        files = []
        for line in wanted:
            name, version = line.split("==")
            key = (name.lower(), version)
            if key not in have:
                raise PackagingError(f"no {line} wheel for CPython {python} on {arch}")
            files.append(have[key])
        out[python] = files
    return out


def interpreter(python: str) -> str:
    """``pythonX.Y`` on PATH: pip evaluates a requirement's markers (fastapi's differs on
    3.10) for the interpreter it runs in, whatever ``--python-version`` says."""
    found = shutil.which(f"python{python}")
    if found is None:
        raise PackagingError(f"python{python} is not on PATH: `lock` resolves with each CPython")
    return found


def resolve_lock(wheel: Path) -> list[str]:
    """The lock for ``wheel[serve,top]``: one resolution per Python and architecture."""
    resolved: dict[str, dict[str, str]] = {}
    for python in PYTHONS:
        per_arch = []
        for arch in debcontrol.DEB_ARCH:
            with tempfile.TemporaryDirectory() as tmp:
                args = _download_args(python, debcontrol.DEB_ARCH[arch])
                pip(interpreter(python), ["download", "-d", tmp, f"{wheel}[{EXTRAS}]", *args])
                found = dict(debcontrol.wheel_name_version(p.name) for p in Path(tmp).glob("*.whl"))
            found.pop("slmguard", None)
            per_arch.append(found)
        if per_arch[0] != per_arch[1]:
            raise PackagingError(f"CPython {python}: amd64 and arm64 resolve differently")
        resolved[python] = per_arch[0]
    return debcontrol.lock_lines(resolved)


def project_wheel(version: str, out: Path, python_exe: str) -> Path:
    """slmguard's wheel built from this checkout (its tracked and new files, as git lists
    them) as ``version``: the "previous" package the upgrade tests start from."""
    files = _run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"]).stdout
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "src"
        for rel in files.splitlines():
            if (REPO / rel).is_file():
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / rel, tree / rel)
        init = tree / "src/slmguard/__init__.py"  # the one place the version is declared
        text = init.read_text()
        current = next(ln for ln in text.splitlines() if ln.startswith("__version__ = "))
        init.write_text(text.replace(current, f'__version__ = "{version}"', 1))
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)}
        _run([python_exe, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps",
              "-w", str(out), str(tree)], env=env)  # fmt: skip
    return out / f"slmguard-{version}-py3-none-any.whl"


# ------------------------------------------------------------------ engines


def engine_files(arch: str, engines: dict[str, Path]) -> dict[str, tuple[Path, BuildInfo]]:
    """profile -> (its llama-server, its build.json fields) from the build directories."""
    machine = debcontrol.DEB_ARCH[arch]
    out = {}
    for profile, directory in sorted(engines.items()):
        build = debcontrol.parse_build_txt(
            (directory / "BUILD.txt").read_text(), (directory / "VERSION.txt").read_text()
        )
        binary = directory / "bin" / "llama-server"
        if not binary.is_file():
            raise PackagingError(f"{binary}: no engine binary")
        out[profile] = (binary, debcontrol.engine_build_info(profile, machine, build))
    return out


def elf_depends(binary: Path) -> list[str]:
    return debcontrol.shlib_depends(
        debcontrol.parse_version_needs(_run(["readelf", "-V", "--wide", str(binary)]).stdout)
    )


# ------------------------------------------------------------------ the tree


def _write(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(mode)


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=9, mtime=0)


def changelog(version: str) -> str:
    stamp = time.strftime("%a, %d %b %Y %H:%M:%S +0000", time.gmtime(SOURCE_DATE_EPOCH))
    return (
        f"{debcontrol.PACKAGE} ({debcontrol.deb_version(version)}) unstable; urgency=medium\n\n"
        f"  * slmguard {version}, packaged by `make dist` (see README.md).\n\n"
        f" -- {debcontrol.MAINTAINER}  {stamp}\n"
    )


def stage(
    root: Path,
    arch: str,
    version: str,
    wheel: Path,
    wheels: dict[str, list[Path]],
    engines: dict[str, tuple[Path, BuildInfo]],
) -> list[str]:
    """Fill ``root`` with the package tree; return the Depends of its engines."""
    lib = root / LIB
    digests: dict[str, str] = {}
    for path in sorted({wheel, *(w for files in wheels.values() for w in files)}):
        target = lib / "wheels" / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        target.chmod(0o644)
        digests[f"wheels/{path.name}"] = sha256_file(target)
    requirements = [*LOCK.read_text().splitlines(), f"{debcontrol.PACKAGE}[{EXTRAS}]=={version}"]
    _write(lib / "requirements.lock", "\n".join(requirements) + "\n")
    depends: list[list[str]] = []
    for profile, (binary, info) in engines.items():
        target = lib / "engines" / profile / "llama-server"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(binary, target)
        target.chmod(0o755)
        # the compiler's .comment section is of no use on the board (lintian's tag)
        _run([OBJCOPY[arch], "--remove-section=.comment", str(target)])
        text = info.to_json()
        _write(target.parent / "build.json", text)
        digests[f"engines/{profile}/llama-server"] = sha256_file(target)
        digests[f"engines/{profile}/build.json"] = hashlib.sha256(text.encode()).hexdigest()
        depends.append(elf_depends(target))
    digests["requirements.lock"] = sha256_file(lib / "requirements.lock")
    _write(lib / "pythons", "\n".join(PYTHONS) + "\n")
    _write(lib / "fingerprint", debcontrol.fingerprint(digests) + "\n")
    _write(lib / "maint.py", (DEBIAN / "maint.py").read_bytes())
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    (root / "usr/bin/slmguard").symlink_to("/opt/slmguard/bin/slmguard")
    doc = root / "usr/share/doc" / debcontrol.PACKAGE
    _write(doc / "copyright", (DEBIAN / "copyright").read_bytes())
    _write(doc / "changelog.Debian.gz", _gzip(changelog(version).encode()))
    _write(root / "usr/share/man/man1/slmguard.1.gz", _gzip((DEBIAN / "slmguard.1").read_bytes()))
    return debcontrol.merge_depends(*depends)


def _installed_kib(root: Path) -> int:
    total = sum(p.lstat().st_size for p in root.rglob("*") if not p.is_dir())
    return -(-total // 1024)


def _md5sums(root: Path) -> str:
    lines = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not path.is_symlink() and rel.parts[0] != "DEBIAN":
            lines.append(f"{hashlib.md5(path.read_bytes()).hexdigest()}  {rel}")
    return "\n".join(lines) + "\n"


def control_dir(
    root: Path, arch: str, version: str, depends: list[str], profiles: list[str]
) -> None:
    control = root / "DEBIAN"
    deps = debcontrol.merge_depends(debcontrol.PYTHON_DEPENDS, depends)
    text = debcontrol.control_text(version, arch, deps, _installed_kib(root), profiles)
    _write(control / "md5sums", _md5sums(root))
    _write(control / "control", text)
    for script in ("postinst", "prerm", "postrm"):
        _write(control / script, (DEBIAN / script).read_bytes(), 0o755)


def _fix_mtimes(root: Path) -> None:
    for path in [*root.rglob("*"), root]:
        os.utime(path, (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH), follow_symlinks=False)


def build_deb(
    arch: str,
    version: str,
    wheel: Path,
    engines: dict[str, Path],
    out: Path,
    python_exe: str,
    compression: str = "gzip",
) -> Path:
    """``out/slmguard_<version>-1_<arch>.deb`` built from the wheel, the lock and engines."""
    started = time.monotonic()
    log(f"{arch}: wheels for CPython {', '.join(PYTHONS)}")
    wheels = download_wheels(arch, python_exe)
    built = engine_files(arch, engines)
    name = f"{debcontrol.PACKAGE}_{debcontrol.deb_version(version)}_{arch}.deb"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        root = Path(tmp) / "root"
        root.mkdir(mode=0o755)
        root.chmod(0o755)
        depends = stage(root, arch, version, wheel, wheels, built)
        control_dir(root, arch, version, depends, list(built))
        _fix_mtimes(root)
        log(f"{arch}: dpkg-deb ({compression})")
        target = Path(tmp) / name
        env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)}
        _run(["dpkg-deb", "--root-owner-group", f"-Z{compression}", "--build", str(root),
              str(target)], env=env)  # fmt: skip
        final = out / name
        target.replace(final)
    log(f"{final}: {final.stat().st_size / 1e6:.1f} MB in {time.monotonic() - started:.0f} s")
    return final


def lintian(deb: Path) -> list[str]:
    """lintian's tags for ``deb`` (errors make it fail); the tag lines."""
    done = subprocess.run(
        ["lintian", "--no-cfg", "--display-info", "--suppress-tags", "", str(deb)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("E:")]
    if errors or done.returncode not in (0, 1, 2):
        raise PackagingError("lintian: " + " / ".join(errors or [done.stderr.strip()]))
    return lines


# ------------------------------------------------------------------ CLI


def _engine_arg(text: str) -> tuple[str, Path]:
    profile, sep, directory = text.partition("=")
    if not sep or not profile or not directory:
        raise argparse.ArgumentTypeError(f"{text!r}: need PROFILE=DIR")
    return profile, Path(directory)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="packaging/debbuild.py", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    deb = sub.add_parser("deb", help="build one Debian package")
    deb.add_argument("--arch", required=True, choices=sorted(debcontrol.DEB_ARCH))
    deb.add_argument("--version", required=True)
    deb.add_argument("--wheel", required=True, type=Path)
    deb.add_argument("--engine", action="append", type=_engine_arg, required=True)
    deb.add_argument("--out", type=Path, default=REPO / "dist")
    deb.add_argument("--compression", default="gzip", choices=["gzip", "xz", "none"])
    deb.add_argument("--lintian", action="store_true", help="run lintian on the package")
    wheel = sub.add_parser("wheel", help="slmguard's wheel from this checkout as another version")
    wheel.add_argument("--version", required=True)
    wheel.add_argument("--out", type=Path, required=True)
    lock = sub.add_parser("lock", help="write packaging/requirements.lock")
    lock.add_argument("--wheel", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        if args.what == "lock":
            lines = resolve_lock(args.wheel)
            header = "# slmguard[serve,top]'s wheels, per CPython (packaging/debbuild.py lock)\n"
            LOCK.write_text(header + "\n".join(lines) + "\n")
            log(f"{LOCK}: {len(lines)} requirements")
            return 0
        if args.what == "wheel":
            debcontrol.deb_version(args.version)  # a version dpkg takes
            print(project_wheel(args.version, args.out, sys.executable))
            return 0
        path = build_deb(args.arch, args.version, args.wheel, dict(args.engine), args.out,
                         sys.executable, args.compression)  # fmt: skip
        if args.lintian:
            for line in lintian(path):
                log(f"lintian: {line}")
        print(path)
    except PackagingError as err:
        print(f"dist: error: {err.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
