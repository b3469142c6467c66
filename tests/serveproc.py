"""A real ``slmguard serve`` on a free loopback port, for tests (see conftest.py).

The server is started the way a user starts it (the ``slmguard`` console
script in a subprocess) with the real engine and the default model, and torn
down reliably (SIGTERM, then SIGKILL of the whole process group after a grace
period), even when a test fails or kills the worker.

- ``serve_factory``: start servers with extra arguments; each stops at teardown.
- ``server``: one shared server for the session (n_ctx 512, small queue), for
  tests that do not disturb it. Tests that kill or reconfigure the worker must
  use ``serve_factory``.

Tests using these fixtures need the ``engine`` marker; they are skipped (with
the reason) when the llama-server binary is not there (``make`` builds it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

SLMGUARD = str(Path(sys.executable).with_name("slmguard"))
MODEL_ID = "gemma-3-270m-q4_k_m"
# Waits scale with the machine: CI and slow boards raise SLMGUARD_TEST_TIME_FACTOR.
TIME_FACTOR = max(1.0, float(os.environ.get("SLMGUARD_TEST_TIME_FACTOR", "1") or 1))
START_TIMEOUT_S = 120.0 * TIME_FACTOR
#: A client timeout for requests that generate: a loaded 2-core machine decodes a
#: token a second at worst (measured while six test suites ran beside it).
REQUEST_TIMEOUT_S = 300.0 * TIME_FACTOR


def scaled(seconds: float) -> float:
    """A wait bound for this machine (see TIME_FACTOR)."""
    return seconds * TIME_FACTOR


def default_model_path() -> Path:
    """Where ``slmguard model prepare`` put the default model (root or user paths)."""
    from slmguard import paths

    return paths.model_dir() / "gemma-3-270m-q4_k_m.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_available() -> bool:
    from slmguard.errors import EngineUnavailableError
    from slmguard.serve.llamaserver import find_llama_server

    try:
        find_llama_server()
    except EngineUnavailableError:
        return False
    return True


@dataclass
class ServerProcess:
    """One running ``slmguard serve``; ``url`` is ``http://127.0.0.1:PORT``."""

    proc: subprocess.Popen[bytes]
    port: int
    state_dir: Path
    log_path: Path
    api_key: str | None = None
    args: Sequence[str] = field(default_factory=tuple)
    engine_pid_seen: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> dict[str, Any] | None:
        """The /health JSON (for any status code), None when nothing answers."""
        req = urllib.request.Request(self.url + "/health")
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                data: dict[str, Any] = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            data = json.loads(err.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None
        pid = (data.get("engine") or {}).get("pid")
        if isinstance(pid, int):
            self.engine_pid_seen = pid
        return data

    def engine_pid(self, timeout_s: float = START_TIMEOUT_S) -> int:
        """The running engine's pid (waits until the server is ready)."""
        pid = self.wait_state("ready", "degraded", timeout_s=timeout_s)["engine"]["pid"]
        assert isinstance(pid, int)
        return pid

    def wait_state(self, *states: str, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        """Poll /health until its state is one of ``states``; fail with the log otherwise."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()}")
            last = self.health()
            if last is not None and last.get("state") in states:
                return last
            time.sleep(0.05)
        pytest.fail(f"server never reached {states} (last: {last}):\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # The engine dies with its parent (PR_SET_PDEATHSIG) and lives in its own
        # process group; make sure of both.
        engine = self.engine_pid_seen
        if engine is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(engine, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return int(self.proc.returncode)


def start_server(
    tmp: Path,
    args: Sequence[str] = (),
    *,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    wait: bool = True,
    wrapper: Sequence[str] = (),
) -> ServerProcess:
    """``wrapper``: a command the server is run under (it ``exec``s the rest)."""
    if not engine_available():
        pytest.skip("the llama-server binary is not there (run `make`): needed for the real engine")
    port = free_port()
    state_dir = tmp / f"state-{port}"
    log_path = tmp / f"serve-{port}.log"
    cmd = [*wrapper, SLMGUARD, "serve", "--port", str(port), "--state-dir", str(state_dir)]
    # A small context unless the test gives one (--ctx per slot, or the deprecated total).
    given_ctx = any(a in ("--ctx", "--n-ctx") for a in args)
    cmd += [*([] if given_ctx else ["--n-ctx", "512"]), *args]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")}
    full_env.pop("NOTIFY_SOCKET", None)
    if api_key:
        full_env["SLMGUARD_API_KEY"] = api_key
    full_env.update(env or {})
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    server = ServerProcess(proc, port, state_dir, log_path, api_key=api_key, args=tuple(args))
    if wait:
        try:
            server.wait_state("ready")
        except BaseException:
            server.stop()
            raise
    return server


def module_server(
    name: str, args: Sequence[str] = (), *, api_key: str | None = None
) -> Callable[..., Iterator[ServerProcess]]:
    """A module-scoped fixture: one server started with ``args`` for the module's tests
    (its files under a temporary directory named for ``name``), stopped after them."""

    @pytest.fixture(scope="module")
    def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
        s = start_server(tmp_path_factory.mktemp(name), args, api_key=api_key)
        try:
            yield s
        finally:
            s.stop()

    return srv


class ServeFactory:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.servers: list[ServerProcess] = []

    def __call__(self, *args: str, **kwargs: Any) -> ServerProcess:
        server = start_server(self.tmp, args, **kwargs)
        self.servers.append(server)
        return server

    def stop_all(self) -> None:
        for s in self.servers:
            s.stop()
