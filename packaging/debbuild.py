"""Build slmguard's Debian packages (``make dist``) and the lock they install from.

    python packaging/debbuild.py deb --arch arm64 --version 0.1.0 \\
        --wheel dist/slmguard-0.1.0-py3-none-any.whl \\
        --engine dotprod=DIR --engine armv8=DIR --engine i8mm=DIR --out dist/
    python packaging/debbuild.py model --model gemma-3-270m-q4_k_m.gguf --out dist/
    python packaging/debbuild.py lock --wheel dist/slmguard-0.1.0-py3-none-any.whl

``deb`` stages each package's tree and runs ``dpkg-deb``; the packages move
separately (issue 43; what each is and how its version is made:
``debcontrol``'s docstring):

- ``slmguard_<version>-1_<arch>.deb``: ``/usr/lib/slmguard/wheels/`` the
  project's wheel alone; ``requirements.lock`` (the lock without the model's
  wheels, plus ``slmguard==VERSION``), which the postinst installs offline into
  the venv ``/opt/slmguard`` from these wheels and slmguard-deps'; ``maint.py``,
  ``pythons``, ``fingerprint`` (what the venv is built from: this package's
  files and slmguard-deps' version); ``/usr/bin/slmguard``, the man page, the
  copyright file and the changelog. Depends: python3 of a shipped version,
  python3-venv, ``slmguard-deps (= its version)``; Recommends an engine.
- ``slmguard-deps_1+<lock hash>-1_<arch>.deb``: ``/usr/lib/slmguard-deps/wheels/``,
  every wheel of ``packaging/requirements.lock`` but the model's, for each
  CPython of ``debcontrol.PYTHONS`` (``pip download --no-deps`` for the
  target's interpreter and glibc floor, cached in
  ``~/.cache/slmguard/dist/wheels/<arch>/<python>``).
- ``slmguard-engine-<profile>_<llama version>+b<binary hash>-1_<arch>.deb``, one
  per engine build: ``/usr/lib/slmguard/engines/<profile>/`` its
  ``llama-server`` and ``build.json`` (``debcontrol.engine_build_info``); Depends
  from the binary's ELF symbol versions; its postinst restarts the applied
  units (``maint.py restart``).
- ``model --model FILE``: ``slmguard-model-<name>_1+<sha256 prefix>-1_all.deb``:
  ``/usr/share/slmguard/models/<file>``, its ``.sha256``, and
  ``by-sha256/<sha256>``, a link to it.

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
#: llama.cpp as the pinned llama-cpp-python vendors it (the Makefile's LLAMA_VERSION): the
#: engine packages' version, with the binary's own hash (never the Makefile's cache key).
LLAMA_VERSION = "0.3.36"


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
    lock = debcontrol.lock_without_model(LOCK.read_text())  # the model is a package of its own
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


def changelog(package: str, deb_version: str) -> str:
    stamp = time.strftime("%a, %d %b %Y %H:%M:%S +0000", time.gmtime(SOURCE_DATE_EPOCH))
    return (
        f"{package} ({deb_version}) unstable; urgency=medium\n\n"
        "  * Packaged by `make dist` (see README.md).\n\n"
        f" -- {debcontrol.MAINTAINER}  {stamp}\n"
    )


def _copy(source: Path, target: Path, mode: int = 0o644) -> str:
    """``source`` as ``target``; its sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    target.chmod(mode)
    return sha256_file(target)


def _doc(root: Path, package: str, version: str, copyright_text: bytes | None = None) -> None:
    doc = root / "usr/share/doc" / package
    _write(doc / "copyright", copyright_text or (DEBIAN / "copyright").read_bytes())
    _write(doc / "changelog.Debian.gz", _gzip(changelog(package, version).encode()))


def stage_tool(root: Path, version: str, wheel: Path, deps_version: str) -> None:
    """``slmguard``: its own wheel, the lock (without the model), the maintainer logic."""
    lib = root / LIB
    digests = {f"wheels/{wheel.name}": _copy(wheel, lib / "wheels" / wheel.name)}
    lock = debcontrol.lock_without_model(LOCK.read_text())
    _write(lib / "requirements.lock", lock + f"{debcontrol.PACKAGE}=={version}\n")
    digests["requirements.lock"] = sha256_file(lib / "requirements.lock")
    digests["deps"] = hashlib.sha256(deps_version.encode()).hexdigest()
    _write(lib / "pythons", "\n".join(PYTHONS) + "\n")
    _write(lib / "fingerprint", debcontrol.fingerprint(digests) + "\n")
    _write(lib / "maint.py", (DEBIAN / "maint.py").read_bytes())
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    (root / "usr/bin/slmguard").symlink_to("/opt/slmguard/bin/slmguard")
    _doc(root, debcontrol.PACKAGE, debcontrol.deb_version(version))
    _write(root / "usr/share/man/man1/slmguard.1.gz", _gzip((DEBIAN / "slmguard.1").read_bytes()))


