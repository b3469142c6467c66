"""`slmguard top` against the real server: the level changes on screen when the governor
sheds, and the events pane shows an engine kill.

The server is the real ``slmguard serve`` (the console script, the real engine and the
default model) in its own child memory cgroup (tests/realcgroup.py); top is the real
Textual app driven by its pilot and read back from its SVG screen. Shedding is caused
the way the governor tests cause it: the cgroup's limit is lowered to put the working
set at 88 % of it. The kill is a SIGKILL of the engine process that /health names.

They skip only when the engine binary is not there (``make engine``) and, for the shed
test, where no writable memory cgroup can be made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import realcgroup

pytest.importorskip("textual", reason="the top extra (textual) is not installed")

from slmguard.top.app import TopApp
from slmguard.top.client import ServerClient
from slmguard.top.sources import Collector
from test_top_app import screen_text

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SLMGUARD = str(Path(sys.executable).with_name("slmguard"))
START_S = 240.0
WAIT_S = 180.0
ADMIN = "top-live-admin-token"


def engine_binary() -> str | None:
    """llama-server as `slmguard serve` finds it: the venv's link (make engine), else PATH."""
    beside = Path(sys.executable).with_name("llama-server")
    if beside.exists():
        return str(beside)
    return shutil.which("llama-server")


@dataclass
class Live:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    state_dir: Path
    token_file: Path
    cgroup: realcgroup.RealCgroup | None

    def health(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                data: dict[str, Any] = json.loads(resp.read())
                return data
        except urllib.error.HTTPError as err:
            data = json.loads(err.read())
            return data
        except (OSError, ValueError):
            return None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    if engine_binary() is None:
        pytest.skip("the engine binary llama-server is not there (make engine)")
    base = tmp_path_factory.mktemp("top-live")
    token = base / "admin-token"
    token.write_text(ADMIN + "\n")
    port = _free_port()
    argv = [SLMGUARD, "serve", "--port", str(port), "--state-dir", str(base / "state"),
            "--n-ctx", "1024", "--admin-token-file", str(token)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")}
    env.pop("NOTIFY_SOCKET", None)
    with contextlib.ExitStack() as stack:
        cg = None
        if realcgroup.unavailable_reason() is None:
            cg = stack.enter_context(realcgroup.memory_cgroup(4 << 30, prefix="slmguard-toplive"))
            argv = cg.command(argv)
        log = base / "serve.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # fmt: skip
        server = Live(f"http://127.0.0.1:{port}", proc, log, base / "state", token, cg)
        try:
            deadline = time.monotonic() + START_S
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"slmguard serve exited with {proc.returncode}:\n{server.tail()}")
                h = server.health()
                if h is not None and h.get("state") == "ready":
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"slmguard serve never became ready ({h}):\n{server.tail()}")
                time.sleep(0.2)
            yield server
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def _app(server: Live) -> TopApp:
    collector = Collector(
        ServerClient(server.url, admin_token=ADMIN, timeout_s=5.0),
        local=True,
        cgroup_dir=server.cgroup.path if server.cgroup else None,
        state_dir=server.state_dir,
    )
    return TopApp(collector, interval_s=0.5, can_trim=True)


async def _until(
    pilot: Any, app: TopApp, needles: str | tuple[str, ...], what: str, server: Live
) -> str:
    """Wait until any of ``needles`` is on the screen; the screen's text."""
    wanted = (needles,) if isinstance(needles, str) else needles
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    text = ""
    while loop.time() < deadline:
        text = screen_text(app)
        if any(n in text for n in wanted):
            return text
        await pilot.pause(0.25)
    raise AssertionError(
        f"never saw {what} {wanted!r} on:\n{text}\n--- server log:\n{server.tail()}"
    )


async def _until_polled(pilot: Any, app: TopApp, server: Live) -> None:
    """Wait until the app has shown its first snapshot (the panes exist before it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while app.snapshot is None:
        if loop.time() > deadline:
            raise AssertionError(f"top never showed a snapshot\n--- server log:\n{server.tail()}")
        await pilot.pause(0.25)


def _working_set(cg: realcgroup.RealCgroup) -> int:
    usage = "memory.usage_in_bytes" if cg.version == 1 else "memory.current"
    stat = dict(line.split() for line in cg.read("memory.stat").splitlines() if " " in line)
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", "0"))
    return int(cg.read(usage)) - int(inactive)


def _set_limit(cg: realcgroup.RealCgroup, limit_bytes: int) -> None:
    if cg.version == 1:
        (cg.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
    else:
        (cg.path / "memory.max").write_text(str(limit_bytes))


def test_once_against_the_real_server(live: Live) -> None:
    done = subprocess.run(
        [SLMGUARD, "top", "--once", "--json", "--server", live.url, "--admin-token-file",
         str(live.token_file), "--state-dir", str(live.state_dir), "--local",
         *(["--cgroup", str(live.cgroup.path)] if live.cgroup else [])],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    engine = data["server"]["engine"]
    assert engine["state"] == "ready" and engine["pid"]
    assert engine["version"] and engine["version"].startswith("version:")
    assert data["server"]["governor"]["level"] == "normal"
    assert data["server"]["governor"]["source"] == "status"
    if live.cgroup is not None:
        assert data["memory"]["working_set_bytes"] > 100 << 20


def test_level_changes_on_screen_when_the_governor_sheds(live: Live) -> None:
    if live.cgroup is None:
        pytest.skip(realcgroup.unavailable_reason() or "no memory cgroup")
    cg = live.cgroup
    app = _app(live)

    async def main() -> None:
        async with app.run_test(size=(170, 58)) as pilot:
            await _until(pilot, app, "NORMAL", "the governor at normal", live)
            _set_limit(cg, int(_working_set(cg) / 0.88))
            try:
                text = await _until(pilot, app, "governor normal -> ", "the transition", live)
                assert "SHED" in text or "DEGRADE" in text, text
            finally:
                _set_limit(cg, 4 << 30)
            await _until(pilot, app, "-> normal", "the way back to normal", live)

    asyncio.run(main())


def test_engine_kill_shows_in_the_events_pane(live: Live) -> None:
    health = live.health() or {}
    pid = (health.get("engine") or {}).get("pid")
    assert isinstance(pid, int), health
    app = _app(live)

    async def main() -> None:
        async with app.run_test(size=(170, 58)) as pilot:
            await _until_polled(pilot, app, live)
            assert app.snapshot is not None and app.snapshot.server.engine.pid == pid
            os.kill(pid, signal.SIGKILL)
            await _until(pilot, app, "engine restarted (restarts 0 -> 1", "the restart", live)
            # While the engine is down /health names no pid; the pane shows the new one.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT_S
            while True:
                snap = app.snapshot
                new = snap.server.engine.pid if snap is not None else None
                if new is not None and new != pid:
                    break
                assert loop.time() < deadline, f"no new engine pid\n{live.tail()}"
                await pilot.pause(0.25)
            await _until(pilot, app, str(new), "the new pid in the engine pane", live)

    asyncio.run(main())
