"""``slmguard engine`` through the real CLI: the builds, the choice and why, --check.

The package directory is built in ``tmp_path`` with the real engine (the one
``make`` built) as its ``avx2`` build, described by the build.json the package
builder writes (``packaging/debcontrol.py``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from enginebuilds import AVX2_FLAGS, avx2_info
from serveproc import default_model_path
from slmguard.engines import BUILD_JSON
from waiting import scaled

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packaging"))
import debcontrol

SLMGUARD = str(Path(sys.executable).with_name("slmguard"))
ENGINE = Path(sys.executable).with_name("llama-server")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SLMGUARD, "engine", *args],
        capture_output=True,
        text=True,
        timeout=scaled(900),
        check=False,
    )


def package_dir(tmp_path: Path, features: tuple[str, ...]) -> Path:
    build = tmp_path / "engines" / "avx2"
    build.mkdir(parents=True)
    shutil.copy2(ENGINE, build / "llama-server")  # a copy: a link would be make's build again
    (build / BUILD_JSON).write_text(avx2_info(features).to_json())
    return build.parent


needs_x86 = pytest.mark.skipif(
    not ENGINE.exists() or debcontrol.DEB_ARCH["amd64"] != "x86_64", reason="no make engine"
)


@needs_x86
def test_the_package_build_is_chosen_over_makes_and_says_why(tmp_path: Path) -> None:
    engines = package_dir(tmp_path, debcontrol.x86_features(AVX2_FLAGS))
    done = run("--engines-dir", str(engines))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("CPU: x86_64, ") and "/proc/cpuinfo flags" in lines[0]
    assert any(ln.startswith("* avx2     package ") for ln in lines)
    assert f"chosen: {engines / 'avx2' / 'llama-server'}" in lines
    assert "why: avx2: this CPU has all 10 features it needs" in done.stdout
    assert "preferred over venv" in done.stdout
    data = json.loads(run("--engines-dir", str(engines), "--json").stdout)
    assert data["chosen"] == str(engines / "avx2" / "llama-server")
    assert [b["source"] for b in data["builds"]] == ["package", "venv"]
    assert data["builds"][0]["build"]["cpu_features"][-1] == "f16c"


@needs_x86
def test_a_build_this_cpu_cannot_run_is_passed_over(tmp_path: Path) -> None:
    engines = package_dir(tmp_path, ("avx2", "no_such_feature"))
    data = json.loads(run("--engines-dir", str(engines), "--json").stdout)
    assert data["builds"][0]["fits"] is False
    assert data["builds"][0]["reason"] == "needs no_such_feature, which this CPU lacks"
    assert data["chosen"] == str(ENGINE)


def test_nothing_fits_is_69_with_the_reasons(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from slmguard.cli import main; main()", "engine",
         "--engines-dir", str(tmp_path), "--backend", "vulkan"],
        capture_output=True, text=True, timeout=scaled(120), check=False,
        env={"PATH": str(tmp_path)},
    )  # fmt: skip
    # The venv's build is beside this Python: with --backend vulkan it still counts (its
    # backends are not recorded), so only a Python without one gets 69.
    if ENGINE.exists():
        assert done.returncode == 0 and "records no CPU needs" in done.stdout
    else:
        assert done.returncode == 69 and "no llama-server is installed" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "m.gguf"], "--model and --no-start go with --check PATH"),
        (["--no-start"], "--model and --no-start go with --check PATH"),
        (["--check", "/bin/sh", "--timeout", "0"], "--timeout 0.0: need 1-3600 seconds"),
    ],
)
def test_usage_errors_are_64(args: list[str], message: str) -> None:
    done = run(*args)
    assert done.returncode == 64 and message in done.stderr


def test_check_of_a_binary_that_is_not_llama_server_is_69(tmp_path: Path) -> None:
    done = run("--check", "/bin/true", "--no-start")
    assert done.returncode == 69
    assert "`--version` exited 0" in done.stderr
    done = run("--check", str(tmp_path / "missing"), "--no-start")
    assert done.returncode == 69 and "no such file" in done.stderr


def test_check_with_a_model_that_is_not_gguf_is_65(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model\n")
    done = run("--check", str(ENGINE), "--model", str(bad))
    assert done.returncode == 65 and "bad.gguf" in done.stderr
    done = run("--check", str(ENGINE), "--model", str(tmp_path / "none.gguf"))
    assert done.returncode == 66


@pytest.mark.engine
def test_check_of_the_real_engine_starts_it() -> None:
    model = default_model_path()
    if not model.is_file():
        pytest.skip(f"no default model at {model} (make model)")
    done = run("--check", str(ENGINE), "--model", str(model), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["version"].startswith("version: ") and data["backends"] == ["cpu"]
    assert data["start"]["ok"] is True and "decoded one token" in data["start"]["detail"]
    text = run("--check", str(ENGINE), "--no-start").stdout
    assert "backends: cpu" in text and "start: not checked (--no-start)" in text


@pytest.mark.engine
def test_check_of_a_build_that_crashes_at_load_is_69(tmp_path: Path) -> None:
    crash = tmp_path / "llama-server"
    crash.write_text(
        "#!/bin/sh\ncase \"$1\" in\n--version) echo 'version: 9 (build 9)';;\n"
        "--list-devices) echo 'Available devices:'; echo '  (none)';;\n"
        "*) echo 'Illegal instruction' >&2; exit 132;;\nesac\n"
    )
    crash.chmod(0o755)
    model = default_model_path()
    if not model.is_file():
        pytest.skip(f"no default model at {model} (make model)")
    done = run("--check", str(crash), "--model", str(model))
    assert done.returncode == 69
    assert "start: FAILED" in done.stdout and "exited with status 132" in done.stdout
    assert "it did not start: exited with status 132" in done.stderr


@needs_x86
def test_whether_a_build_bounds_grammars_is_read_from_its_help(tmp_path: Path) -> None:
    # slmguard's build carries engine/grammar-max-work.patch; a board's own build of the
    # same llama.cpp does not. Told from the binary's --help, not its name or version: the
    # same binary behind a wrapper that hides the option counts as a build without it.
    text = run("--check", str(ENGINE), "--no-start").stdout
    assert "grammar bound: yes" in text
    foreign = tmp_path / "llama-server"
    foreign.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = --help ] && {{ "{ENGINE}" --help | grep -v -- --grammar-max-work; exit 0; }}\n'
        f'exec "{ENGINE}" "$@"\n'
    )
    foreign.chmod(0o755)
    data = json.loads(run("--check", str(foreign), "--no-start", "--json").stdout)
    assert data["grammar_bound"] is False
    assert (
        "grammar bound: no (a build without slmguard's engine patch"
        in run("--check", str(foreign), "--no-start").stdout
    )
    listing = json.loads(run("--engines-dir", str(tmp_path / "none"), "--json").stdout)
    assert listing["chosen"] == str(ENGINE) and listing["grammar_bound"] is True
