"""Fixtures for ``slmguard top``: board trees, recorded server answers, a stand-in server.

- ``RK3588_TOP``: an RK3588 (4x A55 + 4x A76) running the service in
  ``slmguard.slice/slmguard.service`` (cgroup v2), with thermal zones (the big
  cluster above its passive trip, its cooling device active), cpufreq
  policies 0/4/6, the RKNPU debugfs load, the Mali's devfreq, zram on.
- ``JETSON_TOP``: a Jetson Orin Nano (6x A78AE, cgroup v2) with its GPU load
  in per mille and a CPU temperature sensor that is switched off (ENODATA
  cannot be made in a tmpfs: the file is missing, as on a JetPack 5 kernel).
- ``recorded(name)``: the files in tests/fixtures/top (see its README.md).
- :class:`StandIn`: a loopback HTTP server answering from a dict, counting
  requests and recording the Authorization headers: the HTTP layer only, for
  the model-free tests (the real server is in test_top_live.py).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from hostboards import PSI, V2_MOUNTINFO, meminfo

FIXTURES = Path(__file__).parent / "fixtures" / "top"
SERVICE = "sys/fs/cgroup/slmguard.slice/slmguard.service"
MIB = 1 << 20


def recorded(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def recorded_json(name: str) -> Any:
    return json.loads(recorded(name))


def proc_stat(ticks: Mapping[int, tuple[int, int]]) -> str:
    """/proc/stat with ``cpu -> (busy, idle)`` ticks (busy split user/system)."""
    lines = []
    total_busy = sum(b for b, _ in ticks.values())
    total_idle = sum(i for _, i in ticks.values())
    lines.append(
        f"cpu  {total_busy // 2} 0 {total_busy - total_busy // 2} {total_idle} 0 0 0 0 0 0"
    )
    for cpu, (busy, idle) in sorted(ticks.items()):
        lines.append(f"cpu{cpu} {busy // 2} 0 {busy - busy // 2} {idle} 0 0 0 0 0 0")
    lines.append("intr 1 2 3")
    lines.append("ctxt 4711")
    return "\n".join(lines) + "\n"


def _cpufreq(cpus: range, policy: str, cur: int, smax: int, hwmax: int) -> dict[str, str]:
    out = {}
    for c in cpus:
        base = f"sys/devices/system/cpu/cpu{c}/cpufreq"
        out[f"{base}/scaling_cur_freq"] = f"{cur}\n"
        out[f"{base}/scaling_max_freq"] = f"{smax}\n"
        out[f"{base}/cpuinfo_max_freq"] = f"{hwmax}\n"
        out[f"{base}/scaling_governor"] = "schedutil\n"
        out[f"{base}/related_cpus"] = policy + "\n"
    return out


def _zone(n: int, kind: str, milli_c: int, passive: int | None = None) -> dict[str, str]:
    base = f"sys/class/thermal/thermal_zone{n}"
    out = {f"{base}/type": f"{kind}\n", f"{base}/temp": f"{milli_c}\n", f"{base}/mode": "enabled\n"}
    if passive is not None:
        out[f"{base}/trip_point_0_temp"] = f"{passive}\n"
        out[f"{base}/trip_point_0_type"] = "passive\n"
        out[f"{base}/trip_point_1_temp"] = "115000\n"
        out[f"{base}/trip_point_1_type"] = "critical\n"
    return out


def _cooling(n: int, kind: str, cur: int, maximum: int) -> dict[str, str]:
    base = f"sys/class/thermal/cooling_device{n}"
    return {
        f"{base}/type": f"{kind}\n",
        f"{base}/cur_state": f"{cur}\n",
        f"{base}/max_state": f"{maximum}\n",
    }


RK3588_TOP: dict[str, Any] = {
    "proc/self/cgroup": "0::/user.slice\n",
    "proc/self/mountinfo": V2_MOUNTINFO,
    "proc/self/status": "Name:\tslmguard\nCpus_allowed_list:\t0-7\n",
    "proc/pressure/memory": PSI,
    "proc/meminfo": meminfo(
        3_994_000, 1_100_000, 3_040_000, 1_500_000, cma_kb=262_144, swap_kb=1_997_000
    ),
    "proc/stat": proc_stat({c: (1000 * c, 10_000) for c in range(8)}),
    "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma misc\n",
    "sys/devices/system/cpu/online": "0-7\n",
    **{f"sys/devices/system/cpu/cpu{c}/cpu_capacity": "414\n" for c in range(4)},
    **{f"sys/devices/system/cpu/cpu{c}/cpu_capacity": "1024\n" for c in range(4, 8)},
    **_cpufreq(range(4), "0 1 2 3", 1800000, 1800000, 1800000),
    **_cpufreq(range(4, 6), "4 5", 1416000, 2256000, 2256000),
    **_cpufreq(range(6, 8), "6 7", 2256000, 2016000, 2256000),
    **_zone(0, "soc-thermal", 61250, 85000),
    **_zone(1, "bigcore0-thermal", 86500, 85000),
    **_zone(2, "bigcore1-thermal", 72100, 85000),
    **_zone(3, "npu-thermal", 58000),
    **_cooling(0, "cpufreq-cpu0", 0, 6),
    **_cooling(1, "cpufreq-cpu4", 3, 8),
    **_cooling(2, "cpufreq-cpu6", 0, 8),
    **_cooling(3, "devfreq-fb000000.gpu", 0, 4),
    "sys/kernel/debug/rknpu/load": "NPU load:  Core0: 37%, Core1:  0%, Core2: 12%,\n",
    "sys/bus/platform/drivers/RKNPU/fdab0000.npu": "",
    "sys/class/devfreq/fb000000.gpu/cur_freq": "300000000\n",
    "sys/class/devfreq/fb000000.gpu/max_freq": "1000000000\n",
    "sys/class/devfreq/fb000000.gpu/load": "9@300000000Hz\n",
    "sys/class/devfreq/dmc/cur_freq": "2112000000\n",
    "sys/block/zram0/disksize": "4092928000\n",
    "sys/block/zram0/mm_stat": "10485760  2621440  3145728 0 3145728 0 0 0 0\n",
    "sys/block/zram0/comp_algorithm": "lzo lzo-rle lz4 [zstd]\n",
    f"{SERVICE}/cgroup.procs": "812\n5151\n",
    f"{SERVICE}/memory.current": f"{420 * MIB}\n",
    f"{SERVICE}/memory.high": f"{384 * MIB}\n",
    f"{SERVICE}/memory.max": f"{400 * MIB}\n",
    f"{SERVICE}/memory.stat": (
        f"anon {290 * MIB}\nfile {130 * MIB}\ninactive_file {62 * MIB}\nactive_file {68 * MIB}\n"
    ),
    f"{SERVICE}/memory.events": "low 0\nhigh 3\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
    f"{SERVICE}/memory.pressure": (
        "some avg10=1.25 avg60=0.40 avg300=0.10 total=99000\n"
        "full avg10=0.50 avg60=0.10 avg300=0.02 total=41000\n"
    ),
}

JETSON_TOP: dict[str, Any] = {
    "proc/self/cgroup": "0::/user.slice\n",
    "proc/self/mountinfo": V2_MOUNTINFO,
    "proc/pressure/memory": PSI,
    "proc/meminfo": meminfo(7_802_000, 6_200_000, 7_801_000, 3_000_000),
    "proc/stat": proc_stat({c: (500, 9_500) for c in range(6)}),
    "sys/devices/system/cpu/online": "0-5\n",
    **_cpufreq(range(6), "0-5", 1510400, 1510400, 1510400),
    "sys/class/thermal/thermal_zone0/type": "cpu-thermal\n",
    "sys/class/thermal/thermal_zone1/type": "gpu-thermal\n",
    "sys/class/thermal/thermal_zone1/temp": "48500\n",
    **_cooling(0, "cpufreq-cpu0", 0, 10),
    "sys/devices/platform/bus@0/17000000.gpu/load": "345\n",
}


# ---------------------------------------------------------------- the stand-in server


@dataclass
class Answer:
    status: int
    body: bytes
    content_type: str = "application/json"


def json_answer(data: Any, status: int = 200) -> Answer:
    return Answer(status, json.dumps(data).encode())


def text_answer(text: str, status: int = 200) -> Answer:
    return Answer(status, text.encode(), "text/plain; version=0.0.4; charset=utf-8")


@dataclass
class StandIn:
    """Answers ``routes[(method, path)]``; 404 otherwise. Mutate ``routes`` between polls."""

    routes: dict[tuple[str, str], Answer] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    auth: dict[str, list[str | None]] = field(default_factory=dict)
    bodies: list[bytes] = field(default_factory=list)
    url: str = ""

    def answer(self, method: str, path: str, headers: Any, body: bytes) -> Answer:
        self.counts[path] = self.counts.get(path, 0) + 1
        self.auth.setdefault(path, []).append(headers.get("Authorization"))
        if body:
            self.bodies.append(body)
        return self.routes.get((method, path), Answer(404, b'{"detail": "Not Found"}'))


def contract_routes(name: str = "contract") -> dict[tuple[str, str], Answer]:
    """The recorded answers of one server generation: ``contract`` or ``today``."""
    health = recorded_json(f"{name}-health.json")
    return {
        ("GET", "/health"): json_answer(
            health, 200 if health["state"] in ("ready", "degraded") else 503
        ),
        ("GET", "/metrics"): text_answer(recorded(f"{name}-metrics.txt")),
        ("GET", "/api/v1/governor"): json_answer(recorded_json(f"{name}-governor.json")),
        ("POST", "/api/v1/context/trim"): json_answer(
            {
                "keep_recent": 512,
                "session_id": None,
                "sessions_seen": 3,
                "sessions_trimmed": 2,
                "messages_removed": 9,
                "tokens_removed": 1400,
                "tokens_kept": 700,
                "prefix_cache_dropped": True,
                "n_ctx": 512,
            }
        ),
    }


@contextmanager
def stand_in(routes: dict[tuple[str, str], Answer] | None = None) -> Iterator[StandIn]:
    state = StandIn(routes=dict(routes or {}))

    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            a = state.answer(method, self.path, self.headers, body)
            self.send_response(a.status)
            self.send_header("Content-Type", a.content_type)
            self.send_header("Content-Length", str(len(a.body)))
            self.end_headers()
            self.wfile.write(a.body)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
