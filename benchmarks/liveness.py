"""How fast a wedged engine is found and replaced, and what the idle canary costs.

Against a real ``slmguard serve`` (real engine, embedded model):

1. **Stall to error, stall to serving again** (median of ``--runs``): a
   streamed completion runs, the engine gets SIGSTOP after its second token;
   timed from the signal to the client's SSE error event (``engine_stalled``)
   and to the first 200 of a new request after the restart. The server runs
   with its derived stall time (``--stall-floor-s`` here, since the default
   model's steps are short).
2. **A stopped engine on a fresh server** (issue 37; ``--fresh-runs``): the
   server with its default stall settings (floor 15 s, factor 8, the step probe
   on); the engine gets SIGSTOP as soon as ``/health`` says ready, before any
   request (the step probe may be running), then one chat is sent; timed from
   sending it to its 503 ``engine_stalled``, against the goal of the stall time
   the server states plus 2 s. Then the same after one earlier request (the
   probe has measured the engine).
3. **The canary's cost**: the CPU time (utime + stime of front and engine,
   from ``/proc/PID/stat``) over an idle window with the canary every second,
   minus the same window with it off, per canary; and what that makes at the
   default interval (120 s), as percent of one core.

Usage (prints only, unless --write-results):
    .venv/bin/python benchmarks/liveness.py
    .venv/bin/python benchmarks/liveness.py --runs 5 --write-results
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from launch import serve, stop
from results_md import write_section
from serveprobe import health, wait_until

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
SECTION = "## liveness"
MODEL_ID = "gemma-3-270m-q4_k_m"
DEFAULT_CANARY_S = 120.0
TICKS = os.sysconf("SC_CLK_TCK")


def start(tmp: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    return serve(tmp, "--n-ctx", "1024", *extra, step_s=0.05)


def one_stall(url: str, run: int) -> tuple[float, float, float]:
    """(stall time the server used, s to the client's error, s to serving again)."""
    h = health(url) or {}
    pid = int(h["engine"]["pid"])
    body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 400 + run,
            "temperature": 0, "stream": True}  # fmt: skip
    n = 0
    stopped = 0.0
    error_at = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            n += 1
            if n == 2:
                os.kill(pid, signal.SIGSTOP)
                stopped = time.monotonic()
            if '"engine_stalled"' in line:
                error_at = time.monotonic()
    try:
        if error_at is None:
            raise RuntimeError("the stream ended without engine_stalled")
        limit = float(((health(url) or {}).get("liveness") or {}).get("stall_after_s") or 0)
        ok = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 1}

        def serving() -> bool:
            try:
                return httpx.post(url + "/v1/completions", json=ok, timeout=30).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_until(serving, 300, 0.1):
            raise RuntimeError("the server did not serve again")
        return limit, error_at - stopped, time.monotonic() - stopped
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def fresh_stop(tmp: Path, *, warm: bool) -> tuple[float, float, int]:
    """A fresh server with the default stall settings; its engine stopped before any
    request (``warm``: after one). (stall time it states, s from sending a chat to its
    answer, the answer's status)."""
    proc, url = start(tmp)
    try:
        if warm:
            httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=600).raise_for_status()
            wait_until(lambda: ((health(url) or {}).get("liveness") or {}).get("step_s"), 300)
        h = health(url) or {}
        pid = int(h["engine"]["pid"])
        os.kill(pid, signal.SIGSTOP)
        try:
            sent = time.monotonic()
            resp = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=600)
            took = time.monotonic() - sent
            limit = float(((health(url) or {}).get("liveness") or {}).get("stall_after_s") or 0)
            code = (resp.json().get("error") or {}).get("code") if resp.status_code != 200 else ""
            print(f"fresh (warm={warm}): {resp.status_code} {code} after {took:.2f} s "
                  f"(stall time {limit:.1f} s)", file=sys.stderr)  # fmt: skip
            return limit, took, resp.status_code
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    finally:
        stop(proc)


def cpu_s(*pids: int) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / TICKS


