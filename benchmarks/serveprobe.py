"""What the benchmarks that drive a running ``slmguard serve`` share: reading its
``/health``, waiting for a condition with a bound, and looking at an engine from outside.

An engine, served or bare, is seen the same way (:class:`EngineView`): its own decode
counters (``/metrics``: llama.cpp's ``tokens_predicted_total`` and
``tokens_predicted_seconds_total``, so its own decode speed over a request), the sampling
parameters its slot last ran with (``/slots``: what the engine really received, after any
translation by the front), and how its process runs (:func:`process_facts`: flags, the
environment, nice, policy, CPUs, its session: with the kernel's autogroup on, a session
is a CPU scheduling group). :func:`differences` names what differs between two engines
besides the front. A served engine is reached on its private socket with its key (read
from its own command line), a bare one on loopback TCP.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

#: Flags whose values are the run's own (where it listens, its key, its slot directory).
RUN_FLAGS = ("--host", "--port", "--api-key-file", "--slot-save-path")
#: /slots params that say nothing of the work (counters and the request's own id).
_NOT_SAMPLING = ("id_task",)
#: llama.cpp's /metrics counters of generated tokens and the time spent generating them.
_DECODE = ("llamacpp:tokens_predicted_total", "llamacpp:tokens_predicted_seconds_total")


def health(url: str) -> dict[str, Any] | None:
    """The server's /health body, or None while it does not answer one."""
    try:
        data: dict[str, Any] = httpx.get(url + "/health", timeout=5).json()
        return data
    except (httpx.HTTPError, ValueError):
        return None


def wait_until(pred: Callable[[], Any], timeout_s: float, step_s: float = 0.1) -> bool:
    """Poll ``pred`` until it is true (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return False


def cmdline(pid: int) -> list[str]:
    """A process's command line, as the kernel has it."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")


def environ(pid: int) -> dict[str, str]:
    """A process's environment, as it was given at exec."""
    out = {}
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep:
            out[key] = value
    return out


def flags(argv: list[str]) -> list[str]:
    """An engine's command line without the run's own values (:data:`RUN_FLAGS`)."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in RUN_FLAGS:
            next(it, None)
            continue
        out.append(arg)
    return out


class EngineView:
    """One engine's own figures: on loopback TCP (``url``) or its socket with its key
    (``argv``: the served engine's command line, ``--host`` a socket path)."""

    def __init__(self, *, url: str | None = None, argv: list[str] | None = None) -> None:
        if url is not None:
            self.client = httpx.Client(base_url=url, timeout=60)
        elif argv is not None:
            sock = argv[argv.index("--host") + 1]
            key = Path(argv[argv.index("--api-key-file") + 1]).read_text().strip()
            self.client = httpx.Client(
                transport=httpx.HTTPTransport(uds=sock), base_url="http://engine",
                headers={"Authorization": f"Bearer {key}"}, timeout=60,
            )  # fmt: skip
        else:
            raise ValueError("an engine view needs a url or an argv")

    def decode_counters(self) -> tuple[float, float]:
        """(tokens generated, seconds the engine spent generating them), since its start."""
        found: dict[str, float] = {}
        for line in self.client.get("/metrics").text.splitlines():
            name, _, value = line.partition(" ")
            if name in _DECODE:
                found[name] = float(value)
        return found[_DECODE[0]], found[_DECODE[1]]

    def slot_params(self) -> dict[str, Any]:
        """The sampling parameters of the slot that ran the latest task, and the length
        of the prompt it ran (``n_prompt_tokens``: the same text and images reached it)."""
        slots = self.client.get("/slots").json()
        latest = max(slots, key=lambda s: s.get("id_task", -1))
        params = {k: v for k, v in latest.get("params", {}).items() if k not in _NOT_SAMPLING}
        return {**params, "n_prompt_tokens": latest.get("n_prompt_tokens")}

    def close(self) -> None:
        self.client.close()


def engine_decode_tps(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The engine's own decode speed between two :meth:`EngineView.decode_counters`."""
    tokens, seconds = after[0] - before[0], after[1] - before[1]
    return tokens / seconds if tokens > 0 and seconds > 0 else None


def process_facts(pid: int) -> dict[str, Any]:
    """How a process runs: what the scheduler and the engine see of it."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return {
        "flags": flags(cmdline(pid)[1:]),
        "binary": os.path.realpath(cmdline(pid)[0]),
        "environment": environ(pid),
        "nice": int(stat[16]),
        "policy": os.sched_getscheduler(pid),
        "cpus": sorted(os.sched_getaffinity(pid)),
        "own session (own autogroup)": int(stat[3]) == pid,
        "cgroup": Path(f"/proc/{pid}/cgroup").read_text().strip(),
    }


def differences(bare_pid: int, served_pid: int) -> list[str]:
    """What differs between two engines' processes, one line each (empty: nothing)."""
    a, b = process_facts(bare_pid), process_facts(served_pid)
    out = []
    for key in a:
        if key == "environment":
            keys = sorted(k for k in set(a[key]) | set(b[key]) if a[key].get(k) != b[key].get(k))
            out += [f"environment {k}: bare {a[key].get(k)!r}, served {b[key].get(k)!r}"
                    for k in keys]  # fmt: skip
        elif a[key] != b[key]:
            out.append(f"{key}: bare {a[key]}, served {b[key]}")
    return out


def param_differences(bare: dict[str, Any], served: dict[str, Any]) -> list[str]:
    """Sampling parameters that differ between two engines' slots, one line each."""
    return [f"{k}: bare {bare.get(k)!r}, served {served.get(k)!r}"
            for k in sorted(set(bare) | set(served)) if bare.get(k) != served.get(k)]  # fmt: skip
