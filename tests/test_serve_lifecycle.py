"""Lifecycle of a real server and its engine child: plan file, sd_notify, reconfigure, park."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from serveproc import (
    MODEL_ID,
    REQUEST_TIMEOUT_S,
    ServeFactory,
    default_model_path,
    engine_available,
    scaled,
)
from slmguard.default_model import sha256_file
from slmguard.plan.planfile import dumps_plan
from slmguard.plan.schema import BoardSpec, EngineSettings, Limits, ModelSpec, Plan

if TYPE_CHECKING:
    from slmguard.serve.engine import EngineProcess

pytestmark = pytest.mark.engine

MODEL = default_model_path()


def test_plan_supplies_engine_settings(serve_factory: ServeFactory, tmp_path: Path) -> None:
    plan = Plan(
        model=ModelSpec(
            MODEL_ID,
            "gemma3",
            MODEL.stat().st_size,
            18,
            32768,
            path=str(MODEL),
            sha256=sha256_file(MODEL),
        ),
        board=BoardSpec("test", 4 << 30, (0, 1), (0, 1)),
        engine=EngineSettings(
            n_ctx=384, n_batch=128, n_ubatch=64, n_threads=1, kv_type="q8_0", flash_attn=True
        ),
        limits=Limits(1 << 30, 2 << 30, 1 << 29),
    )
    path = tmp_path / "plan.json"
    path.write_text(dumps_plan(plan))
    # The fixture passes --n-ctx 512: flags beat the plan, the other fields come from it.
    # --no-governor: this test is about engine settings. With the governor, the plan's
    # 1 GiB limit is compared with the working set of this test's memory cgroup, which
    # pytest and whatever else the CI job runs share, and can go critical for reasons
    # unrelated to the server (the governor's plan limits are tested in test_governor_*).
    s = serve_factory("--plan", str(path), "--no-governor")
    health = s.health()
    assert health is not None and health["n_ctx"] == 512  # the flag wins over the plan
    assert "1 threads" in s.log()  # n_threads from the plan
    resp = httpx.post(
        s.url + "/v1/completions",
        json={"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert resp.status_code == 200  # q8_0 KV cache (with flash attention) generates
    assert resp.json()["usage"]["completion_tokens"] == 2
    cmd = Path(f"/proc/{health['engine']['pid']}/cmdline").read_bytes().split(b"\0")
    assert cmd[cmd.index(b"--cache-type-v") + 1] == b"q8_0"
    assert cmd[cmd.index(b"--flash-attn") + 1] == b"on"
    assert cmd[cmd.index(b"--ubatch-size") + 1] == b"64"
    # Sessions are the server's, not the governor's: they work without it.
    resp = httpx.post(
        s.url + "/v1/chat/completions",
        json={"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 1, "session_id": "conv-1"},
        timeout=REQUEST_TIMEOUT_S,
    )  # fmt: skip
    assert resp.status_code == 200, resp.text


def test_no_sessions_refuses_session_id(serve_factory: ServeFactory) -> None:
    s = serve_factory("--no-sessions", "--no-governor")
    resp = httpx.post(
        s.url + "/v1/chat/completions",
        json={"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 1, "session_id": "conv-1"},
        timeout=REQUEST_TIMEOUT_S,
    )  # fmt: skip
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "sessions_unavailable"


def test_sd_notify_and_group_sigterm(serve_factory: ServeFactory, tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sink:
        sink.bind(path)
        sink.settimeout(30)
        s = serve_factory(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}, wait=False)
        seen: list[str] = []
        while not any(m.startswith("READY=1") for m in seen) or "WATCHDOG=1" not in seen:
            seen.append(sink.recv(4096).decode())
        assert s.wait_state("ready")["state"] == "ready"
        ready = next(m for m in seen if m.startswith("READY=1"))
        # The front pings while the engine still loads: a slow load cannot trip WatchdogSec.
        assert seen.index("WATCHDOG=1") < seen.index(ready)
        assert "STATUS=engine ready" in ready
        # systemd stops a service by sending SIGTERM to its whole cgroup (here: group).
        os.killpg(s.proc.pid, signal.SIGTERM)
        assert s.proc.wait(scaled(30)) == 0
        assert "engine exited" not in s.log()  # no restart attempt while draining
        rest = []
        sink.settimeout(2)
        try:
            while True:
                rest.append(sink.recv(4096).decode())
        except TimeoutError:
            pass
        assert any(m.startswith("STOPPING=1") for m in rest)


needs_engine = pytest.mark.skipif(
    not engine_available() or not MODEL.exists(),
    reason="needs the llama-server binary (run `make`) and the default model",
)


def _engine(tmp_path: Path, **changes: object) -> object:
    from slmguard.serve.engine import EngineProcess, RestartPolicy
    from slmguard.serve.llamaserver import EngineConfig, engine_env, find_llama_server

    cfg = EngineConfig(model_path=str(MODEL), n_ctx=512, n_batch=256, n_ubatch=256, n_threads=2)
    policy = changes.pop("policy", RestartPolicy(backoff_initial_s=0.05))
    binary = changes.pop("binary", None) or find_llama_server()
    return EngineProcess(
        binary, cfg, policy, alias=MODEL_ID, env=engine_env(cfg, tmp_path),  # type: ignore[arg-type]
        runtime_dir=Path(tempfile.mkdtemp(prefix="slmguard-test-")), **changes,  # type: ignore[arg-type]
    )  # fmt: skip


def _wrapper(tmp_path: Path, prelude: str) -> Path:
    """An executable ``llama-server`` in ``tmp_path`` that runs ``prelude`` (shell) and then
    the real engine with its arguments: how these tests slow, limit or shadow a start."""
    from slmguard.serve.llamaserver import find_llama_server

    wrapper = tmp_path / "llama-server"
    wrapper.write_text(f'#!/bin/sh\n{prelude}\nexec "{find_llama_server()}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@asynccontextmanager
async def _running(engine: EngineProcess) -> AsyncIterator[EngineProcess]:
    """The engine started and ready; stopped on the way out, and seen stopped."""
    await engine.start()
    try:
        assert await engine.wait_ready(120)
        yield engine
    finally:
        await engine.stop()
    assert engine.state == "stopped"


def _private_bytes(pid: int) -> int:
    from slmguard.host.process import parse_status

    return parse_status(Path(f"/proc/{pid}/status").read_text()).private_bytes


@needs_engine
def test_reconfigure_replaces_the_child_and_frees_its_kv_memory(tmp_path: Path) -> None:
    """The governor's shrink: a new child with a smaller context, not counted as a crash.

    llama.cpp allocates the whole KV cache at load, so the only way to give
    memory back is a smaller context; this checks that the replacement really
    holds less (n_ctx 8192 -> 512 frees about 128 MiB of f16 KV cache for
    Gemma 3 270M with full-size SWA layers).
    """
    from dataclasses import replace

    from slmguard.serve.engine import EngineProcess

    async def main() -> None:
        engine = _engine(tmp_path)
        assert isinstance(engine, EngineProcess)
        engine.config = replace(engine.config, n_ctx=8192)
        async with _running(engine):
            big_pid = engine.pid
            assert big_pid is not None
            big = _private_bytes(big_pid)
            await engine.reconfigure(replace(engine.config, n_ctx=512))
            assert engine.state == "ready" and engine.pid not in (None, big_pid)
            assert engine.restarts == 0 and engine.n_ctx == 512
            assert engine.pid is not None
            small = _private_bytes(engine.pid)
            assert big - small > 100 << 20, (big >> 20, small >> 20)
            assert not Path(f"/proc/{big_pid}").exists()
            status, data = await engine.client.get_json("/slots")
            assert status == 200 and data[0]["n_ctx"] == 512

    asyncio.run(main())


@needs_engine
def test_park_stops_the_engine_without_restarts_and_resume_brings_it_back(
    tmp_path: Path,
) -> None:
    from dataclasses import replace

    from slmguard.serve.engine import EngineProcess, RestartPolicy

    async def main() -> None:
        engine = _engine(tmp_path, policy=RestartPolicy(backoff_initial_s=0.05, max_restarts=1))
        assert isinstance(engine, EngineProcess)
        async with _running(engine):
            old_pid = engine.pid
            assert old_pid is not None
            await engine.park("memory test")
            # Stays down: no restart, no restart budget spent (max_restarts=1
            # would have failed the supervisor on a second crash).
            await asyncio.sleep(1.0)
            assert engine.state == "parked" and engine.pid is None and engine.restarts == 0
            assert not Path(f"/proc/{old_pid}").exists()
            await engine.park("again")  # idempotent
            await engine.resume(replace(engine.config, n_ctx=256))
            assert await engine.wait_ready(120)
            assert engine.n_ctx == 256 and engine.pid not in (None, old_pid)
            assert engine.restarts == 0
            # Park and resume before the supervisor even saw the child exit:
            # still not a crash, and the engine comes back.
            pid = engine.pid
            await engine.park("quick")
            await engine.resume(replace(engine.config, n_ctx=512))
            assert await engine.wait_ready(120)
            assert engine.pid not in (None, pid) and engine.n_ctx == 512
            assert engine.restarts == 0
            # A real crash is one.
            assert engine.pid is not None
            os.kill(engine.pid, signal.SIGKILL)
            assert await _wait(lambda: engine.restarts == 1)
            assert await engine.wait_ready(120)

    asyncio.run(main())


@needs_engine
def test_the_governors_resume_waits_as_long_as_the_supervisor_lets_a_load_run(
    tmp_path: Path,
) -> None:
    """A restart the governor asks for (here a resume) waits as long as the supervisor
    lets a load run, not a bound of its own: in the system test's emulated guest the loads
    after a park took longer than 3 x the first (120 s at the floor), and the governor
    ended each, parked and resumed again nine times without the engine ever serving
    (issue 39). The engine here starts through a wrapper that delays its exec once a flag
    file exists, so the load after the park really takes longer than LOAD_MARGIN x the
    first one, under a floor far below any load: with the old bound the resume raised
    EngineError "did not come back from parking"."""
    from slmguard.serve.control import LOAD_MARGIN, GovernedEngine
    from slmguard.serve.engine import EngineProcess
    from slmguard.serve.flights import Flights
    from slmguard.serve.queue import SlotQueue
    from slmguard.serve.slots import SlotsView

    flag = tmp_path / "slow-start"
    wrapper = _wrapper(tmp_path, f'if [ -f "{flag}" ]; then sleep "$(cat "{flag}")"; fi')

    async def main() -> None:
        engine = _engine(tmp_path, binary=str(wrapper))
        assert isinstance(engine, EngineProcess)
        async with _running(engine):
            first = engine.last_load_s
            assert first is not None and first > 0.001  # the supervisor measured it
            ctl = GovernedEngine(engine, SlotQueue(1, 4), Flights(), SlotsView(engine),
                                 ready_timeout_s=0.001)  # fmt: skip
            assert ctl.ready_bound_s() == engine.load_bound_s() > engine.load_timeout_s
            delay = math.ceil(LOAD_MARGIN * first) + 1
            assert delay + first < engine.load_timeout_s  # the supervisor allows the load
            flag.write_text(f"{delay}\n")
            await ctl.park("test: the board is short of memory")
            await ctl.resume(engine.config.n_ctx)
            assert engine.state == "ready" and engine.restarts == 0
            assert engine.last_load_s is not None and engine.last_load_s > LOAD_MARGIN * first

    asyncio.run(main())


@needs_engine
def test_a_start_the_system_refuses_is_retried_and_the_supervisor_lives_on(
    tmp_path: Path,
) -> None:
    """In the system test's VM (issue 39, the neighbour series' run 4) the kernel refused the
    engine's restart (a fork under strict overcommit, the commit at 97 % of CommitLimit):
    the exception ended the supervisor's task, and nothing started the engine again: 20
    minutes of 503 engine_loading and no llama-server in the service's cgroup. Here a start
    is refused for real: the engine's binary is gone when the supervisor restarts it after
    a SIGKILL. Without the fix the supervisor's task ends with FileNotFoundError and the
    engine never comes back once the binary is back."""
    from slmguard.serve.engine import EngineProcess, RestartPolicy

    wrapper = tmp_path / "llama-server"

    def install() -> None:
        _wrapper(tmp_path, "")

    async def main() -> None:
        install()
        policy = RestartPolicy(backoff_initial_s=0.05, backoff_max_s=0.2, max_restarts=50)
        engine = _engine(tmp_path, binary=str(wrapper), policy=policy)
        assert isinstance(engine, EngineProcess)
        async with _running(engine):
            pid = engine.pid
            assert pid is not None
            wrapper.unlink()
            os.killpg(pid, signal.SIGKILL)  # a crash; its restart finds no binary
            assert await _wait(lambda: engine.spawn_failures >= 2, scaled(60)), "two refused starts"
            assert engine._task is not None and not engine._task.done()
            assert engine.state in ("restarting", "loading")
            install()
            assert await engine.wait_ready(scaled(120))
            assert engine.pid != pid and engine.restarts >= 3

    asyncio.run(main())


@needs_engine
def test_a_supervisor_that_raises_fails_the_engine_instead_of_hiding(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever else could end the supervisor's task (a bug of ours, an error no branch
    expects) must not leave a model that says "loading" with nothing to start it, as the
    neighbour series' runs 4 and 5 did with no trace in the journal: the engine is failed
    (the server's on_failed exits for systemd), the error is logged with its traceback,
    the child it left is killed, and stop() still returns. Here the restart after a real
    SIGKILL raises an error no code path handles."""
    from slmguard.serve.engine import EngineProcess, RestartPolicy
    from slmguard.serve.llamaserver import EngineConfig, find_llama_server

    class Broken(EngineProcess):
        spawns = 0

        async def _spawn(self) -> asyncio.subprocess.Process:
            self.spawns += 1
            if self.spawns > 1:
                raise RuntimeError("a fault no branch handles")
            return await super()._spawn()

    failed: list[str] = []

    async def main() -> None:
        engine = Broken(
            find_llama_server(),
            EngineConfig(model_path=str(MODEL), n_ctx=512, n_batch=256, n_ubatch=256, n_threads=2),
            RestartPolicy(backoff_initial_s=0.05),
            alias=MODEL_ID,
            runtime_dir=Path(tempfile.mkdtemp(prefix="slmguard-test-")),
            on_failed=lambda: failed.append("failed"),
        )
        await engine.start()
        try:
            assert await engine.wait_ready(scaled(120))
            pid = engine.pid
            assert pid is not None
            os.killpg(pid, signal.SIGKILL)
            deadline = asyncio.get_running_loop().time() + scaled(60)
            while engine.state != "failed":
                assert asyncio.get_running_loop().time() < deadline, engine.state
                await asyncio.sleep(0.05)
            assert failed == ["failed"] and engine.pid is None
        finally:
            await engine.stop()
        assert engine.state == "failed"

    with caplog.at_level(logging.ERROR, logger="slmguard.serve.engine"):
        asyncio.run(main())
    ended = [r for r in caplog.records if "supervisor stopped" in r.getMessage()]
    assert ended and ended[0].exc_info is not None
    assert "a fault no branch handles" in ended[0].getMessage()


