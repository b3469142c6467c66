"""top.promtext and top.server: recorded /metrics, /health and governor answers, and junk.

Fixtures (tests/fixtures/top/README.md): ``llama-server-*`` recorded from the
real llama-server 0.5.0-dev; ``today-*`` recorded from this branch's server
code (its metrics registry and a real governor); ``contract-*`` built from
the data contract of issue 18 for the rewritten server.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from slmguard.top.client import Fetch
from slmguard.top.promtext import parse_line, parse_metrics
from slmguard.top.server import engine_view, governor_view, server_view
from toptrees import recorded, recorded_json

URL = "http://127.0.0.1:8080"


def _fetch(body: Any, status: int = 200) -> Fetch:
    return Fetch(URL, status, body=body, elapsed_s=0.004)


# ---------------------------------------------------------------- promtext


def test_parse_real_llama_server_scrape() -> None:
    m = parse_metrics(recorded("llama-server-metrics.txt"))
    assert m.skipped == 0
    assert m.value("llamacpp:prompt_tokens_total") == 11
    assert m.value("llamacpp:tokens_predicted_total") == 48
    assert m.value("llamacpp:predicted_tokens_seconds") == pytest.approx(1.25386)
    assert m.first("nope", "llamacpp:requests_processing") == 0


def test_parse_prometheus_client_output() -> None:
    m = parse_metrics(recorded("today-metrics.txt"))
    assert m.skipped == 0
    assert m.by_label("slmguard_requests_total", "outcome") == {
        "ok": 7.0, "rejected_queue_full": 2.0, "unavailable": 3.0,
    }  # fmt: skip
    # A counter is found with or without its _total suffix.
    assert m.value("slmguard_worker_restarts") == m.value("slmguard_worker_restarts_total") == 1
    assert m.value("slmguard_governor_level", level="shed") == 1.0
    assert m.value("slmguard_time_to_first_token_seconds_bucket", le="+Inf") == 0.0


@pytest.mark.parametrize(
    ("line", "name", "labels", "value"),
    [
        ('a{b="x\\"y",c="l\\nm"} 3', "a", (("b", 'x"y'), ("c", "l\nm")), 3.0),
        ("x:y_total 5 1712345678000", "x:y_total", (), 5.0),
        ('h{le="+Inf"} +Inf', "h", (("le", "+Inf"),), math.inf),
        ("g -Inf", "g", (), -math.inf),
        ('s{a="1",} 2e3', "s", (("a", "1"),), 2000.0),
    ],
)
def test_parse_line_forms(line: str, name: str, labels: tuple[Any, ...], value: float) -> None:
    sample = parse_line(line)
    assert sample is not None
    assert (sample.name, sample.labels, sample.value) == (name, labels, value)


def test_declared_counter_without_samples_counts_zero() -> None:
    text = (
        "# HELP slmguard_requests_total HTTP API requests by endpoint and outcome\n"
        "# TYPE slmguard_requests_total counter\n"
    )
    m = parse_metrics(text)
    assert m.has("slmguard_requests_total") and not m.all("slmguard_requests_total")
    e = engine_view({"state": "ready"}, m)
    assert (e.requests_ok, e.rejected_429, e.unavailable_503) == (0, 0, 0)
    assert engine_view({}, parse_metrics("other 1\n")).requests_ok is None


def test_nan_parses_but_is_not_a_value() -> None:
    m = parse_metrics("g NaN\nh 1\n")
    assert m.all("g") and m.value("g") is None and m.total("g") is None
    assert m.total("h") == 1


@pytest.mark.parametrize(
    "junk",
    ['a{b="x} 1', "a{1=2} 3", "9abc 1", "a 1 2 3", "a", 'a{b="c"}', "a one"],
)
def test_malformed_lines_are_counted_not_raised(junk: str) -> None:
    m = parse_metrics(f"good 1\n{junk}\n")
    assert m.skipped == 1 and m.value("good") == 1


# ---------------------------------------------------------------- /health + /metrics


def test_contract_engine() -> None:
    health = recorded_json("contract-health.json")
    e = engine_view(health, parse_metrics(recorded("contract-metrics.txt")))
    assert e.version == "version: 0.5.0-dev (build 1, commit 0c1e570)"
    assert (e.pid, e.restarts, e.stalls) == (5151, 2, 1)
    assert (e.n_ctx_cells, e.n_parallel, e.n_ctx_slot_cells) == (1024, 2, 512)
    assert (e.queue_depth, e.busy) == (3, 1)
    assert (e.requests_ok, e.rejected_429, e.unavailable_503) == (44, 5, 15)
    assert (e.prompt_tokens_per_s, e.decode_tokens_per_s, e.speed_source) == (
        412.5, 38.25, "server",
    )  # fmt: skip
    assert e.rss_anon_bytes == 98566144 and e.rss_file_bytes == 133169152
    s0, s1 = e.slots
    assert (s0.id, s0.state, s0.kv_cells_used, s0.n_ctx_cells) == (0, "busy", 157, 512)
    # n_decoded nested in next_token, as llama-server's /slots has it
    assert (s1.state, s1.decoded_tokens, s1.prompt_tokens) == ("idle", 24, 29)
    assert "degrade" in e.degraded_reasons["memory"]


def test_today_engine_spellings() -> None:
    health = recorded_json("today-health.json")
    e = engine_view(health, parse_metrics(recorded("today-metrics.txt")))
    assert (e.pid, e.restarts, e.n_ctx_cells) == (4242, 1, 2048)
    assert e.rss_bytes == 188743680 and e.front_rss_bytes == 54525952
    assert e.busy == 1  # "busy": true
    assert e.version is None and e.stalls is None and e.slots == ()
    assert e.speed_source is None  # no gauges; counters need a previous refresh
    later = engine_view(
        health,
        parse_metrics(
            recorded("today-metrics.txt").replace(
                "slmguard_completion_tokens_total 456.0", "slmguard_completion_tokens_total 556.0"
            )
        ),
        prev=e,
        dt_s=2.0,
    )
    assert (later.decode_tokens_per_s, later.prompt_tokens_per_s) == (50.0, 0.0)
    assert later.speed_source == "counters"


def test_llama_server_gauges_as_fallback() -> None:
    e = engine_view({"state": "ready"}, parse_metrics(recorded("llama-server-metrics.txt")))
    assert e.speed_source == "engine"
    assert e.prompt_tokens_per_s == pytest.approx(1.21089)
    assert e.busy == 0 and e.requests_ok is None  # no slmguard_requests_total at all


def test_real_llama_server_slots() -> None:
    """llama-server's own /slots body, as the front may pass it on."""
    e = engine_view({"slots": recorded_json("llama-server-slots.json")}, None)
    s0, s1 = e.slots
    assert (s0.state, s0.n_ctx_cells, s0.kv_cells_used) == ("idle", 512, None)  # never used
    # Idle after a request: the cached prompt (incl. the generated tokens) is in its cells.
    assert (s1.state, s1.prompt_tokens, s1.decoded_tokens, s1.kv_cells_used) == (
        "idle", 29, 0, 29,
    )  # fmt: skip
    busy = engine_view(
        {
            "slots": [
                {
                    "id": 0,
                    "is_processing": True,
                    "n_ctx": 512,
                    "n_prompt_tokens": 100,
                    "next_token": [{"n_decoded": 7}],
                }
            ]
        },
        None,
    )
    # n_prompt_tokens already counts the 7 generated tokens: not added twice.
    assert busy.slots[0].kv_cells_used == 100


