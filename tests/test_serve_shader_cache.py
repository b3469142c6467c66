"""A Vulkan engine's shader cache: serve gives the engine a persistent, private one.

Mesa's drivers keep compiled pipelines in ``~/.cache/mesa_shader_cache``, which a
sandboxed service cannot write, so every start there compiled them again (76-98 MiB more
heap on lavapipe, benchmarks/RESULTS.md). ``engine_env`` points ``MESA_SHADER_CACHE_DIR``
at ``<state dir>/shader-cache`` for a Vulkan engine, and the supervisor starts the child
with it. Pure checks of the variables and the directory, then a fake engine (a shell
script writing its environment) started by the real supervisor.
"""

from __future__ import annotations

import asyncio
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from serveproc import scaled
from slmguard.serve.engine import EngineProcess, RestartPolicy
from slmguard.serve.llamaserver import (
    ABORT_ENV,
    MESA_CACHE_ENV,
    SHADER_CACHE_DIR,
    EngineConfig,
    engine_env,
    shader_cache_dir,
)

CPU = EngineConfig(model_path="/m/model.gguf", n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2)
VULKAN = replace(CPU, n_gpu_layers=19, device="Vulkan0", backend="vulkan")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_vulkan_engine_gets_a_private_cache_under_the_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    old = os.umask(0o277)  # a umask that would leave a new directory 0500
    try:
        env = engine_env(VULKAN, state, environ={"HOME": "/"})
    finally:
        os.umask(old)
    cache = state / SHADER_CACHE_DIR
    assert env == {**ABORT_ENV, "MESA_SHADER_CACHE_DIR": str(cache)}
    assert cache.is_dir() and not cache.is_symlink()
    assert _mode(cache) == 0o700


def test_a_cpu_engine_gets_no_cache_and_nothing_is_made(tmp_path: Path) -> None:
    assert engine_env(CPU, tmp_path / "state", environ={}) == ABORT_ENV
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("name", MESA_CACHE_ENV)
def test_the_operators_cache_settings_are_left_alone(tmp_path: Path, name: str) -> None:
    assert engine_env(VULKAN, tmp_path, environ={name: "true"}) == ABORT_ENV
    assert not (tmp_path / SHADER_CACHE_DIR).exists()


def test_an_existing_cache_is_used_as_it_is_never_chmoded(tmp_path: Path) -> None:
    cache = tmp_path / SHADER_CACHE_DIR
    cache.mkdir()
    os.chmod(cache, 0o750)  # the operator's choice
    assert shader_cache_dir(tmp_path) == cache
    assert _mode(cache) == 0o750


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_cache_path_that_is_not_a_directory_is_not_used(tmp_path: Path, kind: str) -> None:
    cache = tmp_path / SHADER_CACHE_DIR
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chmod(elsewhere, 0o755)
    if kind == "symlink":
        cache.symlink_to(elsewhere)
    else:
        cache.write_text("")
    assert engine_env(VULKAN, tmp_path, environ={}) == ABORT_ENV
    assert _mode(elsewhere) == 0o755  # the link's target was not touched


def test_a_state_dir_that_cannot_be_made_leaves_the_engine_as_mesa_would_start_it(
    tmp_path: Path,
) -> None:
    """Not a directory (a file in its place: refused even to root, unlike a 0500 one)."""
    state = tmp_path / "state"
    state.write_text("")
    assert engine_env(VULKAN, state, environ={}) == ABORT_ENV
    assert state.read_text() == ""


def test_the_supervisor_starts_the_child_with_the_cache_variable(tmp_path: Path) -> None:
    """The real EngineProcess, a fake engine that writes its environment and exits."""
    out = tmp_path / "env.txt"
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!/bin/sh\nenv > {out}\nexit 1\n")
    fake.chmod(0o755)
    extra = engine_env(VULKAN, tmp_path / "state", environ={})

    async def main() -> None:
        engine = EngineProcess(
            fake, VULKAN, RestartPolicy(), alias="m", runtime_dir=tmp_path / "run", env=extra
        )
        await engine.start()
        try:
            assert not await engine.wait_ready(scaled(60))  # it exits before it is ready
        finally:
            await engine.stop()

    asyncio.run(main())
    lines = out.read_text().splitlines()
    assert f"MESA_SHADER_CACHE_DIR={tmp_path / 'state' / SHADER_CACHE_DIR}" in lines
    assert f"PATH={os.environ['PATH']}" in lines  # the front's environment, not replaced
