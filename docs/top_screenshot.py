"""Draw docs/top.svg and docs/top.png: the real `slmguard top` screen on a fixture board.

The board is tests/toptrees.py's RK3588 (its big cluster throttled), the server a
loopback stand-in answering with the recorded contract bodies of tests/fixtures/top;
between refreshes the CPU ticks move, the watcher logs an OOM kill and writes a
crash bundle, and the engine restarts, as they would on a board in trouble. The
screen is Textual's own SVG export (``App.save_screenshot``); the PNG is made with
``rsvg-convert`` (Debian's librsvg2-bin) when it is installed.

    .venv/bin/python docs/top_screenshot.py
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from hosttree import build_tree  # noqa: E402
from slmguard.plan.schema import load_plan  # noqa: E402
from slmguard.top.app import TopApp  # noqa: E402
from slmguard.top.client import ServerClient  # noqa: E402
from slmguard.top.sources import Collector, plan_view  # noqa: E402
from toptrees import (  # noqa: E402
    FIXTURES,
    RK3588_TOP,
    SERVICE,
    contract_routes,
    json_answer,
    proc_stat,
    recorded_json,
    stand_in,
)

OUT = REPO / "docs"
SIZE = (180, 62)


async def draw(url: str, root: Path, set_health: object) -> Path:
    plan = plan_view(load_plan(FIXTURES / "plan-rk3588-4g.json"), Path("/etc/slmguard/plan.json"))
    state = root / "var/lib/slmguard"
    collector = Collector(ServerClient(url, admin_token="x"), root=root, local=True,
                          cgroup_dir=root / SERVICE, state_dir=state, plan=plan)  # fmt: skip
    app = TopApp(collector, interval_s=3600, can_trim=True)  # refreshed by hand below
    async with app.run_test(size=SIZE) as pilot:
        while app.refreshes < 1:
            await pilot.pause(0.05)
        busy = {0: 12, 1: 8, 2: 15, 3: 9, 4: 97, 5: 95, 6: 98, 7: 96}
        (root / "proc/stat").write_text(
            proc_stat({c: (1000 * c + 10 * b, 10_000 + 10 * (100 - b)) for c, b in busy.items()})
        )
        state.mkdir(parents=True, exist_ok=True)
        alert = {
            "time": "2026-11-30T05:40:01Z",
            "host": "board",
            "severity": "critical",
            "kind": "oom-kill",
            "facts": {},
            "message": "OOM killer killed llama-server (pid 5150) in the service's cgroup",
        }
        (state / "alerts.jsonl").write_text(json.dumps(alert) + "\n")
        bundle = state / "crashes" / "20261130T054002Z"
        bundle.mkdir(parents=True, exist_ok=True)
        (bundle / "summary.json").write_text(json.dumps({
            "reason": "oom-kill", "time": "2026-11-30T05:40:02Z",
            "kills": [{"pid": 5150, "comm": "llama-server"}]}))  # fmt: skip
        (state / "watch-state.json").write_text(json.dumps({"version": 1, "kills_reported": 1}))
        set_health()  # type: ignore[operator]
        before = app.refreshes
        app.refresh_now()
        while app.refreshes < before + 1:
            await pilot.pause(0.05)
        await pilot.pause(0.3)
        return Path(app.save_screenshot("top.svg", path=str(OUT)))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp, stand_in(contract_routes()) as srv:
        root = build_tree(Path(tmp), RK3588_TOP)

        def restarted() -> None:
            health = recorded_json("contract-health.json")
            health["engine"].update(restarts=3, pid=6262)
            srv.routes[("GET", "/health")] = json_answer(health)

        svg = asyncio.run(draw(srv.url, root, restarted))
    print(svg)
    converter = shutil.which("rsvg-convert")
    if converter is None:
        print("rsvg-convert not found (apt-get install librsvg2-bin): no PNG", file=sys.stderr)
        return 0
    png = OUT / "top.png"
    subprocess.run([converter, "-w", "1800", str(svg), "-o", str(png)], check=True)
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