def test_slot_kv_from_metrics_when_health_has_no_slots() -> None:
    m = parse_metrics(recorded("contract-metrics.txt"))
    e = engine_view({"state": "ready"}, m)
    assert [(s.id, s.kv_cells_used, s.n_ctx_cells, s.state) for s in e.slots] == [
        (0, 157, 512, "n/a"), (1, 29, 512, "n/a"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "health",
    [
        {},
        {"state": 5, "engine": "x", "memory": [], "slots": "many", "queue_depth": "3"},
        {"engine": {"pid": True, "restarts": -1.5, "n_ctx": float("nan")}, "slots": [{"id": "a"}]},
        {"slots": [{"id": 1, "n_ctx": 1e300, "is_processing": "yes"}] * 1000},
        {"degraded_reasons": {"memory": 42}, "busy": None, "extra": {"governor": "on"}},
    ],
)
def test_hostile_health_gives_na_not_exceptions(health: dict[str, Any]) -> None:
    view = server_view(URL, _fetch(health), _fetch("junk\n"), _fetch([1, 2]))
    assert view.reachable
    e = view.engine
    assert e.pid is None or e.pid >= 0
    assert len(e.slots) <= 256
    assert view.governor_error == "not a JSON object"
    assert view.metrics_error is None  # text that is half junk is still a scrape


# ---------------------------------------------------------------- governor


def test_governor_from_real_status() -> None:
    g = governor_view(recorded_json("today-governor.json"), {}, None)
    assert (g.source, g.level, g.pressure_pct, g.enabled) == ("status", "shed", 88.0, True)
    assert (g.shed_pct, g.degrade_pct, g.critical_pct) == (85.0, 92.0, 97.0)
    assert g.limit_source == "budget" and g.working_set_bytes and g.limit_bytes
    assert g.rejections == {"memory_shedding": 2}
    assert g.transitions_total == {"normal->shed": 1}
    assert g.recent == () and g.last_resize is None


def test_governor_contract_status_with_transitions() -> None:
    g = governor_view(recorded_json("contract-governor.json"), {}, None)
    assert (g.level, g.n_ctx_cells, g.n_ctx_full_cells, g.max_tokens_cap) == (
        "degrade", 512, 1024, 256,
    )  # fmt: skip
    assert [(t.from_level, t.to_level, t.reason) for t in g.recent][-1] == (
        "shed", "degrade", "rising",
    )  # fmt: skip
    assert g.recent[0].at_unix_s == 1796119000.0
    assert g.last_resize is not None and g.last_resize.measured_delta_bytes == 10911744


def test_governor_falls_back_to_health_then_metrics() -> None:
    health = recorded_json("contract-health.json")
    m = parse_metrics(recorded("contract-metrics.txt"))
    g = governor_view(None, health, m)
    assert (g.source, g.level, g.pressure_pct, g.n_ctx_full_cells) == (
        "health",
        "degrade",
        93.1,
        1024,
    )
    assert g.rejections == {"memory_shedding": 14, "context_degraded": 1}
    assert g.transitions_total["shed->degrade"] == 1 and g.parked is False
    only_metrics = governor_view(None, {}, m)
    assert (only_metrics.source, only_metrics.level, only_metrics.n_ctx_cells) == (
        "metrics", "degrade", 512,
    )  # fmt: skip
    assert governor_view(None, {}, None).source is None


def test_governor_device_memory_from_status_and_metrics() -> None:
    """The device memory outside the cgroup the governor counts (``signal.device_bytes``
    and ``device_source``, ``slmguard_governor_device_bytes``); older answers lack it."""
    status = recorded_json("today-governor.json")
    assert governor_view(status, {}, None).device_bytes is None  # recorded before it existed
    status["signal"].update(device_bytes=268435456, device_source="NvMapMemUsed")
    g = governor_view(status, {}, None)
    assert (g.device_bytes, g.device_source) == (268435456, "NvMapMemUsed")
    text = recorded("today-metrics.txt")
    assert governor_view(None, {}, parse_metrics(text)).device_bytes is None
    text += "# TYPE slmguard_governor_device_bytes gauge\n"
    text += "slmguard_governor_device_bytes 2.68435456e+08\n"
    g = governor_view(None, {}, parse_metrics(text))
    assert (g.source, g.device_bytes, g.device_source) == ("metrics", 268435456, None)


def test_iso_transition_times() -> None:
    status = {"level": "shed", "transitions": [
        {"from": "normal", "to": "shed", "time": "2026-11-30T05:40:01Z"},
        {"from_level": "x"},
    ]}  # fmt: skip
    (t,) = governor_view(status, {}, None).recent
    assert t.at_unix_s == 1796017201.0


# ---------------------------------------------------------------- the whole answer


def test_unreachable_and_auth_problems_are_said() -> None:
    down = server_view(URL, Fetch(URL, None, error="[Errno 111] Connection refused"), None, None)
    assert not down.reachable and "refused" in (down.error or "")
    health = recorded_json("contract-health.json")
    denied = {"error": {"message": "missing or incorrect token", "type": "x", "code": "y"}}
    view = server_view(URL, _fetch(health, 200), _fetch(denied, 401), _fetch(denied, 401))
    assert view.metrics_error == "HTTP 401: missing or incorrect token (give --api-key-file)"
    assert view.governor_error == "HTTP 401: missing or incorrect token (give --admin-token-file)"
    assert view.governor.source == "health"  # still shown, from /health
    loading = server_view(URL, _fetch({"state": "loading"}, 503), None, None)
    assert loading.reachable and loading.health_status == 503
    assert loading.engine.state == "loading"


# ---------------------------------------------------------------- a board (issue 39)


def test_a_board_shows_every_model() -> None:
    """Recorded from a real three-model `serve --plan` (tests/fixtures/top/README.md)."""
    view = server_view(
        URL,
        _fetch(recorded_json("board-health.json")),
        _fetch(recorded("board-metrics.txt")),
        _fetch(recorded_json("board-governor.json")),
    )
    assert view.engine.model == "gemma-3-270m-q4_k_m" and view.engine.state == "ready"
    assert view.engine.decode_tokens_per_s == pytest.approx(0.780490676648622)  # the primary's
    assert view.engine.requests_ok == 2  # the server's: chat's completion and the rerank
    assert [(m.name, m.residency, m.priority, m.state) for m in view.models] == [
        ("gemma-3-270m-q4_k_m", "pinned", 100, "ready"),
        ("embed", "on_demand", 50, "ready"),
        ("rerank", "on_demand", 50, "ready"),
    ]
    embed = view.models[1]
    assert embed.pid == 14153 and embed.n_ctx_cells == 512 and embed.parked is False
    assert embed.rss_bytes is not None and embed.rss_bytes < view.models[0].rss_bytes  # type: ignore[operator]


def test_one_model_has_no_board_and_junk_models_are_skipped() -> None:
    assert server_view(URL, _fetch(recorded_json("contract-health.json")), None, None).models == ()
    health = {"state": "ready", "models": [{"model": 7}, "x", {"model": "ok", "priority": "hi"}]}
    (only,) = server_view(URL, _fetch(health), None, None).models
    assert only.name == "ok" and only.priority is None
