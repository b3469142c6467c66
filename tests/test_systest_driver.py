"""The systest driver's decisions that need no VM: skipping loudly, the wheel platforms."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the systest package

from systest import __main__ as driver
from systest import wheels


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
