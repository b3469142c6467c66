"""serve with offload on a real Vulkan build, on lavapipe (Mesa's CPU Vulkan driver).

Run on purpose by ``make gpu-test`` (it names the build in
``SLMGUARD_TEST_VULKAN_SERVER``; `make gpu-engine` builds it, about 45 minutes here),
never by ``make test``: without that variable, or without the binary it names, every
test here is skipped with the reason. The real engine and the real model: a plan that
offloads (a GPU board's preset; ``plan --gpu-layers N``), ``serve --plan`` with
``--llama-server`` the Vulkan build, ``GGML_VK_VISIBLE_DEVICES=0`` (llama.cpp skips a
CPU-type Vulkan device otherwise). Checked: ``/health`` ready, a real completion and a
real chat answered 200, the engine's command line carrying the plan's
``--n-gpu-layers``/``--device``/``--no-kv-offload``, and the device memory reported as
what it is here: lavapipe's device memory is the engine's own anonymous memory (a
``malloc`` per ``vkAllocateMemory``), charged to its cgroup, so the plan gives it no
allowance outside the cgroup and the governor counts no device source (its working set
already holds it); the live engine has no DMA-BUF or DRM fd to count.

Lavapipe is slow (well under a token per second of prompt with every layer offloaded
on this loaded 2-core machine): prompts are a few tokens, answers two tokens, and the
waits are generous bounds (``scaled``), never timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from serveproc import (
    MODEL_ID,
    REQUEST_TIMEOUT_S,
    SLMGUARD,
    ServerProcess,
    default_model_path,
    scaled,
    start_server,
)

VULKAN_ENV = "SLMGUARD_TEST_VULKAN_SERVER"
LAVAPIPE = {"GGML_VK_VISIBLE_DEVICES": "0"}
#: Loading on lavapipe compiles the Vulkan pipelines: minutes on a loaded machine.
READY_TIMEOUT_S = 900.0


def vulkan_server() -> Path:
    """The Vulkan build ``make gpu-test`` names; the test is skipped without one."""
    given = os.environ.get(VULKAN_ENV)
    if not given:
        pytest.skip(f"run by `make gpu-test` ({VULKAN_ENV} names the Vulkan llama-server)")
    path = Path(given)
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.skip(f"the Vulkan build is absent: {path} (`make gpu-engine` builds it)")
    return path


# A module's first test waits for its server's start (the pipelines' compilation): more
# than pytest's default bound of 600 s on a busy machine.
pytestmark = [
    pytest.mark.engine, pytest.mark.gpu, pytest.mark.slow,
    pytest.mark.timeout(scaled(READY_TIMEOUT_S) + REQUEST_TIMEOUT_S * 2),
]  # fmt: skip


def plan_file(tmp: Path, *args: str) -> tuple[Path, dict[str, Any]]:
    model = default_model_path()
    if not model.exists():
        pytest.skip("default model not prepared (`make model`)")
    out = tmp / "plan.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")}
    done = subprocess.run(
        [SLMGUARD, "plan", "--model", str(model), "--ctx", "512", *args, "--out", str(out)],
        capture_output=True, text=True, timeout=scaled(120), env={**env, **LAVAPIPE},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan: dict[str, Any] = json.loads(out.read_text())
    return out, plan


def served(tmp: Path, plan: Path) -> ServerProcess:
    binary = vulkan_server()
    srv = start_server(
        tmp,
        ["--plan", str(plan), "--llama-server", str(binary), "--ctx", "512", "--n-threads", "2"],
        env=LAVAPIPE,
        wait=False,
    )
    try:
        srv.wait_state("ready", timeout_s=scaled(READY_TIMEOUT_S))
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict]]:
    """A GPU board's preset plan: the Pi 5 with Vulkan, every layer and the KV on it."""
    vulkan_server()
    tmp = tmp_path_factory.mktemp("gpu-preset")
    path, plan = plan_file(tmp, "--board", "rpi5-8g", "--gpu", "vulkan")
    srv = served(tmp, path)
    try:
        yield srv, plan
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def partial(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict]]:
    """This host planned with lavapipe as its GPU: 9 layers, the KV kept on the host."""
    vulkan_server()
    tmp = tmp_path_factory.mktemp("gpu-partial")
    path, plan = plan_file(
        tmp, "--board", "auto", "--gpu", "vulkan", "--gpu-layers", "9", "--no-kv-offload"
    )
    srv = served(tmp, path)
    try:
        yield srv, plan
    finally:
        srv.stop()