#: The front of the lost-exit test, run as its own process: uvloop's close waits forever
#: on the handle of a child whose exit libuv never saw, so the script leaves by os._exit.
_LOST_EXIT_FRONT = """
import asyncio, os, sys, tempfile, threading, time
from pathlib import Path
import uvloop
from slmguard.serve.engine import LOST_EXIT_S, EngineProcess, RestartPolicy
from slmguard.serve.llamaserver import EngineConfig, find_llama_server

async def main():
    cfg = EngineConfig(model_path=sys.argv[1], n_ctx=512, n_batch=256, n_ubatch=256,
                       n_threads=2)
    e = EngineProcess(find_llama_server(), cfg, RestartPolicy(backoff_initial_s=0.05),
                      alias="m", runtime_dir=Path(tempfile.mkdtemp()))
    bound = float(sys.argv[2])
    await e.start()
    try:
        assert await e.wait_ready(bound)
        for _ in range(3):  # the thread must collect the status before libuv does
            pid, got = e.pid, []
            def collect(pid=pid, got=got):
                try:
                    got.append(os.waitpid(pid, 0))
                except ChildProcessError as err:
                    got.append(err)
            thread = threading.Thread(target=collect, daemon=True)
            thread.start()
            await asyncio.sleep(0.2)
            await e.park("memory at critical")
            time.sleep(1.0)  # the loop busy: the thread's waitpid wins
            thread.join(bound)
            if isinstance(got[0], tuple):
                break
            await e.resume()  # libuv won this time: the exit was reported
            assert await e.wait_ready(bound)
        else:
            print("SKIP libuv collected the status first three times", flush=True)
            return
        deadline = time.monotonic() + LOST_EXIT_S + bound
        while e.pid is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        print("TAKEN", e.pid is None, e.lost_exits, e.state, flush=True)
        await e.resume()
        print("BACK", await e.wait_ready(bound), e.pid != pid, e.restarts, flush=True)
    finally:
        await e.stop()

uvloop.new_event_loop().run_until_complete(main())
os._exit(0)
"""


