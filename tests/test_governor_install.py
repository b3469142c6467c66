"""governor.serving.install: what it registers in the server's hooks, without the engine.

The router is exercised on FastAPI's in-process test client; the stand-in
context has only what ``install`` touches (hooks, metrics registry, tokens,
degraded reasons). Real-server behaviour is in ``test_governor_http.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from hosttree import build_tree
from slmguard.errors import OverloadedError
from slmguard.governor.policy import Thresholds
from slmguard.governor.runtime import Governor, GovernorConfig
from slmguard.governor.serving import install
from slmguard.governor.signal import MemorySignal
from slmguard.serve import envelope
from slmguard.serve.hooks import AdmissionInfo, Hooks

MIB = 1 << 20
CG = "sys/fs/cgroup/svc"


def setup(tmp_path: Path, *, api_key: str | None, admin: str | None) -> tuple[Any, Governor, Path]:
    root = build_tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/svc\n",
            "proc/self/mountinfo": "25 1 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
            "proc/meminfo": "MemTotal: 8000000 kB\nMemAvailable: 7000000 kB\n",
            "sys/fs/cgroup/cgroup.controllers": "memory\n",
            f"{CG}/memory.current": f"{500 * MIB}\n",
            f"{CG}/memory.max": f"{1000 * MIB}\n",
            f"{CG}/memory.stat": "inactive_file 0\n",
        },
    )
    config = GovernorConfig(thresholds=Thresholds(recover_hold_s=0.0))
    gov = Governor(MemorySignal(root), config, 2048, root=root)
    ctx = SimpleNamespace(
        hooks=Hooks(),
        metrics=SimpleNamespace(registry=CollectorRegistry()),
        admin_token=admin,
        api_key=api_key,
        degraded_reasons={},
        engine=SimpleNamespace(config=SimpleNamespace(n_ctx_slot=2048)),
    )
    install(ctx, gov)  # type: ignore[arg-type]
    return ctx, gov, root


def client(ctx: Any) -> TestClient:
    app = FastAPI()
    envelope.install(app)
    for router in ctx.hooks.routers:
        app.include_router(router)
    return TestClient(app)


INFO = AdmissionInfo("chat", "m", False, 16, 10, 1)


def test_install_registers_every_hook_and_sheds(tmp_path: Path) -> None:
    ctx, gov, root = setup(tmp_path, api_key="key", admin="admin")
    assert len(ctx.hooks.admission) == 1 and len(ctx.hooks.max_tokens_caps) == 1
    assert len(ctx.hooks.routers) == 1 and len(ctx.hooks.health) == 1
    gov.tick()
    asyncio.run(ctx.hooks.admission[0](INFO))  # 50%: admitted
    assert ctx.hooks.health[0]() == {
        "governor": {"level": "normal", "pressure_pct": 50.0, "n_ctx": 2048, "n_ctx_full": 2048}
    }
    (root / CG / "memory.current").write_text(f"{900 * MIB}\n")
    gov.tick()
    with pytest.raises(OverloadedError) as info:
        asyncio.run(ctx.hooks.admission[0](INFO))
    assert (info.value.code, info.value.retry_after_s) == ("memory_shedding", 1)
    assert "memory" in ctx.degraded_reasons  # /health says degraded
    text = generate_latest(ctx.metrics.registry).decode()
    assert 'slmguard_governor_level{level="shed"} 1.0' in text
    assert 'slmguard_governor_rejections_total{reason="memory_shedding"} 1.0' in text
    assert "slmguard_governor_working_set_bytes 9.437184e+08" in text
    (root / CG / "memory.current").write_text(f"{100 * MIB}\n")
    gov.tick()
    gov.tick()
    assert "memory" not in ctx.degraded_reasons


def test_admin_token_equal_to_the_api_key_disables_trim(tmp_path: Path) -> None:
    ctx, _gov, _root = setup(tmp_path, api_key="same", admin="same")
    with client(ctx) as c:
        resp = c.post(
            "/api/v1/context/trim",
            json={"keep_recent": 5},
            headers={"Authorization": "Bearer same"},
        )
        assert resp.status_code == 403
        assert resp.json()["error"]["code"] == "admin_disabled"
        # Reading the status with the API key still works.
        ok = c.get("/api/v1/governor", headers={"Authorization": "Bearer same"})
        assert ok.status_code == 200


def test_trim_without_session_store_or_engine(tmp_path: Path) -> None:
    ctx, _gov, _root = setup(tmp_path, api_key=None, admin="admin")
    with client(ctx) as c:
        resp = c.post(
            "/api/v1/context/trim",
            json={"keep_recent": 0},
            headers={"Authorization": "Bearer admin"},
        )
    assert resp.status_code == 200
    assert resp.json() == {
        "keep_recent": 0,
        "session_id": None,
        "sessions_seen": 0,
        "sessions_trimmed": 0,
        "messages_removed": 0,
        "tokens_removed": 0,
        "tokens_kept": 0,
        "prefix_cache_dropped": False,
        "n_ctx": 2048,
    }
