"""What the benchmarks that start their own engine or server share.

A free loopback port; llama-server started bare (no slmguard in front) with the embedded
model; ``slmguard serve`` started with a state directory of its own and no ``SLMGUARD_*``
from the environment; each waited for, with a bound, until it is ready (killed and an
error raised when it is not), and stopped at the end (terminate, then kill). Reading a
running server (its ``/health``) and the bounded wait are :mod:`serveprobe`'s.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO

import httpx
from serveprobe import health, wait_until

SLMGUARD = Path(sys.executable).parent / "slmguard"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def embedded_model() -> Path:
    """The embedded model's file (``make model`` puts it there)."""
    from slmguard import paths
    from slmguard.default_model import DEFAULT_MODEL_FILE

    return paths.model_dir() / DEFAULT_MODEL_FILE


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def _output(log: Path | None) -> IO[bytes] | int:
    return subprocess.DEVNULL if log is None else log.open("wb")


def bare_engine(
    binary: Path | str, *flags: str, log: Path | None = None, timeout_s: float = 300
) -> tuple[subprocess.Popen[bytes], str]:
    """llama-server ``binary`` with the embedded model and ``flags`` on a free loopback
    port, its output to ``log`` (None: dropped), once its /health answers 200: (process,
    its URL)."""
    port = free_port()
    argv = [str(binary), "--model", str(embedded_model()), "--host", "127.0.0.1",
            "--port", str(port), "--no-webui", *flags]  # fmt: skip
    out = _output(log)
    try:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if not isinstance(out, int):
            out.close()
    url = f"http://127.0.0.1:{port}"
    ready = wait_until(
        lambda: proc.poll() is not None or _status(url + "/health") == 200, timeout_s, 0.2
    )
    if not ready or proc.poll() is not None:
        stop(proc)
        raise RuntimeError(f"{binary} did not become ready (exit {proc.poll()})")
    return proc, url


def serve(
    tmp: Path, *flags: str, log: Path | None = None, timeout_s: float = 300, step_s: float = 0.1
) -> tuple[subprocess.Popen[bytes], str]:
    """``slmguard serve --no-governor`` with ``flags`` on a free loopback port, its state
    under ``tmp``, its output to ``log`` (None: dropped), once /health says ready:
    (process, its URL)."""
    port = free_port()
    argv = [str(SLMGUARD), "serve", "--port", str(port), "--no-governor",
            "--state-dir", str(tmp / f"state-{port}"), *flags]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")}
    out = _output(log)
    try:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    finally:
        if not isinstance(out, int):
            out.close()
    url = f"http://127.0.0.1:{port}"
    if not wait_until(lambda: (health(url) or {}).get("state") == "ready", timeout_s, step_s):
        stop(proc)
        said = log.read_text()[-2000:] if log is not None else ""
        raise RuntimeError(f"server never became ready: {said}")
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
