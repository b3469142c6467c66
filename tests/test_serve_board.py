"""A board under one ``slmguard serve --plan`` (issue 39): real engines, real models.

One server for the module, started as a user starts it: the plan ``slmguard plan`` makes
for this host with the embedded Gemma 3 270M (chat and completions, pinned, alias
``chat``), the tests' tiny reranker (pinned, the lowest priority) and the tiny embedder
(on demand, unloaded after 2 s idle). Each model runs its own supervised llama-server;
requests are routed by ``model``; the embedder loads when a request needs it (the request
waits, it is not refused) and is unloaded when idle; /v1/models, /health, /metrics and
the governor's status show every model. Memory-driven eviction: test_serve_board_memory.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from boardserver import board_plan
from serveproc import MODEL_ID, REQUEST_TIMEOUT_S, ServerProcess, engine_available, start_server
from waiting import wait_for

pytestmark = [pytest.mark.engine]

if not engine_available():  # pragma: no cover - depends on the machine
    pytest.skip("the llama-server binary is not there (run `make`)", allow_module_level=True)

IDLE_UNLOAD_S = 2
EMBED_STARTED = re.compile(r"slmguard\.serve\.engine\.embed: engine started: pid (\d+)")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("board")
    plan = board_plan(
        tmp, "embedded,ctx=512,slots=1,alias=chat",
        "{rerank},pinned,name=rerank,priority=10",
        f"{{embed}},on-demand,name=embed,priority=30,idle-unload={IDLE_UNLOAD_S}s",
    )  # fmt: skip
    s = start_server(tmp, ["--plan", str(plan), "--ctx", "512", "--canary-interval-s", "0"])
    try:
        yield s
    finally:
        s.stop()


def post(srv: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=REQUEST_TIMEOUT_S)


def log(srv: ServerProcess) -> str:
    return Path(srv.log_path).read_text(errors="replace")


def models(srv: ServerProcess) -> dict[str, dict[str, Any]]:
    health = srv.health() or {}
    return {m["model"]: m for m in health.get("models", [])}


def test_every_model_is_listed_and_served_by_its_name(srv: ServerProcess) -> None:
    ids = [card["id"] for card in httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]]
    assert ids == [MODEL_ID, "chat", "rerank", "embed"]
    resp = post(srv, "/v1/completions", {"model": "chat", "prompt": "The capital of France is",
                                         "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4
    resp = post(srv, "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert resp.status_code == 200, resp.text
    resp = post(srv, "/v1/rerank", {"model": "rerank", "query": "capital of france",
                                    "documents": ["paris is in france", "dogs bark"]})  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert sorted(r["index"] for r in resp.json()["results"]) == [0, 1]
    # Each engine its own process.
    pids = {name: m["engine"]["pid"] for name, m in models(srv).items()}
    assert pids[MODEL_ID] != pids["rerank"] and None not in (pids[MODEL_ID], pids["rerank"])


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "x"}, "model_not_found"),
        ("/v1/completions", {"model": "rerank", "prompt": "x"}, "generation_unsupported"),
        ("/v1/embeddings", {"model": "chat", "input": "x"}, "embeddings_unsupported"),
        ("/v1/rerank", {"model": "embed", "query": "a", "documents": ["b"]},
         "rerank_unsupported"),
    ],
)  # fmt: skip
def test_a_model_that_is_not_served_or_not_for_this_route_is_404(
    srv: ServerProcess, path: str, body: dict[str, Any], code: str
) -> None:
    resp = post(srv, path, body)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == code


def test_an_on_demand_model_loads_for_its_request_and_unloads_when_idle(
    srv: ServerProcess,
) -> None:
    wait_for(lambda: models(srv)["embed"]["state"] == "unloaded", 30, "embed unloaded",
             interval_s=IDLE_UNLOAD_S)  # fmt: skip
    assert models(srv)["embed"]["engine"]["pid"] is None
    # The request waits while the model loads (before issue 39: 503 engine_loading).
    resp = post(srv, "/v1/embeddings", {"model": "embed", "input": "paris is in france"})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["data"][0]["embedding"]) == 64
    # Its engine's pid from the log (/health may already say unloaded on a slow machine).
    pid = int(wait_for(lambda: EMBED_STARTED.findall(log(srv)), 30, "embed's start")[-1])
    # Idle for its idle_unload_s: unloaded, its process gone; the others stay.
    wait_for(lambda: models(srv)["embed"]["state"] == "unloaded", 30, "the idle unload",
             interval_s=IDLE_UNLOAD_S)  # fmt: skip
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert models(srv)["rerank"]["state"] == "ready"
    assert "unloaded embed: idle for 2 s" in log(srv)


def test_health_metrics_and_the_governor_show_every_model(srv: ServerProcess) -> None:
    health = srv.health()
    assert health is not None and health["model"] == MODEL_ID and health["state"] == "ready"
    board = {name: (m["residency"], m["priority"]) for name, m in models(srv).items()}
    assert board == {MODEL_ID: ("pinned", 100), "rerank": ("pinned", 10),
                     "embed": ("on_demand", 30)}  # fmt: skip
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    assert f'slmguard_state{{model="{MODEL_ID}",state="ready"}} 1.0' in text
    assert 'slmguard_state{model="rerank",state="ready"} 1.0' in text
    assert 'slmguard_requests_total{endpoint="rerank",model="rerank",outcome="ok"}' in text
    status = httpx.get(srv.url + "/api/v1/governor", timeout=30).json()
    assert [m["model"] for m in status["models"]] == [MODEL_ID, "rerank", "embed"]
    assert status["models"][1]["kv_cache"] is False  # an encoder: never shrunk
