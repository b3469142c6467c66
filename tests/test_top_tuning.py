"""top shows the board's tuning (slmguard.tuning's notes) and the heat the governor acts on.

The board is the captured RK3588 tree (tests/fixtures/boards) with the engine's pid in it;
the server is the stand-in answering recorded bodies with a ``thermal`` part as the real
governor's status has it (test_governor_thermal.py reads the real one).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from boardtuning import cpu_governor, write
from hostboards import copy_board
from slmguard.top.client import Fetch, ServerClient
from slmguard.top.events import derive
from slmguard.top.server import server_view
from slmguard.top.snapshot import GovernorView, HeatView, ServerView, TopSnapshot
from slmguard.top.sources import Collector
from slmguard.top.text import render_screen
from slmguard.top.view import Field, Table, build_screen
from toptrees import contract_routes, json_answer, recorded_json, stand_in

URL = "http://127.0.0.1:8080"

THERMAL = {
    "enabled": True,
    "level": "hot",
    "level_for_s": 12.5,
    "slots": 1,
    "planned_slots": 4,
    "max_tokens_cap": 128,
    "shedding": False,
    "zones": [
        {"zone": "thermal_zone0", "type": "soc-thermal", "temp_c": 61.0, "limit_c": 75.0,
         "room_c": 14.0, "error": None},
        {"zone": "thermal_zone1", "type": "bigcore0-thermal", "temp_c": 81.5, "limit_c": 85.0,
         "room_c": 3.5, "error": None},
    ],
    "zones_missing": [],
    "firmware": None,
    "steps": [],
}  # fmt: skip


def _status(thermal: Any) -> dict[str, Any]:
    status = copy.deepcopy(recorded_json("contract-governor.json"))
    status["thermal"] = thermal
    return status


def _view(thermal: Any) -> ServerView:
    f = Fetch(URL, 200, body=_status(thermal), elapsed_s=0.01)
    health = Fetch(URL, 200, body=recorded_json("contract-health.json"), elapsed_s=0.01)
    return server_view(URL, health, None, f)


def test_the_heat_is_read_from_the_governor_status() -> None:
    heat = _view(THERMAL).governor.heat
    assert heat == HeatView(
        level="hot", level_for_s=12.5, slots=1, planned_slots=4, max_tokens_cap=128,
        shedding=False, zone="bigcore0-thermal", temp_c=81.5, limit_c=85.0, watched=2,
    )  # fmt: skip


def test_a_hostile_thermal_part_is_tolerated() -> None:
    assert _view(None).governor.heat is None
    junk = {"level": 5, "zones": [1, {"room_c": "x"}, {"room_c": float("nan")}] * 50,
            "zones_missing": ["a" * 500, 3], "slots": "many"}  # fmt: skip
    heat = _view(junk).governor.heat
    assert heat is not None and heat.level is None and heat.zone is None and heat.slots is None
    assert heat.zones_missing == ("a" * 64,) and heat.watched == 42  # the dicts of the first 64


def test_the_governor_pane_shows_the_heat() -> None:
    governor = GovernorView(source="status", level="normal", heat=_view(THERMAL).governor.heat)
    screen = build_screen(TopSnapshot(time.time(), ServerView("u", True, governor=governor)))
    field = next(
        ln for ln in screen.pane("governor").lines if isinstance(ln, Field) and ln.label == "heat"
    )
    assert (
        field.value.text == "HOT; bigcore0-thermal 81.5 C, limit 85 C; 1 of 4 slots; max_tokens 128"
    )
    assert field.value.flag == "warn"
    limit = HeatView(level="limit", shedding=True, firmware="0x40004: now throttled")
    governor = GovernorView(source="status", level="normal", heat=limit)
    screen = build_screen(TopSnapshot(time.time(), ServerView("u", True, governor=governor)))
    text = render_screen(screen)
    assert "LIMIT; no zone watched; firmware 0x40004: now throttled; new work shed" in text


def test_a_heat_step_is_an_event() -> None:
    cool = ServerView("u", True, governor=GovernorView(level="normal", heat=HeatView("cool")))
    hot = ServerView(
        "u", True, governor=GovernorView(level="normal", heat=_view(THERMAL).governor.heat)
    )
    (event,) = derive(cool, hot, None, 1.0)
    assert (event.kind, event.severity) == ("heat", "warning")
    assert event.message == "heat cool -> hot (bigcore0-thermal 81.5 C): 1 of 4 slots"
    (back,) = derive(hot, cool, None, 2.0)
    assert back.severity == "info"


def test_the_board_pane_shows_the_tuning_for_the_engines_cores(tmp_path: Path) -> None:
    root = copy_board("rk3588-rock5b", tmp_path / "b")
    health = recorded_json("contract-health.json")
    pid = health["engine"]["pid"]
    write(root, f"proc/{pid}/status", "Name:\tllama-server\nCpus_allowed_list:\t4-7\n")
    cpu_governor(root, 6, "powersave")
    routes = contract_routes()
    routes[("GET", "/health")] = json_answer(health)
    with stand_in(routes) as srv:
        c = Collector(ServerClient(srv.url), root=root, local=True)
        snap = c.poll()
    assert snap.board is not None
    notes = {n.id: n for n in snap.board.tuning}
    assert notes["tuning.cpufreq"].severity == "fail"
    assert notes["tuning.affinity"].severity == "pass"  # the engine is on the A76
    screen = build_screen(snap)
    table = next(
        ln
        for ln in screen.pane("board").lines
        if isinstance(ln, Table) and ln.headers[0] == "tuning"
    )
    assert [row[0].text for row in table.rows] == ["cpufreq"]
    assert table.rows[0][2].text.startswith("cpu6-7 held at 408 MHz by the powersave governor")
    assert "tuning: 6 of 7 checks pass (slmguard doctor)" in render_screen(screen)