def idle_cpu(url: str, front: int, window_s: float) -> tuple[float, int]:
    h = health(url) or {}
    engine = int(h["engine"]["pid"])
    before = cpu_s(front, engine)
    canaries = int((h.get("liveness") or {}).get("canaries", 0))
    time.sleep(window_s)
    h = health(url) or {}
    after = cpu_s(front, engine)
    return after - before, int((h.get("liveness") or {}).get("canaries", 0)) - canaries


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--stall-floor-s", type=float, default=5.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--fresh-runs", type=int, default=3)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="slmguard-liveness-"))
    t0 = time.monotonic()
    proc, url = start(tmp, "--stall-floor-s", str(args.stall_floor_s),
                      "--restart-backoff-initial-s", "0.2", "--restart-max", str(args.runs + 2),
                      "--canary-interval-s", "0")  # fmt: skip
    try:
        runs = [one_stall(url, run) for run in range(args.runs)]
    finally:
        stop(proc)
    fresh = [fresh_stop(tmp, warm=False) for _ in range(args.fresh_runs)]
    warm = [fresh_stop(tmp, warm=True) for _ in range(args.fresh_runs)]
    off_proc, off_url = start(tmp, "--canary-interval-s", "0")
    try:
        off_cpu, _ = idle_cpu(off_url, off_proc.pid, args.window_s)
    finally:
        stop(off_proc)
    on_proc, on_url = start(tmp, "--canary-interval-s", "1")
    try:
        on_cpu, canaries = idle_cpu(on_url, on_proc.pid, args.window_s)
    finally:
        stop(on_proc)
    per_canary = max(0.0, on_cpu - off_cpu) / max(1, canaries)
    elapsed = time.monotonic() - t0
    limit = statistics.median(r[0] for r in runs)
    to_error = statistics.median(r[1] for r in runs)
    to_serving = statistics.median(r[2] for r in runs)
    text = "\n".join([
        SECTION,
        "",
        f"`benchmarks/liveness.py`, {datetime.date.today()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, embedded model, n_ctx 1024; took {elapsed:.0f} s.",
        "",
        f"SIGSTOP of the engine during a stream, {args.runs} runs (stall time {limit:.1f} s: "
        f"the floor, since this model's longest step is short):",
        "",
        "| | median s | per run |",
        "|---|---|---|",
        f"| SIGSTOP -> client's `engine_stalled` event | {to_error:.2f} | "
        f"{', '.join(f'{r[1]:.2f}' for r in runs)} |",
        f"| SIGSTOP -> a new request answered 200 | {to_serving:.2f} | "
        f"{', '.join(f'{r[2]:.2f}' for r in runs)} |",
        "",
        "A stopped engine on a fresh server (default stall settings, the step probe on): "
        "SIGSTOP as soon as `/health` says ready, then one chat; from sending it to its "
        "answer (goal: the stall time + 2 s):",
        "",
        "| | stall time s | s to the answer | status | per run |",
        "|---|---|---|---|---|",
        _fresh_row("before any request", fresh),
        _fresh_row("after one request", warm),
        "",
        f"The idle canary (a one-token generation): {canaries} canaries in {args.window_s:.0f} s "
        f"cost {on_cpu:.2f} s of CPU against {off_cpu:.2f} s without them, "
        f"{per_canary * 1000:.1f} ms each; at the default interval of {DEFAULT_CANARY_S:.0f} s "
        f"that is {per_canary / DEFAULT_CANARY_S * 100:.3f}% of one core.",
    ]) + "\n"  # fmt: skip
    print(text)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    text = text.rstrip("\n") + f"\n\nLoad average at the end: {load} (1/5/15 min).\n"
    if args.write_results:
        write_section(SECTION, text)
    print(json.dumps({"runs": runs, "per_canary_s": per_canary}), file=sys.stderr)
    return 0


def _fresh_row(what: str, runs: list[tuple[float, float, int]]) -> str:
    limit = statistics.median(r[0] for r in runs)
    took = statistics.median(r[1] for r in runs)
    statuses = "/".join(sorted({str(r[2]) for r in runs}))
    each = ", ".join(f"{r[1]:.2f}" for r in runs)
    return f"| {what} | {limit:.1f} | {took:.2f} | {statuses} | {each} |"


if __name__ == "__main__":
    sys.exit(main())