def post(srv: ServerProcess, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        srv.url + path, data=json.dumps({"model": MODEL_ID, **body}).encode(),
        headers={"Content-Type": "application/json", **srv.headers()}, method="POST",
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        return resp.status, json.loads(resp.read())


def get(srv: ServerProcess, path: str) -> dict[str, Any]:
    req = urllib.request.Request(srv.url + path, headers=srv.headers())
    with urllib.request.urlopen(req, timeout=scaled(30)) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def engine_argv(srv: ServerProcess) -> list[str]:
    pid = srv.engine_pid()
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def check_engine_flags(srv: ServerProcess, plan: dict[str, Any]) -> list[str]:
    eng = plan["engine"]
    argv = engine_argv(srv)
    assert Path(argv[0]).resolve() == vulkan_server().resolve()
    assert flag(argv, "--n-gpu-layers") == str(eng["n_gpu_layers"])
    assert flag(argv, "--device") == eng["device"] == "Vulkan0"
    assert ("--no-kv-offload" in argv) is (not eng["kv_offload"])
    health = get(srv, "/health")
    assert health["engine"]["binary"] == argv[0]
    offload = health["engine"]["offload"]
    assert offload == {"backend": "vulkan", "device": "Vulkan0",
                       "n_gpu_layers": eng["n_gpu_layers"],
                       "kv_offload": eng["kv_offload"]}  # fmt: skip
    return argv


def check_device_memory_is_the_engines_own(srv: ServerProcess, plan: dict[str, Any]) -> None:
    """No allowance outside the cgroup and no device source counted apart, and rightly:
    the live engine holds no DMA-BUF and no DRM fd (lavapipe's buffers are its own
    anonymous memory, already in the working set the governor reads)."""
    from slmguard.host.devmem import read_device_memory

    assert plan["limits"]["device_bytes"] == 0
    gov = get(srv, "/api/v1/governor")
    assert gov["device_allowance_bytes"] == 0
    assert gov["signal"]["device_source"] is None and gov["signal"]["device_bytes"] == 0
    mem = read_device_memory(Path("/"), srv.engine_pid())
    assert mem is not None and mem.problems == ()
    assert (mem.dmabuf_bytes, mem.drm, mem.outside_cgroup_bytes) == (0, (), 0)
    assert get(srv, "/health")["memory"]["engine_rss_anon_bytes"] > 0


def test_a_board_preset_offloads_every_layer_and_answers(
    preset: tuple[ServerProcess, dict[str, Any]],
) -> None:
    srv, plan = preset
    eng = plan["engine"]
    assert eng["backend"] == "vulkan" and eng["kv_offload"] is True
    assert eng["n_gpu_layers"] == plan["model"]["n_layer"] + 1  # the output layer too
    check_engine_flags(srv, plan)
    status, body = post(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    assert body["choices"][0]["text"] != ""
    check_device_memory_is_the_engines_own(srv, plan)


def test_gpu_layers_with_the_kv_on_the_host_answer_a_chat(
    partial: tuple[ServerProcess, dict[str, Any]],
) -> None:
    srv, plan = partial
    eng = plan["engine"]
    assert (eng["n_gpu_layers"], eng["kv_offload"], eng["backend"]) == (9, False, "vulkan")
    argv = check_engine_flags(srv, plan)
    assert "--no-kv-offload" in argv
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    status, body = post(srv, "/v1/chat/completions", chat)
    assert status == 200 and body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] >= 1
    check_device_memory_is_the_engines_own(srv, plan)
