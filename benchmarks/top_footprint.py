"""The cost of watching: CPU and resident memory of `slmguard top` refreshing every second.

Starts the real terminal UI (the `slmguard` console script, `top` without
`--once`) on a pseudo-terminal of 170x58 whose output this script reads and
throws away (a terminal emulator would draw it), pointed at a stand-in server
on loopback (stdlib http.server in this process) that answers /health,
/metrics and /api/v1/governor with the recorded bodies of
tests/fixtures/top (the rewritten server's contract: two slots, the
llama.cpp metrics, a governor with transitions), so every refresh does the
full work: three HTTP GETs, a Prometheus parse, this machine's memory cgroup,
PSI, meminfo, zram, /proc/stat, cpufreq and thermal files, the view model and
a redraw. It then samples /proc/PID/status (VmRSS, VmHWM) every second and
/proc/PID/stat (utime + stime) at the start and end of the steady-state
window (after a warm-up in which Python imports Textual and draws the first
screen). Refreshes are counted from the /health requests the stand-in saw.

Usage (writes nothing unless --write-results):
    .venv/bin/python benchmarks/top_footprint.py
    .venv/bin/python benchmarks/top_footprint.py --duration 60 --interval 1 --write-results
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import pty
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
from pathlib import Path
from typing import Any

from footprint import steady_window
from results_md import write_section

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
SECTION = "## top footprint"
SLMGUARD = Path(sys.executable).parent / "slmguard"
WARMUP_S = 8.0
TICK = os.sysconf("SC_CLK_TCK")
COLUMNS, ROWS = 170, 58


def _drain(fd: int, counter: list[int]) -> None:
    """Read the terminal's output until the child closes it (EIO on Linux)."""
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            return
        if not data:
            return
        counter[0] += len(data)


def measure(duration_s: float, interval_s: float) -> dict[str, Any]:
    from slmguard.host.cgroup import memory_cgroup_dir
    from toptrees import contract_routes, stand_in

    cgroup = memory_cgroup_dir()
    with stand_in(contract_routes()) as srv, tempfile.TemporaryDirectory() as state:
        cmd = [str(SLMGUARD), "top", "--server", srv.url, "--interval", str(interval_s),
               "--state-dir", state, "--local"]  # fmt: skip
        if cgroup is not None:
            cmd += ["--cgroup", str(cgroup)]
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
        env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(COLUMNS), LINES=str(ROWS))
        proc = subprocess.Popen(
            cmd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        os.close(slave)
        written = [0]
        reader = threading.Thread(target=_drain, args=(master, written), daemon=True)
        reader.start()
        try:
            w = steady_window(
                proc, WARMUP_S, duration_s,
                {"refreshes": lambda: srv.counts.get("/health", 0), "drawn": lambda: written[0]},
                lambda: f"slmguard top exited with {proc.returncode}",
            )  # fmt: skip
        finally:
            os.write(master, b"q")  # the q key: a clean exit
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            os.close(master)
    return {
        "interval_s": interval_s,
        "duration_s": round(w.elapsed_s, 1),
        "cgroup": str(cgroup) if cgroup else None,
        "startup_cpu_s": round(w.startup_ticks / TICK, 2),
        "startup_wall_s": round(w.startup_wall_s, 1),
        "refreshes": w.counted["refreshes"],
        "cpu_pct_one_core": round(100.0 * w.ticks / TICK / w.elapsed_s, 2),
        "cpu_ms_per_refresh": round(1000.0 * w.ticks / TICK / max(w.counted["refreshes"], 1), 2),
        "terminal_bytes_per_s": round(w.counted["drawn"] / w.elapsed_s),
        "rss_median_bytes": int(statistics.median(w.rss)),
        "rss_peak_bytes": w.final["VmHWM"],
        "rss_anon_bytes": w.final.get("RssAnon"),
        "exit_code": proc.returncode,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def write_results(rows: list[dict[str, Any]], argv: list[str]) -> None:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    import textual

    lines = [
        SECTION,
        "",
        f"Measured {date} on this machine ({os.cpu_count()} CPUs, shared with other work), "
        f"Python {sys.version.split()[0]}, textual {textual.__version__}. Command: "
        f"`.venv/bin/python benchmarks/top_footprint.py {' '.join(argv)}`".rstrip(),
        "",
        f"`slmguard top` (the terminal UI) on a {COLUMNS}x{ROWS} pseudo-terminal, against a "
        "loopback stand-in answering with the recorded contract bodies (three GETs and a "
        "Prometheus parse per refresh) and reading this machine's cgroup, PSI, meminfo, "
        "/proc/stat, cpufreq and thermal files. CPU is utime+stime over the steady-state "
        f"window (after a {WARMUP_S:.0f} s warm-up: imports and the first screen), as % of "
        "one core. RSS from /proc/PID/status, MiB. Target: under 2 % of one core at 1 s.",
        "",
        "| interval s | window s | refreshes | CPU % of one core | CPU ms/refresh | "
        "startup CPU s | terminal output B/s | RSS median | RSS peak (VmHWM) | RssAnon | "
        "exit on q |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['interval_s']:g} | {r['duration_s']} | {r['refreshes']} | "
            f"{r['cpu_pct_one_core']} | {r['cpu_ms_per_refresh']} | {r['startup_cpu_s']} | "
            f"{r['terminal_bytes_per_s']} | {_mib(r['rss_median_bytes'])} | "
            f"{_mib(r['rss_peak_bytes'])} | {_mib(r['rss_anon_bytes'])} | {r['exit_code']} |"
        )
    write_section(SECTION, "\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="steady-state seconds")
    parser.add_argument("--interval", type=float, nargs="+", default=[1.0])
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    rows = [measure(args.duration, i) for i in args.interval]
    for r in rows:
        print(json.dumps(r))
    if args.write_results:
        write_results(rows, sys.argv[1:])
    ok = all(r["cpu_pct_one_core"] < 2.0 for r in rows if r["interval_s"] >= 1.0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
