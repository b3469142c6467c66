"""slmguard.engines: the builds installed, the one chosen for a CPU and why, the probe.

The package's builds are described by the table the package is built from
(``packaging/debcontrol.py``: the features each -march lets the compiler use),
and chosen for the CPUs of the captured boards (``tests/fixtures/boards``). The
probe runs the real engine and the default model (``engine`` marker); its
failure paths run small executables that fail the way broken builds do.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from enginebuilds import AVX2_FLAGS, avx2_info
from hostboards import copy_board
from slmguard.engines import (
    BUILD_JSON,
    BUILD_SCHEMA,
    PACKAGE,
    PATH,
    VENV,
    BuildInfo,
    EngineBuild,
    check_start,
    engine_version,
    has_grammar_bound,
    installed_builds,
    list_devices,
    parse_build_info,
    parse_devices,
    probe,
    select,
)
from slmguard.errors import ConfigError, EngineUnavailableError
from slmguard.host.cpufeatures import CpuFeatures, read_cpu_features

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packaging"))
import debcontrol

ARM_PROFILES = {
    "armv8": "armv8-a",
    "dotprod": "armv8.2-a+dotprod+fp16",
    "i8mm": "armv8.6-a+dotprod+fp16+i8mm",
}


def arm_info(profile: str) -> BuildInfo:
    march = ARM_PROFILES[profile]
    return BuildInfo(
        profile, "aarch64", debcontrol.MARCH_FEATURES[march], "0c1e570", ("cpu",),
        ("-DGGML_NATIVE=OFF", f"-DGGML_CPU_ARM_ARCH={march}"),
    )  # fmt: skip


def package_builds(*infos: BuildInfo) -> list[EngineBuild]:
    return [EngineBuild(Path(f"/usr/lib/slmguard/engines/{i.profile}/llama-server"), PACKAGE, i)
            for i in infos]  # fmt: skip


ALL_ARM = package_builds(*(arm_info(p) for p in ARM_PROFILES))


@pytest.mark.parametrize(
    ("board", "chosen"),
    [
        ("rk3588-rock5b", "dotprod"),
        ("jetson-orin-nano-devkit", "dotprod"),
        ("rpi5", "dotprod"),
        ("rpi4-aarch64", "armv8"),
    ],
)
def test_each_board_gets_its_profile(tmp_path: Path, board: str, chosen: str) -> None:
    cpu = read_cpu_features(copy_board(board, tmp_path))
    selection = select(ALL_ARM, cpu)
    assert selection.chosen is not None and selection.chosen.name == chosen
    assert selection.reason.startswith(f"{chosen}: this CPU has all")
    verdicts = {v.build.name: v for v in selection.verdicts}
    assert not verdicts["i8mm"].fits and "i8mm" in verdicts["i8mm"].reason
    assert verdicts["armv8"].fits


def test_an_armv86_cpu_gets_i8mm_over_the_others() -> None:
    cpu = CpuFeatures("aarch64", frozenset(debcontrol.MARCH_FEATURES[ARM_PROFILES["i8mm"]]), "t")
    selection = select(ALL_ARM, cpu)
    assert selection.chosen is not None and selection.chosen.name == "i8mm"
    assert "preferred over dotprod, armv8" in selection.reason


def test_the_reason_names_the_missing_features() -> None:
    cpu = CpuFeatures("aarch64", frozenset({"fp", "asimd", "asimddp"}), "t")
    verdicts = {v.build.name: v for v in select(ALL_ARM, cpu).verdicts}
    assert verdicts["dotprod"].reason.startswith("needs crc32, atomics, asimdrdm, fphp, asimdhp")


def test_x86_avx2_and_a_cpu_without_it() -> None:
    builds = package_builds(avx2_info())
    with_avx2 = CpuFeatures("x86_64", frozenset(avx2_info().cpu_features) | {"avx512f"}, "t")
    assert select(builds, with_avx2).chosen == builds[0]
    old = CpuFeatures("x86_64", frozenset(debcontrol.x86_features(())), "t")
    selection = select(builds, old)
    assert selection.chosen is None
    assert "needs avx, avx2, fma, f16c, which this CPU lacks" in selection.reason
    with pytest.raises(EngineUnavailableError) as err:
        _ = selection.binary
    assert err.value.exit_code == 69 and "--llama-server PATH" in (err.value.hint or "")


def test_another_architecture_never_fits() -> None:
    cpu = CpuFeatures("x86_64", frozenset(debcontrol.x86_features(AVX2_FLAGS)), "t")
    selection = select(ALL_ARM, cpu)
    assert selection.chosen is None
    assert all(v.reason == "built for aarch64, this CPU is x86_64" for v in selection.verdicts)


def test_undescribed_builds_come_after_every_fitting_package_build() -> None:
    venv = EngineBuild(Path("/venv/bin/llama-server"), VENV)
    on_path = EngineBuild(Path("/usr/local/bin/llama-server"), PATH)
    cpu = CpuFeatures("aarch64", frozenset({"fp", "asimd"}), "t")
    assert select([on_path, venv, *ALL_ARM], cpu).chosen is ALL_ARM[0]  # armv8
    none_fit = CpuFeatures("aarch64", frozenset(), "t")
    chosen = select([on_path, venv, *ALL_ARM], none_fit)
    assert chosen.chosen is venv and "records no CPU needs" in chosen.reason
    assert select([on_path], none_fit).chosen is on_path


def test_a_backend_the_build_lacks() -> None:
    cpu = CpuFeatures("aarch64", frozenset(debcontrol.MARCH_FEATURES["armv8-a"]), "t")
    selection = select(ALL_ARM, cpu, backend="vulkan")
    assert selection.chosen is None
    assert "has the cpu backend(s), not vulkan" in selection.verdicts[0].reason


def test_nothing_installed() -> None:
    selection = select([], CpuFeatures("aarch64", frozenset(), "t"))
    assert selection.chosen is None and selection.reason.startswith("no llama-server is installed")


# ------------------------------------------------------------------ build.json


def test_build_json_round_trip() -> None:
    info = arm_info("dotprod")
    assert parse_build_info(info.to_json(), "x") == info
    assert json.loads(info.to_json())["schema"] == BUILD_SCHEMA


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"schema": "other/1"}, "not a slmguard.engine-build/1 file"),
        ({"profile": "../../etc"}, "profile"),
        ({"profile": ""}, "profile"),
        ({"arch": "x" * 201}, "arch"),
        ({"cpu_features": "asimddp"}, "cpu_features"),
        ({"cpu_features": ["asimddp"] * 65}, "cpu_features"),
        ({"cpu_features": ["as imddp"]}, "cpu_features[0]"),
        ({"backends": [1]}, "backends[0]"),
        ({"cmake_flags": ["-DX=\x1b[2J"]}, "cmake_flags[0]"),
        ({"llama_cpp": None}, "llama_cpp"),
    ],
)
def test_hostile_build_json_is_refused_naming_the_field(
    change: dict[str, object], field: str
) -> None:
    data = {**json.loads(arm_info("dotprod").to_json()), **change}
    with pytest.raises(ConfigError) as err:
        parse_build_info(json.dumps(data), "build.json")
    assert field in err.value.message


def test_not_json() -> None:
    with pytest.raises(ConfigError, match="not JSON"):
        parse_build_info("{", "b")


# ------------------------------------------------------------------ listing


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_installed_builds_lists_the_package_the_venv_and_path(tmp_path: Path) -> None:
    pkg = tmp_path / "engines"
    for profile in ("dotprod", "armv8"):
        _executable(pkg / profile / "llama-server")
        (pkg / profile / BUILD_JSON).write_text(arm_info(profile).to_json())
    _executable(pkg / "broken" / "llama-server")  # no build.json
    (pkg / "wrongname").mkdir()
    (pkg / "wrongname" / BUILD_JSON).write_text(arm_info("i8mm").to_json())
    _executable(pkg / "wrongname" / "llama-server")
    (pkg / "notexec").mkdir()
    (pkg / "notexec" / BUILD_JSON).write_text(
        json.dumps({**json.loads(arm_info("armv8").to_json()), "profile": "notexec"})
    )
    (pkg / "notexec" / "llama-server").write_text("")
    venv = _executable(tmp_path / "venv" / "llama-server")
    on_path = _executable(tmp_path / "bin" / "llama-server")
    builds = installed_builds(pkg, beside=venv.parent, search_path=str(on_path.parent))
    got = {(b.source, b.binary.parent.name): b for b in builds}
    assert list(got) == [
        (PACKAGE, "armv8"), (PACKAGE, "broken"), (PACKAGE, "dotprod"), (PACKAGE, "notexec"),
        (PACKAGE, "wrongname"), (VENV, "venv"), (PATH, "bin"),
    ]  # fmt: skip
    assert got[(PACKAGE, "armv8")].problem is None
    assert "build.json" in (got[(PACKAGE, "broken")].problem or "")
    assert "says profile 'i8mm'" in (got[(PACKAGE, "wrongname")].problem or "")
    assert got[(PACKAGE, "notexec")].problem == "not executable"
    cpu = CpuFeatures("aarch64", frozenset(debcontrol.MARCH_FEATURES[ARM_PROFILES["i8mm"]]), "t")
    assert select(builds, cpu).chosen == got[(PACKAGE, "dotprod")]


def test_a_binary_found_twice_is_listed_once(tmp_path: Path) -> None:
    venv = _executable(tmp_path / "venv" / "llama-server")
    builds = installed_builds(tmp_path / "none", beside=venv.parent, search_path=str(venv.parent))
    assert [b.source for b in builds] == [VENV]


# ------------------------------------------------------------------ probing


def test_parse_devices() -> None:
    text = (
        "load_backend: loaded CPU backend\nAvailable devices:\n"
        "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (7945 MiB, 7945 MiB free)\n"
        "  CUDA0: Orin (7620 MiB, 5000 MiB free)\n"
        "  bad name: x\n"
    )
    devices = parse_devices(text)
    assert [(d.name, d.backend) for d in devices] == [("Vulkan0", "vulkan"), ("CUDA0", "cuda")]
    assert parse_devices("Available devices:\n  (none)\n") == ()
    assert parse_devices("garbage") == ()


def test_failing_binaries_are_69_with_their_last_line(tmp_path: Path) -> None:
    dies = _executable(tmp_path / "dies", "#!/bin/sh\necho 'illegal instruction' >&2\nexit 132\n")
    with pytest.raises(EngineUnavailableError) as err:
        engine_version(dies)
    assert "exited 132: illegal instruction" in (err.value.hint or "")
    no_devices = _executable(tmp_path / "nodev", "#!/bin/sh\necho 'version: 1 (build 1)'\n")
    assert engine_version(no_devices) == "version: 1 (build 1)"
    with pytest.raises(EngineUnavailableError) as err:
        list_devices(no_devices)
    assert "--list-devices` exited 0" in (err.value.hint or "")
    with pytest.raises(EngineUnavailableError) as err:
        probe(tmp_path / "missing")
    assert "no such file" in (err.value.hint or "")


def test_a_flood_of_output_is_read_to_its_bound(tmp_path: Path) -> None:
    loud = _executable(
        tmp_path / "loud", "#!/bin/sh\necho 'version: 1'\nhead -c 3000000 /dev/zero | tr '\\0' x\n"
    )
    assert engine_version(loud) == "version: 1"


def test_a_build_that_dies_when_it_loads_the_model_fails_the_start(tmp_path: Path) -> None:
    crash = _executable(
        tmp_path / "crash",
        "#!/bin/sh\necho 'load_tensors: loading model'\necho 'Illegal instruction' >&2\nexit 132\n",
    )
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    result = check_start(crash, model, threads=1, timeout_s=30)
    assert not result.ok
    assert result.detail.startswith("exited with status 132 before it was ready")
    assert "Illegal instruction" in result.detail


def test_a_build_that_never_gets_ready_times_out(tmp_path: Path) -> None:
    hang = _executable(tmp_path / "hang", "#!/bin/sh\nexec sleep 600\n")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    result = check_start(hang, model, threads=1, timeout_s=1)
    assert not result.ok and result.detail.startswith("not ready before the time limit")


@pytest.mark.engine
def test_probe_of_the_real_engine() -> None:
    from serveproc import default_model_path
    from slmguard.host.cpu import usable_threads

    binary = Path(sys.executable).parent / "llama-server"
    model = default_model_path()
    if not model.is_file():
        pytest.skip(f"no default model at {model} (make model)")
    result = probe(binary, model, threads=usable_threads(), timeout_s=600)
    assert result.version.startswith("version: ") and "0c1e570" in result.version
    assert result.backends[0] == "cpu"
    assert result.start is not None and result.start.ok, result.start.detail
    assert os.path.exists(binary)


@pytest.mark.parametrize(
    ("help_text", "bounded"),
    [
        ("--grammar GRAMMAR   BNF-like grammar\n--grammar-max-work N   steps of parse-stack "
         "work (default: 20000000)\n", True),
        ("-gmw, --grammar-max-work N   steps\n", True),
        ("--grammar GRAMMAR   BNF-like grammar\n--grammar-file FNAME   file\n", False),
        ("--grammar GRAMMAR   see --grammar-max-work in a newer build\n", False),
        ("--grammar-max-workers N\n", False),
        ("", False),
    ],
)  # fmt: skip
def test_the_grammar_bound_is_an_option_the_help_lists(help_text: str, bounded: bool) -> None:
    assert has_grammar_bound(help_text) is bounded