def stage_deps(root: Path, wheels: dict[str, list[Path]], version: str) -> None:
    """``slmguard-deps``: every locked wheel (the lock without the model's), each Python."""
    lib = root / debcontrol.DEPS_LIB
    digests = {}
    for path in sorted({w for files in wheels.values() for w in files}):
        digests[f"wheels/{path.name}"] = _copy(path, lib / "wheels" / path.name)
    _write(lib / "fingerprint", debcontrol.fingerprint(digests) + "\n")
    _doc(root, debcontrol.DEPS_PACKAGE, version)


def stage_engine(root: Path, arch: str, profile: str, binary: Path, info: BuildInfo) -> str:
    """``slmguard-engine-PROFILE``: the binary (its .comment section dropped) and its
    build.json; the binary's sha256."""
    target = root / LIB / "engines" / profile / "llama-server"
    _copy(binary, target, 0o755)
    # the compiler's .comment section is of no use on the board (lintian's tag)
    _run([OBJCOPY[arch], "--remove-section=.comment", str(target)])
    _write(target.parent / "build.json", info.to_json())
    return sha256_file(target)


MODEL_COPYRIGHT = (
    "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
    "Upstream-Name: {name}\n"
    "Comment: The model file as given to `make dist-model` (DIST_MODEL=); this package\n"
    " only carries it to the boards.\n"
    "\n"
    "Files: *\n"
    "Copyright: the model's publisher, as the model's own terms say\n"
    "License: other\n"
    " The model's weights are under their publisher's terms, which travel with the\n"
    " file (for the default model: Gemma's terms of use).\n"
)


def stage_model(root: Path, model: Path) -> str:
    """``slmguard-model-NAME``: the GGUF and its sha256 beside it; the sha256."""
    target = root / debcontrol.MODELS_DIR / model.name
    digest = _copy(model, target)
    _write(target.with_name(model.name + ".sha256"), f"{digest}  {model.name}\n")
    # by its sha256 too: the fleet role names the model by the plan's digest alone
    link = target.parent / "by-sha256" / digest
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(f"../{model.name}")
    name = debcontrol.MODEL_PREFIX + debcontrol.model_slug(model.name)
    _doc(root, name, debcontrol.model_version(digest), MODEL_COPYRIGHT.format(name=name).encode())
    return digest


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


def _fix_mtimes(root: Path) -> None:
    for path in [*root.rglob("*"), root]:
        os.utime(path, (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH), follow_symlinks=False)


def _control(root: Path, text: str, scripts: Mapping[str, str]) -> None:
    """``DEBIAN/``: control, md5sums and the maintainer scripts (``name: file in debian/``)."""
    _write(root / "DEBIAN" / "md5sums", _md5sums(root))
    _write(root / "DEBIAN" / "control", text)
    for script, source in scripts.items():
        _write(root / "DEBIAN" / script, (DEBIAN / source).read_bytes(), 0o755)


def _dpkg_deb(root: Path, target: Path, compression: str) -> Path:
    _fix_mtimes(root)
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)}
    tmp = target.with_name(target.name + ".tmp")
    _run(["dpkg-deb", "--root-owner-group", f"-Z{compression}", "--build", str(root),
          str(tmp)], env=env)  # fmt: skip
    tmp.replace(target)
    log(f"{target.name}: {target.stat().st_size / 1e6:.1f} MB")
    return target


def _fresh(work: Path, name: str) -> Path:
    root = work / name
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    return root


TOOL_SCRIPTS = {"postinst": "postinst", "prerm": "prerm", "postrm": "postrm"}
ENGINE_SCRIPTS = {"postinst": "engine.postinst"}


