"""The watcher's own footprint: resident memory and CPU of `slmguard watch` running as a daemon.

Starts the real daemon (the `slmguard` console script, as a unit would) with a
fixed poll interval, watching this benchmark's own memory cgroup and process,
and a stand-in server on loopback (stdlib http.server in this process:
/health with a worker_pid, /api/v1/governor), so every poll does the full work:
kernel log, cgroup files, PSI, meminfo, fd/DMA-BUF scan of two processes, two
HTTP GETs. It then samples /proc/PID/status (VmRSS, VmHWM) every second and
/proc/PID/stat (utime + stime) at the start and end of the steady-state window
(the first seconds, which read the whole kernel ring buffer once, are reported
separately). Polls are counted from the requests the stand-in server received.

With ``--oom-kills N`` (root, a writable memory cgroup: ``tests/realcgroup.py``)
it also measures how fast a kill is reported: the daemon watches a real child
memory cgroup at a 5 s interval with ``--json``; a process is OOM-killed there
N times; the delay is from the killed process's exit (seen by this process)
to the daemon's ``oom-kill`` line on stdout. It shows the loop waking on the
kernel record rather than waiting for its next poll.

Usage (writes nothing unless --write-results):
    .venv/bin/python benchmarks/watch_footprint.py
    .venv/bin/python benchmarks/watch_footprint.py --duration 60 --interval 1 5 \\
        --oom-kills 5 --write-results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from footprint import steady_window
from results_md import write_section

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
SECTION = "## watch footprint"
SLMGUARD = Path(sys.executable).parent / "slmguard"
WARMUP_S = 5.0
TICK = os.sysconf("SC_CLK_TCK")


def _stderr(proc: subprocess.Popen[bytes]) -> str:
    return proc.stderr.read().decode() if proc.stderr is not None else ""


def _stand_in_server() -> tuple[ThreadingHTTPServer, dict[str, int]]:
    counts = {"health": 0, "governor": 0}
    worker = os.getpid()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                counts["health"] += 1
                body: dict[str, Any] = {
                    "state": "ready",
                    "worker_pid": worker,
                    "worker_restarts": 0,
                }
            elif self.path == "/api/v1/governor":
                counts["governor"] += 1
                body = {"level": "ok", "transitions": []}
            else:
                self.send_error(404)
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, counts


def measure(duration_s: float, interval_s: float) -> dict[str, Any]:
    from slmguard.host.cgroup import memory_cgroup_dir

    server, counts = _stand_in_server()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cgroup = memory_cgroup_dir()
    with tempfile.TemporaryDirectory() as state:
        cmd = [str(SLMGUARD), "watch", "--state-dir", state, "--interval", str(interval_s)]
        cmd += ["--min-interval", str(interval_s), "--server", url, "--pid", str(os.getpid())]
        if cgroup is not None:
            cmd += ["--cgroup", str(cgroup)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            w = steady_window(
                proc, WARMUP_S, duration_s, {"polls": lambda: counts["health"]},
                lambda: f"watcher exited: {_stderr(proc)[-2000:]}",
            )  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(10)
            server.shutdown()
    return {
        "interval_s": interval_s,
        "duration_s": round(w.elapsed_s, 1),
        "cgroup": str(cgroup) if cgroup else None,
        "startup_cpu_s": round(w.startup_ticks / TICK, 2),
        "startup_wall_s": round(w.startup_wall_s, 1),
        "polls": w.counted["polls"],
        "cpu_pct_one_core": round(100.0 * w.ticks / TICK / w.elapsed_s, 2),
        "cpu_ms_per_poll": round(1000.0 * w.ticks / TICK / max(w.counted["polls"], 1), 2),
        "rss_median_bytes": int(statistics.median(w.rss)),
        "rss_peak_bytes": w.final["VmHWM"],
        "rss_anon_bytes": w.final.get("RssAnon"),
        "exit_code": proc.returncode,
    }


def measure_oom_latency(kills: int, interval_s: float = 5.0) -> dict[str, Any]:
    import realcgroup

    reason = realcgroup.unavailable_reason()
    if reason:
        raise SystemExit(f"--oom-kills needs a writable memory cgroup: {reason}")
    delays: list[float] = []
    with (
        realcgroup.memory_cgroup(32 << 20, prefix="slmguard-watchbench") as cg,
        tempfile.TemporaryDirectory() as state,
    ):
        cmd = [str(SLMGUARD), "watch", "--json", "--state-dir", state, "--cgroup", str(cg.path)]
        cmd += ["--interval", str(interval_s)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        seen: dict[str, float] = {}
        ready = threading.Event()

        def read_stdout() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                ready.set()
                alert = json.loads(line)
                if alert["kind"] == "oom-kill":
                    seen[alert["message"]] = time.monotonic()

        reader = threading.Thread(target=read_stdout, daemon=True)
        reader.start()
        try:
            time.sleep(WARMUP_S)  # the first poll (and old kills of other cgroups) pass
            for i in range(kills):
                comm = f"wbhog{i}"
                hog = cg.popen([sys.executable, "-c", realcgroup.HOG, comm, "256"])
                hog.communicate(timeout=120)
                died = time.monotonic()
                key = f"killed {comm} ("
                deadline = died + 4 * interval_s
                while time.monotonic() < deadline:
                    hit = [t for m, t in list(seen.items()) if key in m]
                    if hit:
                        delays.append(hit[0] - died)
                        break
                    time.sleep(0.005)
                else:
                    raise RuntimeError(f"kill {i} not reported within {4 * interval_s} s")
                time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(10)
    return {
        "interval_s": interval_s,
        "kills": kills,
        "delay_ms_median": round(1000 * statistics.median(delays), 1),
        "delay_ms_max": round(1000 * max(delays), 1),
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def write_results(
    rows: list[dict[str, Any]], latency: dict[str, Any] | None, argv: list[str]
) -> None:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION,
        "",
        f"Measured {date} on this machine ({os.cpu_count()} CPUs, shared with other work), "
        f"Python {sys.version.split()[0]}. Command: "
        f"`.venv/bin/python benchmarks/watch_footprint.py {' '.join(argv)}`".rstrip(),
        "",
        "`slmguard watch` as a daemon watching a memory cgroup, two processes and a "
        "loopback server (two GETs per poll). CPU is utime+stime over the steady-state "
        f"window (after a {WARMUP_S:.0f} s warm-up that reads the whole kernel ring "
        "buffer once), as % of one core. RSS from /proc/PID/status, MiB. "
        "Target: RSS <= 30 MB and < 1 % of one core at a 1 s interval.",
        "",
        "| interval s | window s | polls | CPU % of one core | CPU ms/poll | "
        "startup CPU s | RSS median | RSS peak (VmHWM) | RssAnon | SIGTERM exit |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['interval_s']:g} | {r['duration_s']} | {r['polls']} | "
            f"{r['cpu_pct_one_core']} | {r['cpu_ms_per_poll']} | {r['startup_cpu_s']} | "
            f"{_mib(r['rss_median_bytes'])} | {_mib(r['rss_peak_bytes'])} | "
            f"{_mib(r['rss_anon_bytes'])} | {r['exit_code']} |"
        )
    if latency is not None:
        lines += [
            "",
            f"OOM kill to alert: {latency['kills']} real OOM kills in a 32 MiB child memory "
            f"cgroup watched at a {latency['interval_s']:g} s interval; delay from the killed "
            "process's exit to the daemon's `oom-kill` line on stdout: median "
            f"{latency['delay_ms_median']} ms, max {latency['delay_ms_max']} ms (the loop wakes "
            "on the kernel record instead of waiting for its next poll).",
        ]
    write_section(SECTION, "\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="steady-state seconds")
    parser.add_argument("--interval", type=float, nargs="+", default=[1.0])
    parser.add_argument("--oom-kills", type=int, default=0, help="also time N real OOM kills")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    rows = [measure(args.duration, i) for i in args.interval]
    for r in rows:
        print(json.dumps(r))
    latency = measure_oom_latency(args.oom_kills) if args.oom_kills else None
    if latency:
        print(json.dumps(latency))
    if args.write_results:
        write_results(rows, latency, sys.argv[1:])
    ok = all(r["rss_peak_bytes"] <= 30_000_000 and r["cpu_pct_one_core"] < 1.0 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
