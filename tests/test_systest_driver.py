"""The systest driver's decisions that need no VM: skipping loudly, the wheel platforms."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the systest package

from systest import __main__ as driver
from systest import packages, wheels


@pytest.mark.parametrize(
    ("ci", "code", "word"),
    [("true", 1, "FAILED"), ("", 0, "SKIPPED"), ("false", 0, "SKIPPED")],
)
def test_unfit_host_fails_in_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ci: str,
    code: int,
    word: str,
) -> None:
    monkeypatch.setenv("CI", ci)
    assert driver.unfit("no qemu") == code
    err = capsys.readouterr().err
    assert word in err and "no qemu" in err


def test_not_root_is_unfit_before_touching_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(driver.os, "geteuid", lambda: 1000)
    assert driver.main(["--cache", str(tmp_path / "cache")]) == 1
    assert "needs root" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()


def test_guest_platforms_cover_older_manylinux_and_plain_linux() -> None:
    tags = wheels.guest_platforms()
    assert tags[0] == "manylinux_2_36_x86_64"  # bookworm's glibc
    assert "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert tags[-1] == "linux_x86_64"  # pure wheels built on the host
    assert all(t.endswith("x86_64") for t in tags)


def test_default_engine_dir_needs_the_ok_stamp_and_the_binary(tmp_path: Path) -> None:
    base = tmp_path / ".cache" / "slmguard" / "engine"
    half = base / f"llama-server-{wheels.ENGINE_VERSION}-aaaa"
    (half / "bin").mkdir(parents=True)
    assert wheels.default_engine_dir(tmp_path) is None  # no binary yet
    (half / "bin" / "llama-server").write_bytes(b"")
    assert wheels.default_engine_dir(tmp_path) is None  # still building: no .ok
    (half / ".ok").write_text("")
    assert wheels.default_engine_dir(tmp_path) == half
    arm = base / f"llama-server-{wheels.ENGINE_VERSION}-aarch64-dotprod-bbbb"  # `make arm`, newer
    (arm / "bin").mkdir(parents=True)
    (arm / "bin" / "llama-server").write_bytes(b"")
    (arm / ".ok").write_text("")
    assert wheels.default_engine_dir(tmp_path) == half  # never a cross build for the x86 guest
    assert wheels.engine_binary(half) == half / "bin" / "llama-server"


def _deb(out: Path, name: str, version: str, arch: str = "amd64") -> Path:
    """A tiny real Debian package (dpkg-deb), for what systest/packages.py reads of one."""
    tree = out / f"tree-{name}-{version}-{arch}"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: {arch}\n"
        "Maintainer: t <t@example.org>\nDescription: t\n"
    )
    deb = out / f"{name}_{version}_{arch}.deb"
    subprocess.run(["dpkg-deb", "-Znone", "--build", str(tree), str(deb)], check=True,
                   capture_output=True)  # fmt: skip
    return deb


needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="no dpkg-deb")


@needs_dpkg
def test_find_packages_takes_this_trees_and_the_newest_older_one(tmp_path: Path) -> None:
    current = _deb(tmp_path, "slmguard", "0.1.0-1")
    prev = tmp_path / "previous"
    prev.mkdir()
    for version in ("0.0.9-1", "0.0.99-1", "0.1.0-1", "0.2.0-1"):  # only two are older
        _deb(prev, "slmguard", version)
    with pytest.raises(packages.PackageError, match="no slmguard-deps_"):
        packages.find_packages(tmp_path, "0.1.0")  # the packages that move apart are needed
    deps = _deb(prev, "slmguard-deps", "1+aaaa-1")
    engine = _deb(prev, "slmguard-engine-avx2", "0.3.36+bbbb-1")
    model = _deb(tmp_path, "slmguard-model-m", "1+cccc-1", arch="all")
    got_current, got_previous = packages.find_packages(tmp_path, "0.1.0")
    assert got_current.path == current and got_current.version == "0.1.0-1"
    assert got_previous.version == "0.0.99-1"  # dpkg's order: 0.0.99 > 0.0.9
    assert got_previous.sha256 == hashlib.sha256(got_previous.path.read_bytes()).hexdigest()
    assert [p for p, _ in got_previous.companions] == [deps, engine, model]


@needs_dpkg
def test_find_packages_says_what_is_missing_or_wrong(tmp_path: Path) -> None:
    with pytest.raises(packages.PackageError, match=r"no such package.*make dist-amd64"):
        packages.find_packages(tmp_path, "0.1.0")
    _deb(tmp_path, "slmguard", "0.1.0-1")
    with pytest.raises(packages.PackageError, match=r"no package older than 0\.1\.0-1"):
        packages.find_packages(tmp_path, "0.1.0")
    (tmp_path / "previous").mkdir()
    arm = _deb(tmp_path / "previous", "slmguard", "0.0.99-1", arch="arm64")
    arm.rename(tmp_path / "previous" / "slmguard_0.0.99-1_amd64.deb")  # named amd64, is not
    with pytest.raises(packages.PackageError, match="slmguard for arm64, need slmguard for amd64"):
        packages.find_packages(tmp_path, "0.1.0")
    (tmp_path / "previous" / "slmguard_0.0.99-1_amd64.deb").write_bytes(b"not a package")
    with pytest.raises(packages.PackageError, match="not a Debian package"):
        packages.find_packages(tmp_path, "0.1.0")