def _engine_deb(
    work: Path, out: Path, arch: str, profile: str, built: tuple[Path, BuildInfo], compression: str
) -> Path:
    root = _fresh(work, f"engine-{profile}")
    digest = stage_engine(root, arch, profile, *built)
    ver = debcontrol.engine_version(LLAMA_VERSION, digest)
    _doc(root, debcontrol.ENGINE_PREFIX + profile, ver)
    deps = elf_depends(root / LIB / "engines" / profile / "llama-server")
    _control(root, debcontrol.engine_control(profile, ver, arch, deps, _installed_kib(root)),
             ENGINE_SCRIPTS)  # fmt: skip
    return _dpkg_deb(
        root, out / f"{debcontrol.ENGINE_PREFIX}{profile}_{ver}_{arch}.deb", compression
    )


def build_model_deb(model: Path, out: Path, compression: str = "gzip") -> Path:
    """``out/slmguard-model-NAME_1+SHA16-1_all.deb`` of the GGUF ``model``."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        return _model_deb(Path(tmp), out, model, compression)


def _model_deb(work: Path, out: Path, model: Path, compression: str) -> Path:
    root = _fresh(work, "model")
    digest = stage_model(root, model)
    _control(root, debcontrol.model_control(model.name, digest, _installed_kib(root)), {})
    slug, ver = debcontrol.model_slug(model.name), debcontrol.model_version(digest)
    return _dpkg_deb(root, out / f"{debcontrol.MODEL_PREFIX}{slug}_{ver}_all.deb", compression)


def build_debs(
    arch: str,
    version: str,
    wheel: Path,
    engines: dict[str, Path],
    out: Path,
    python_exe: str,
    compression: str = "gzip",
) -> list[Path]:
    """The packages in ``out``: slmguard, slmguard-deps and each engine's for ``arch`` (see
    debcontrol's docstring)."""
    started = time.monotonic()
    log(f"{arch}: wheels for CPython {', '.join(PYTHONS)}")
    wheels = download_wheels(arch, python_exe)
    built = engine_files(arch, engines)
    deps_ver = debcontrol.deps_version(debcontrol.lock_without_model(LOCK.read_text()))
    out.mkdir(parents=True, exist_ok=True)
    made = []
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        work = Path(tmp)
        root = _fresh(work, "deps")
        stage_deps(root, wheels, deps_ver)
        _control(root, debcontrol.deps_control(deps_ver, arch, _installed_kib(root)), {})
        name = f"{debcontrol.DEPS_PACKAGE}_{deps_ver}_{arch}.deb"
        made.append(_dpkg_deb(root, out / name, compression))
        for profile, files in built.items():
            made.append(_engine_deb(work, out, arch, profile, files, compression))
        root = _fresh(work, "tool")
        stage_tool(root, version, wheel, deps_ver)
        depends = [*debcontrol.PYTHON_DEPENDS, f"{debcontrol.DEPS_PACKAGE} (= {deps_ver})"]
        text = debcontrol.control_text(version, arch, depends, _installed_kib(root), list(built))
        _control(root, text, TOOL_SCRIPTS)
        name = f"{debcontrol.PACKAGE}_{debcontrol.deb_version(version)}_{arch}.deb"
        made.append(_dpkg_deb(root, out / name, compression))
    log(f"{arch}: {len(made)} packages in {time.monotonic() - started:.0f} s")
    return made


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
    deb = sub.add_parser("deb", help="build the Debian packages of one architecture")
    deb.add_argument("--arch", required=True, choices=sorted(debcontrol.DEB_ARCH))
    deb.add_argument("--version", required=True)
    deb.add_argument("--wheel", required=True, type=Path)
    deb.add_argument("--engine", action="append", type=_engine_arg, required=True)
    deb.add_argument("--out", type=Path, default=REPO / "dist")
    deb.add_argument("--compression", default="gzip", choices=["gzip", "xz", "none"])
    deb.add_argument("--lintian", action="store_true", help="run lintian on the packages")
    model = sub.add_parser("model", help="build slmguard-model-NAME of one GGUF")
    model.add_argument("--model", required=True, type=Path)
    model.add_argument("--out", type=Path, default=REPO / "dist")
    model.add_argument("--compression", default="gzip", choices=["gzip", "xz", "none"])
    model.add_argument("--lintian", action="store_true", help="run lintian on the package")
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
        if args.what == "model":
            paths = [build_model_deb(args.model.resolve(), args.out, args.compression)]
        else:
            paths = build_debs(args.arch, args.version, args.wheel, dict(args.engine), args.out,
                               sys.executable, args.compression)  # fmt: skip
        for path in paths:
            if args.lintian:
                for line in lintian(path):
                    log(f"lintian: {path.name}: {line}")
            print(path)
    except PackagingError as err:
        print(f"dist: error: {err.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
