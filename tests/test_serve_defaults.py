"""``slmguard serve`` with no plan: planned for this host, honest logs, a default max_tokens.

Runs the real server, engine and model (the embedded base model: content is never
asserted). The plan's line, the one ``ready`` line and the engine's chatter below
WARNING are read from the server's log as a user sees it.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import httpx

from serveproc import REQUEST_TIMEOUT_S, ServeFactory, default_model_path
from waiting import wait_for


def test_planned_for_this_host_with_one_ready_line(serve_factory: ServeFactory) -> None:
    srv = serve_factory("--ctx", "256", "--no-governor")
    health = srv.wait_state("ready")
    engine = health["engine"]
    slots, per_slot = engine["n_parallel"], engine["n_ctx_slot"]
    assert per_slot == 256 and engine["n_ctx"] == 256 * slots  # --ctx is per slot, as in plan
    ready = f"ready: {srv.url} serving {health['model']}, {slots} slot(s) x 256 tokens"
    wait_for(lambda: ready in srv.log(), 30, "the ready line")
    log = srv.log()
    planned = re.search(r"planned for this host: board (\S+).*?(\d+) slot\(s\) x (\d+) tokens", log)
    assert planned is not None, log
    assert (int(planned.group(2)), int(planned.group(3))) == (slots, 256)
    assert log.count("ready: ") == 1
    # The engine's output is chatter: nothing from it at WARNING, and the base-model note.
    assert " WARNING slmguard.engine:" not in log, log
    assert "note: the embedded Gemma 3 270M is a base" in log
    # Start-up logs only what is wrong: the polls before the engine's socket exists are
    # expected (they were INFO lines "the engine did not answer (cannot connect:
    # FileNotFoundError ...)"), and a front that may not lower its oom_score_adj says so
    # at INFO. Nothing at WARNING or above but the base-model note.
    assert "did not answer" not in log, log
    loud = [ln for ln in log.splitlines() if re.search(r" (WARNING|ERROR|CRITICAL) ", ln)]
    assert [ln for ln in loud if "note: the embedded Gemma 3 270M" not in ln] == [], loud

    # A chat without max_tokens gets the default: a quarter of the slot (64 tokens here).
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": health["model"], "messages": [{"role": "user", "content": "hi"}]},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert 0 < body["usage"]["completion_tokens"] <= 64, body["usage"]
    if body["usage"]["completion_tokens"] == 64:
        assert body["choices"][0]["finish_reason"] == "length"


def test_the_base_model_note_on_the_plan_path(tmp_path: Path) -> None:
    """--plan for the embedded model: the note is there too (it was missing)."""
    import pytest

    from serveproc import engine_available
    from slmguard import settings
    from slmguard.plan.inputs import plan_for
    from slmguard.serve.server import BASE_MODEL_NOTE, build_server

    model = default_model_path()
    if not engine_available() or not model.exists():
        pytest.skip("needs the engine binary and the default model (run `make`)")
    plan, _ = plan_for(Path("/"), model=model, ctx=256, state_dir=tmp_path)
    s = dataclasses.replace(
        settings.resolve(None, env={}, plan=plan), state_dir=tmp_path, sessions=False
    )
    server = build_server(s, plan)  # built, never started
    try:
        assert server.model.note == BASE_MODEL_NOTE
        assert server.model.sha256 == plan.model.sha256
    finally:
        shutil.rmtree(server.runtime_dir, ignore_errors=True)
