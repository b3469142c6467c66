"""Heat on a real server (real engine, real model): the board heats, the work admitted
shrinks, the board cools, it grows back; no admitted request fails.

The server is built by ``slmguard.serve.server.build_server`` (``governorserver.py``)
with four slots; its governor reads the captured RK3588 board tree under a temporary
root (the kernel's interface is files), whose ``bigcore0-thermal`` temperature the test
writes as a board heating towards its passive trip (85 °C) and cooling down. Clients
keep sending completions all along; each answer is a 200 or, only at the limit, the
503 ``thermal_shedding`` that refuses new work before it is admitted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from boardtuning import zone_temp
from governorserver import MODEL_ID, GovernedServer, governed_server
from hostboards import copy_board
from slmguard.governor.heat import HeatSignal
from waiting import scaled, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow]

from serveproc import REQUEST_TIMEOUT_S, engine_available  # noqa: E402

if not engine_available():  # pragma: no cover - depends on the machine
    pytest.skip("the llama-server binary is not there (run `make`)", allow_module_level=True)

SLOTS = 4
ASKED = 16  # max_tokens every client asks for
CAP = 4  # the heat's cap from hot up (the default is 128: shorter runs here)
ZONE = 1  # thermal_zone1: bigcore0-thermal, passive trip 85 °C


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_board("rk3588-rock5b", tmp_path_factory.mktemp("board") / "rk3588")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, board: Path) -> Iterator[GovernedServer]:
    state = tmp_path_factory.mktemp("heat")
    with governed_server(state, n_ctx=256 * SLOTS, n_parallel=SLOTS, own_memory=True,
                         queue_size=16) as s:  # fmt: skip
        gov = s.governor
        gov.heat.signal = HeatSignal(board, ("bigcore0-thermal",))
        gov.heat.settings = replace(
            gov.heat.settings, hold_s=1.0, interval_s=0.1, max_tokens_cap=CAP
        )
        yield s


@dataclass
class Load:
    """Clients sending completions until stopped; every answer kept."""

    srv: GovernedServer
    # (sent at, status, error code, completion tokens)
    answers: list[tuple[float, int, str | None, int | None]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, n: int) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
            while not self.stop.is_set():
                sent = time.monotonic()
                r = http.post(
                    self.srv.url + "/v1/completions",
                    json={"model": MODEL_ID, "prompt": f"Story {n}: once upon a time",
                          "max_tokens": ASKED, "temperature": 0},
                    headers=self.srv.api_headers(),
                )  # fmt: skip
                body: Any = r.json()
                code = body.get("error", {}).get("code") if r.status_code != 200 else None
                used = body["usage"]["completion_tokens"] if r.status_code == 200 else None
                with self.lock:
                    self.answers.append((sent, r.status_code, code, used))
                if r.status_code != 200:
                    self.stop.wait(0.2)  # a shed client backs off a little, as clients do


def level(srv: GovernedServer) -> str:
    return str(srv.governor.status()["thermal"]["level"])


def test_heats_sheds_last_and_grows_back(srv: GovernedServer, board: Path) -> None:
    queue = srv.ctx.queue
    load = Load(srv)
    clients = [threading.Thread(target=load.client, args=(n,), daemon=True) for n in range(SLOTS)]
    for c in clients:
        c.start()
    try:
        wait_for(lambda: queue.busy == SLOTS, 120, "four slots at work")
        zone_temp(board, ZONE, 76_000)  # 9 °C of room: warm
        wait_for(lambda: queue.allowed == SLOTS // 2, 30, "half the slots", interval_s=1.0)
        zone_temp(board, ZONE, 81_500)  # 3.5 °C: hot
        wait_for(lambda: queue.allowed == 1, 30, "one slot", interval_s=1.0)
        assert srv.governor.max_tokens_cap() == CAP
        capped_from = time.monotonic()
        # The running generations finish; then no more than one runs at once.
        wait_for(lambda: queue.busy <= 1, 300, "the extra slots to drain")
        seen = len(load.answers)
        wait_for(lambda: len(load.answers) >= seen + 2, 300, "two answers at one slot")
        zone_temp(board, ZONE, 85_500)  # at the trip: new work shed
        wait_for(lambda: level(srv) == "limit", 30, "the limit level", interval_s=1.0)
        wait_for(lambda: any(a[1] == 503 for a in load.answers), 60, "a request shed")
        capped_to = time.monotonic()
        zone_temp(board, ZONE, 50_000)  # cooled
        wait_for(lambda: level(srv) == "cool", 60, "cool again", interval_s=1.0)
        assert queue.allowed == SLOTS
        wait_for(lambda: queue.busy >= 2, 120, "more than one slot at work again")
    finally:
        load.stop.set()
        for c in clients:
            c.join(scaled(REQUEST_TIMEOUT_S))
    statuses = {(status, code) for _, status, code, _ in load.answers}
    assert statuses <= {(200, None), (503, "thermal_shedding")}, statuses
    capped = [
        used
        for sent, status, _, used in load.answers
        if status == 200 and capped_from < sent < capped_to
    ]
    assert capped and all(u is not None and u <= CAP for u in capped), capped
    assert any(u is not None and u > CAP for _, s, _, u in load.answers if s == 200)
    steps = srv.governor.status()["thermal"]["steps"]
    assert [(s["from_level"], s["to_level"]) for s in steps] == [
        ("cool", "warm"),
        ("warm", "hot"),
        ("hot", "limit"),
        ("limit", "hot"),
        ("hot", "warm"),
        ("warm", "cool"),
    ]
    assert [s["temp_c"] for s in steps[:3]] == [76.0, 81.5, 85.5]
    assert min(s["slots"] for s in steps) == 1
