"""serve refuses a plan whose engine needs a backend the binary lacks (``--list-devices``).

Fake binaries (shell scripts printing what llama-server prints) for each answer and
failure, then the real CPU engine with a Vulkan plan through the CLI, as a user meets it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from serveproc import REQUEST_TIMEOUT_S, default_model_path, engine_available
from slmguard.engines import list_devices
from slmguard.errors import ConfigError, EngineUnavailableError
from slmguard.plan.schema import EngineSettings
from slmguard.serve.llamaserver import check_backend, find_llama_server

SLMGUARD = str(Path(sys.executable).with_name("slmguard"))
CPU_ONLY = "Available devices:\n  (none)\n"
LAVAPIPE = (
    "Available devices:\n  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)\n"
)
VULKAN = EngineSettings(
    n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2, n_gpu_layers=19, device="Vulkan0",
    backend="vulkan",
)  # fmt: skip


def engine_devices(binary: Path, timeout_s: float = 10.0) -> tuple[str, ...]:
    """The device names check_backend reads (slmguard.engines' --list-devices reader)."""
    return tuple(d.name for d in list_devices(binary, timeout_s))


def fake_engine(tmp_path: Path, body: str, name: str = "llama-server") -> Path:
    """A script that answers ``--list-devices`` with ``body`` (shell)."""
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\n[ "$1" = --list-devices ] || exit 2\n{body}\n')
    path.chmod(0o755)
    return path


def printing(text: str) -> str:
    return "printf '%s' '" + text.replace("'", "'\\''") + "'"


def test_a_cpu_binary_refuses_a_vulkan_plan_with_what_to_do(tmp_path: Path) -> None:
    binary = fake_engine(tmp_path, printing(CPU_ONLY))
    assert engine_devices(binary) == ()
    with pytest.raises(ConfigError) as err:
        check_backend(binary, VULKAN)
    assert err.value.exit_code == 78
    text = f"{err.value} {err.value.hint}"
    assert str(binary) in text and "the vulkan backend" in text and "no device" in text
    assert "--gpu none" in text and "--llama-server PATH" in text


def test_a_binary_with_the_backend_passes_and_a_missing_device_is_named(tmp_path: Path) -> None:
    binary = fake_engine(tmp_path, printing(LAVAPIPE))
    assert engine_devices(binary) == ("Vulkan0",)
    check_backend(binary, VULKAN)
    check_backend(binary, replace(VULKAN, device=None))  # the binary's default device
    with pytest.raises(ConfigError, match=r"needs device Vulkan1 of the vulkan backend .* Vulkan0"):
        check_backend(binary, replace(VULKAN, device="Vulkan1"))
    with pytest.raises(ConfigError, match="the cuda backend"):
        check_backend(binary, replace(VULKAN, backend="cuda", device="CUDA0"))


def test_each_device_s_backend_is_the_engines_device_record(tmp_path: Path) -> None:
    """A CUDA build (JetPack's on an Orin Nano) passes a CUDA plan and refuses a Vulkan one:
    the backend compared is :class:`slmguard.engines.Device`'s, the name without its index."""
    orin = "Available devices:\n  CUDA0: Orin (7620 MiB, 5100 MiB free)\n"
    binary = fake_engine(tmp_path, printing(orin))
    cuda = replace(VULKAN, backend="cuda", device="CUDA0")
    check_backend(binary, cuda)
    check_backend(binary, replace(cuda, device=None))
    with pytest.raises(ConfigError, match=r"needs the vulkan backend .* lists CUDA0") as err:
        check_backend(binary, VULKAN)
    assert err.value.exit_code == 78


def test_a_cpu_plan_does_not_ask_the_binary(tmp_path: Path) -> None:
    check_backend(tmp_path / "not-there", replace(VULKAN, backend="cpu", n_gpu_layers=0))


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("exit 1", "exited 1: no output"),
        ("echo 'error: invalid argument: --list-devices'", "exited 0: error: invalid argument"),
        ("exec sleep 60", "timed out"),
    ],
)
def test_a_binary_that_does_not_answer_is_69(tmp_path: Path, body: str, needle: str) -> None:
    binary = fake_engine(tmp_path, body)
    with pytest.raises(EngineUnavailableError) as err:
        engine_devices(binary, timeout_s=1.0)
    assert err.value.exit_code == 69
    assert needle in (err.value.hint or "") and str(binary) in str(err.value)


def test_endless_output_is_read_to_the_bound_and_the_child_killed(tmp_path: Path) -> None:
    binary = fake_engine(tmp_path, "echo 'Available devices:'; exec yes '  Vulkan0: x'")
    with pytest.raises(EngineUnavailableError) as err:
        engine_devices(binary, timeout_s=REQUEST_TIMEOUT_S)
    assert "printed more than 64 KiB" in (err.value.hint or "")


def test_hostile_device_lines_are_not_device_names(tmp_path: Path) -> None:
    hostile = "Available devices:\n  ../../x: a\n  Vulkan0;rm -rf: b\n  $(id): c\nVulkan9: d\n"
    binary = fake_engine(tmp_path, printing(hostile))
    assert engine_devices(binary) == ()  # none is indented name-colon-space


@pytest.mark.engine
@pytest.mark.skipif(not engine_available(), reason="the llama-server binary is not there (make)")
def test_the_real_cpu_engine_refuses_a_vulkan_plan_through_the_cli(tmp_path: Path) -> None:
    """The engines `make` builds are CPU builds: serve exits 78 before the model loads."""
    model = default_model_path()
    if not model.exists():
        pytest.skip("default model not prepared (run `slmguard model prepare`)")
    binary = find_llama_server()
    assert engine_devices(binary) == ()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    env.pop("GGML_VK_VISIBLE_DEVICES", None)
    plan = tmp_path / "plan.json"
    planned = subprocess.run(
        [SLMGUARD, "plan", "--model", str(model), "--board", "rpi5-8g", "--gpu", "vulkan",
         "--out", str(plan)],
        capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S, env=env,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    assert '"backend": "vulkan"' in plan.read_text()
    result = subprocess.run(
        [SLMGUARD, "serve", "--plan", str(plan), "--port", "1", "--state-dir",
         str(tmp_path / "state")],
        capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S, env=env,
    )  # fmt: skip
    assert result.returncode == 78, result.stderr
    # The log may say first which engine was chosen and why; the error is one line.
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("slmguard: error:")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("slmguard: error: the plan's engine needs the vulkan backend")
    assert str(binary) in errors[0] and "no device" in errors[0]
    assert "--gpu none" in result.stderr and "Traceback" not in result.stderr
    assert "serving" not in result.stderr  # refused before anything started
