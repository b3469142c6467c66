"""The governor inside the server: what :class:`~slmguard.serve.server.Server` wires in
(the request policy, /health, the degraded state, the metrics, the admin routes),
without the engine.

The server is built as ``build_server`` builds it, with an engine that is never
started and the governor's signal pointed at a fixture tree; the routes run on
FastAPI's in-process test client. Real-server behaviour is in
``test_governor_http.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from hosttree import build_tree
from slmguard.errors import ConfigError, OverloadedError
from slmguard.governor.policy import Thresholds
from slmguard.governor.request import SizedRequest
from slmguard.governor.runtime import GovernorConfig
from slmguard.governor.signal import MemorySignal
from slmguard.serve.app import create_app
from slmguard.serve.llamaserver import EngineConfig
from slmguard.serve.routes import health_body
from slmguard.serve.served import ServedModel
from slmguard.serve.server import Server
from slmguard.settings import ServeSettings, Tokens

MIB = 1 << 20
CG = "sys/fs/cgroup/svc"


def setup(tmp_path: Path, *, api_key: str | None, admin: str | None) -> tuple[Server, Path]:
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
    config = EngineConfig(model_path="/m/model.gguf", n_ctx=2048, n_batch=512, n_ubatch=512,
                          n_threads=2)  # fmt: skip
    server = Server(
        ServeSettings(state_dir=tmp_path), ServedModel("m", "/m/model.gguf", 1), config,
        binary=Path("/nonexistent/llama-server"), version="", tokens=Tokens(api_key, admin),
        sessions=None, state_dir=tmp_path, runtime_dir=tmp_path / "run",
        governor=GovernorConfig(thresholds=Thresholds(recover_hold_s=0.0)),
    )  # fmt: skip
    assert server.governor is not None
    server.governor.signal = MemorySignal(root)
    return server, root


REQUEST = SizedRequest("chat", prompt_tokens=10, max_tokens=16)


def test_the_governor_is_the_policy_and_sheds(tmp_path: Path) -> None:
    server, root = setup(tmp_path, api_key="key", admin="admin")
    gov = server.governor
    assert gov is not None and server.relay.policy is gov
    gov.tick()
    assert server.relay.policy.admit(REQUEST) is None  # 50%: admitted
    no_recycle = {"count": 0, "postponed": 0, "failed": 0, "bound_bytes": None,
                  "engine_drift_bytes": None, "front_drift_bytes": None, "last": None}  # fmt: skip
    assert health_body(server)["extra"] == {
        "governor": {"level": "normal", "pressure_pct": 50.0, "n_ctx": 2048, "n_ctx_full": 2048,
                     "recycle": no_recycle}  # the leak check: the engine has not served yet
    }  # fmt: skip
    (root / CG / "memory.current").write_text(f"{900 * MIB}\n")
    gov.tick()
    refusal = server.relay.policy.admit(REQUEST)
    assert isinstance(refusal, OverloadedError)
    assert (refusal.code, refusal.retry_after_s) == ("memory_shedding", 1)
    assert "memory" in server.degraded_reasons()  # /health says degraded
    text = generate_latest(server.metrics.registry).decode()
    assert 'slmguard_governor_level{level="shed"} 1.0' in text
    assert 'slmguard_governor_rejections_total{reason="memory_shedding"} 1.0' in text
    assert "slmguard_governor_working_set_bytes 9.437184e+08" in text
    (root / CG / "memory.current").write_text(f"{100 * MIB}\n")
    gov.tick()
    gov.tick()
    assert "memory" not in server.degraded_reasons()


def client(server: Server) -> Any:
    return TestClient(create_app(server))


def test_an_admin_token_equal_to_the_api_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="admin token equals the API key"):
        setup(tmp_path, api_key="same", admin="same")


def test_trim_without_session_store_or_engine(tmp_path: Path) -> None:
    server, _root = setup(tmp_path, api_key=None, admin="admin")
    with client(server) as c:
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


def test_no_governor_no_policy_and_no_admin_routes(tmp_path: Path) -> None:
    server = Server(
        ServeSettings(state_dir=tmp_path, governor=False), ServedModel("m", "/m", 1),
        EngineConfig(model_path="/m", n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1),
        binary=Path("/x"), version="", tokens=Tokens(None, None), sessions=None,
        state_dir=tmp_path, runtime_dir=tmp_path / "run", governor=None,
    )  # fmt: skip
    assert server.governor is None and server.relay.policy.max_tokens_cap() is None
    assert server.relay.policy.admit(REQUEST) is None
    with client(server) as c:
        assert c.get("/api/v1/governor").status_code == 404
    assert health_body(server)["extra"] == {}