@needs_engine
def test_an_exit_the_event_loop_never_reports_does_not_strand_the_engine(
    tmp_path: Path,
) -> None:
    """The neighbour series' failed runs (issue 39) all ended alike: the governor parked an
    engine that was loading, and its supervisor never went on past the child's end;
    every resume after that only flipped the state to "loading", with no engine started
    again. Here the exit is lost for real, on uvloop (the server's loop): a thread
    collects the killed child's status while the event loop is busy, so libuv's own
    waitpid finds nothing and never reports it. The supervisor takes a child the kernel
    shows gone as exited after LOST_EXIT_S (logged, counted) and the resume brings a new
    engine; without that the engine stays parked with its old pid forever."""
    import subprocess
    import sys

    script = tmp_path / "front.py"
    script.write_text(_LOST_EXIT_FRONT)
    done = subprocess.run(
        [sys.executable, str(script), str(MODEL), str(scaled(60))],
        capture_output=True, text=True, timeout=scaled(400), check=False,
    )  # fmt: skip
    if "SKIP" in done.stdout:
        pytest.skip(done.stdout.strip())
    assert "TAKEN True 1 parked" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "BACK True True 0" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "not reported in 10 s: taken as exited" in done.stderr


@needs_engine
def test_output_a_stray_process_holds_does_not_strand_the_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The other way the supervisor could wait forever after a park: the child's output
    never ends because another process still holds the write end of its pipe (here a
    process the engine's wrapper starts in its own session, which the park's kill of
    the engine's process group does not reach). On uvloop the exit is reported but the
    output never ends; the supervisor stops reading it after LOST_EXIT_S (logged) and
    the resume brings a new engine; without that, every resume only flipped the state
    to "loading". (On asyncio's own loop, Python 3.11's Process.wait() also waits for
    the pipes, so there the exit is the report that never comes: the test above.)"""
    import uvloop

    from slmguard.serve.engine import LOST_EXIT_S, EngineProcess

    holder = tmp_path / "holder.pid"
    wrapper = _wrapper(
        tmp_path, f"[ -e {holder} ] || setsid sh -c 'echo $$ > {holder}; exec sleep 600' &"
    )

    async def main() -> None:
        engine = _engine(tmp_path, binary=str(wrapper))
        assert isinstance(engine, EngineProcess)
        async with _running(engine):
            first = engine.pid
            await engine.park("memory at critical")
            deadline = asyncio.get_running_loop().time() + scaled(LOST_EXIT_S + 30)
            while engine.pid is not None:
                assert asyncio.get_running_loop().time() < deadline, "still reading"
                await asyncio.sleep(0.1)
            await engine.resume()
            assert await engine.wait_ready(scaled(120))
            assert engine.pid not in (None, first)

    try:
        with caplog.at_level(logging.WARNING, logger="slmguard.serve.engine"):
            uvloop.run(main())  # the server's loop: it reports the exit, the pipe stays open
        assert "did not end with it" in caplog.text
    finally:
        if holder.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(holder.read_text()), signal.SIGKILL)


@needs_engine
def test_a_load_the_system_refuses_memory_is_retried_not_given_up(tmp_path: Path) -> None:
    """The fifth neighbour series' run 1 (issue 39): memory short during the context
    shrink's reload, the engine's loads aborted one after the other ("insufficient
    memory", as ggml says under the commit limit) until the restart budget was spent,
    and the whole service restarted. A model that has loaded on this board before and
    is refused memory now is retried with its backoff without spending the budget.
    Here the refusal is real: the engine's wrapper gives it a 150 MB address space
    while a flag file exists; the budget is 2 restarts. The engine's environment is the
    server's: its aborts fork no debugger (a gdb under that limit looped and held the
    aborting engine "loading" past this test's bound, about one run in five beside two
    hogs)."""
    from slmguard.serve.engine import EngineProcess, RestartPolicy

    flag = tmp_path / "short"
    wrapper = _wrapper(tmp_path, f"ulimit -c 0; [ -e {flag} ] && ulimit -v 150000")

    async def main() -> None:
        policy = RestartPolicy(backoff_initial_s=0.05, backoff_max_s=0.5, max_restarts=2)
        engine = _engine(tmp_path, binary=str(wrapper), policy=policy)
        assert isinstance(engine, EngineProcess)
        async with _running(engine):
            first = engine.pid
            assert first is not None
            flag.touch()
            engine.signal_child(signal.SIGKILL)  # a crash; every load after it is refused
            assert await _wait(lambda: engine.memory_refusals >= 4, scaled(120)), engine.tail
            assert engine.state in ("restarting", "loading")
            aborts = [ln for ln in engine.tail if "GGML_ASSERT" in ln or "terminate" in ln]
            traced = [ln for ln in engine.tail if "Backtrace" in ln or "LWP" in ln or "(+0x" in ln]
            assert aborts and not traced, list(engine.tail)
            flag.unlink()
            assert await engine.wait_ready(scaled(120))
            assert engine.pid != first and engine.restarts >= 5

    asyncio.run(main())


@needs_engine
def test_parking_during_a_reconfigure_keeps_the_engine_down(tmp_path: Path) -> None:
    """The governor parks the engine while it loads a new context (memory reached
    critical mid-reload): the reconfigure ends with an error at once instead of
    waiting out the load timeout, the engine stays parked (no restart, no budget
    spent, no "loading" flicker), and resume brings it back with its own settings."""
    from dataclasses import replace

    from slmguard.errors import EngineError
    from slmguard.serve.engine import EngineProcess, RestartPolicy

    async def main() -> None:
        engine = _engine(tmp_path, policy=RestartPolicy(backoff_initial_s=0.05, max_restarts=1))
        assert isinstance(engine, EngineProcess)
        async with _running(engine):
            states: list[str] = []
            engine.on_state = states.append
            first = engine.pid
            assert not engine.exited_on_purpose(first)
            reload = asyncio.create_task(engine.reconfigure(replace(engine.config, n_ctx=256)))
            assert await _wait(lambda: engine.state == "loading")
            await engine.park("memory at critical during the reload")
            with pytest.raises(EngineError, match="parked while starting"):
                await asyncio.wait_for(reload, 30)
            await asyncio.sleep(1.0)
            assert engine.state == "parked" and engine.pid is None and engine.restarts == 0
            assert states[states.index("parked") :] == ["parked"], states
            await engine.resume(replace(engine.config, n_ctx=512))
            assert await engine.wait_ready(120)
            assert engine.n_ctx == 512 and engine.restarts == 0
            # The crash memory's question: the server stopped the first child itself...
            assert engine.exited_on_purpose(first)
            # ...but not one that dies by itself.
            crashed = engine.pid
            assert engine.signal_child(signal.SIGKILL)
            assert await _wait(lambda: engine.pid != crashed and engine.state == "ready")
            assert not engine.exited_on_purpose(crashed) and engine.restarts == 1

    asyncio.run(main())


@needs_engine
def test_the_engine_dies_with_the_front(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a front killed with SIGKILL takes its engine child with it."""
    import subprocess
    import sys
    import time

    script = tmp_path / "front.py"
    script.write_text(
        "import asyncio, sys, tempfile\n"
        "from pathlib import Path\n"
        "from slmguard.serve.engine import EngineProcess, RestartPolicy\n"
        "from slmguard.serve.llamaserver import EngineConfig, find_llama_server\n"
        "async def main():\n"
        f"    cfg = EngineConfig(model_path={str(MODEL)!r}, n_ctx=256, n_batch=256,\n"
        "                       n_ubatch=256, n_threads=1)\n"
        "    e = EngineProcess(find_llama_server(), cfg, RestartPolicy(), alias='m',\n"
        "                      runtime_dir=Path(tempfile.mkdtemp()))\n"
        "    await e.start()\n"
        "    assert await e.wait_ready(120)\n"
        "    print(e.pid, flush=True)\n"
        "    await asyncio.sleep(600)\n"
        "asyncio.run(main())\n"
    )
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert front.stdout is not None
        engine_pid = int(front.stdout.readline())
        assert Path(f"/proc/{engine_pid}").exists()
        front.kill()
        front.wait(scaled(30))
        deadline = time.monotonic() + 30
        while Path(f"/proc/{engine_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{engine_pid}").exists()
    finally:
        front.kill()
        front.wait(30)
        if front.stdout is not None:
            front.stdout.close()


async def _wait(cond: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
