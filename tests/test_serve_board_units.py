"""A server of several models, built and not started (issue 39): the table of engines,
what /v1/models, /health, /metrics and the governor's status say of every model, the
queue a loading model's requests wait in, the plan's resident sets without a governor.
No engine runs here (tests/test_serve_board.py runs them)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from slmguard.errors import ConfigError, NotFoundError, QueueFullError
from slmguard.governor.policy import Thresholds
from slmguard.governor.runtime import GovernorConfig
from slmguard.serve.app import create_app
from slmguard.serve.llamaserver import EngineConfig
from slmguard.serve.modelengine import Residency, ServedEngine
from slmguard.serve.queue import SlotQueue
from slmguard.serve.routes import health_body
from slmguard.serve.served import ServedModel
from slmguard.serve.server import Server
from slmguard.settings import ServeSettings, Tokens

MIB = 1 << 20


def config(path: str, n_ctx: int = 512) -> EngineConfig:
    return EngineConfig(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=1)


def board(tmp_path: Path, *, governor: bool = True, sets: tuple[frozenset[str], ...] = ()
          ) -> Server:  # fmt: skip
    chat = ServedModel("chat", "/m/chat.gguf", 1, aliases=("gemma",), n_vocab=100)
    embed = ServedModel("embed", "/m/embed.gguf", 1, embeddings=True, n_vocab=50,
                        role="embedding")  # fmt: skip
    big = ServedModel("big", "/m/big.gguf", 1, n_vocab=100)
    others = (
        ServedEngine(embed, config("/m/embed.gguf"), Residency("on_demand", 30, 2.0, 70 * MIB)),
        ServedEngine(big, config("/m/big.gguf", 2048), Residency("on_demand", 20, 0.0, 300 * MIB)),
    )  # fmt: skip
    return Server(
        ServeSettings(state_dir=tmp_path, queue_size=2), chat, config("/m/chat.gguf", 1024),
        binary=Path("/nonexistent/llama-server"), version="", tokens=Tokens(None, None),
        sessions=None, state_dir=tmp_path, runtime_dir=tmp_path / "run",
        governor=GovernorConfig(thresholds=Thresholds(recover_hold_s=0.0)) if governor else None,
        residency=Residency(priority=100), others=others, resident_sets=sets,
    )  # fmt: skip


def test_the_table_finds_every_name_and_orders_by_priority(tmp_path: Path) -> None:
    server = board(tmp_path)
    models = server.models
    assert models.several and len(models) == 3 and models.primary.name == "chat"
    assert models.names() == ("chat", "gemma", "embed", "big")
    assert models.get("gemma") is models.primary and models.get("big").name == "big"
    with pytest.raises(NotFoundError, match="'nope' is not served here; this server serves "
                       "'chat', 'gemma', 'embed', 'big'"):  # fmt: skip
        models.get("nope")
    assert [m.name for m in models.by_priority()] == ["big", "embed", "chat"]
    # Each model has its own engine, queue, runtime directory and bounds.
    assert len({id(m.engine) for m in models}) == 3
    assert len({m.engine.runtime_dir for m in models}) == 3
    assert models.get("embed").bounds.limits.n_vocab == 50
    # The on-demand ones start unloaded, the pinned one does not.
    assert [m.state for m in models] == ["loading", "unloaded", "unloaded"]


def test_a_name_given_twice_is_refused(tmp_path: Path) -> None:
    server = board(tmp_path)
    clash = ServedModel("other", "/m/o.gguf", 1, aliases=("embed",))
    with pytest.raises(ConfigError, match="'embed' is given to two models"):
        type(server.models)([*server.models, _engine(server, clash)])


def _engine(server: Server, model: ServedModel) -> Any:
    from slmguard.serve.modelengine import EngineHome, ModelEngine

    home = EngineHome(Path("/x"), "", server.runtime_dir / "clash", server.state_dir)
    return ModelEngine(server.settings, model, config("/m/o.gguf"), home, metrics=server.metrics,
                       sessions=None)  # fmt: skip


def test_models_health_and_metrics_name_every_model(tmp_path: Path) -> None:
    server = board(tmp_path)
    with TestClient(create_app(server)) as c:
        cards = c.get("/v1/models").json()["data"]
        assert [card["id"] for card in cards] == ["chat", "gemma", "embed", "big"]
        embed = next(card for card in cards if card["id"] == "embed")["slmguard"]
        assert (embed["residency"], embed["priority"], embed["state"]) == (
            "on_demand", 30, "unloaded"
        )  # fmt: skip
        assert c.get("/v1/models/gemma").json()["slmguard"]["model"] == "chat"
        assert c.get("/v1/models/nope").status_code == 404
        enum = c.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
        assert enum["properties"]["model"]["enum"] == ["chat", "gemma", "embed", "big"]
        # A route the model cannot answer: 404 before anything is loaded.
        resp = c.post("/v1/completions", json={"model": "embed", "prompt": "x"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "generation_unsupported"
        assert server.models.get("embed").state == "unloaded"
    body = health_body(server)
    assert body["model"] == "chat"  # the primary's keys as a one-model server's
    assert [(m["model"], m["residency"], m["state"]) for m in body["models"]] == [
        ("chat", "pinned", "loading"), ("embed", "on_demand", "unloaded"),
        ("big", "on_demand", "unloaded"),
    ]  # fmt: skip
    text = generate_latest(server.metrics.registry).decode()
    assert 'slmguard_slots{model="big"} 1.0' in text
    assert 'slmguard_queue_depth{model="embed"} 0.0' in text
    assert 'slmguard_kv_cells_total{model="chat",slot="0"}' not in text  # no /slots yet
    assert "slmguard_front_rss_bytes " in text  # the front's own: no model label
    gov = server.governor
    assert gov is not None
    status = gov.status()
    assert [(m["model"], m["priority"], m["residency"]) for m in status["models"]] == [
        ("chat", 100, "pinned"), ("embed", 30, "on_demand"), ("big", 20, "on_demand"),
    ]  # fmt: skip


def test_one_model_keeps_its_answers_unlabelled(tmp_path: Path) -> None:
    server = Server(
        ServeSettings(state_dir=tmp_path), ServedModel("m", "/m", 1), config("/m"),
        binary=Path("/x"), version="", tokens=Tokens(None, None), sessions=None,
        state_dir=tmp_path, runtime_dir=tmp_path / "run", governor=GovernorConfig(),
    )  # fmt: skip
    assert "models" not in health_body(server) and "models" not in server.governor.status()  # type: ignore[union-attr]
    text = generate_latest(server.metrics.registry).decode()
    assert "slmguard_slots 1.0" in text and 'model="' not in text
    assert server.relay.policy is server.governor


def test_a_loading_model_queues_within_the_capacity() -> None:
    async def scenario() -> None:
        queue = SlotQueue(1, 2)
        with queue.loading(), queue.loading():
            assert queue.waiting == 2
            with pytest.raises(QueueFullError), queue.loading():
                pass
            taken = await queue.acquire()  # a free slot is taken at once, loaders or not
            with pytest.raises(QueueFullError):
                await queue.acquire()  # one that must wait finds the queue full of loaders
            queue.release(taken)
        assert queue.waiting == 0
        assert await queue.acquire() == 1

    asyncio.run(scenario())


def test_without_a_governor_the_plans_sets_decide(tmp_path: Path) -> None:
    sets = (frozenset({"chat", "big"}), frozenset({"chat", "embed"}))
    server = board(tmp_path, governor=False, sets=sets)
    policy = server.residency.policy
    assert policy.room_for("big").refusal is None  # nothing else on demand is in memory
    big = server.models.get("big")
    big._unloaded = False  # as if loaded
    room = policy.room_for("embed")
    assert room.evict == ("big",) and room.refusal is None
    big.users = 1  # busy now: never evicted
    room = policy.room_for("embed")
    assert room.evict == () and room.refusal is not None
    assert "big stay in memory" in room.refusal.message
