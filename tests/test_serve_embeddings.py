"""``/v1/embeddings`` end to end: a real ``slmguard serve`` and the real engine with a real
embedding model (the encoder of ``tests/rerankmodel.py`` with mean pooling and no
classification head, written for the session).

Its weights are random: the tests check shapes, counts and refusals, never what a
vector means. 2 slots of 256 tokens, an API key, an idle canary every second.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serveproc import REQUEST_TIMEOUT_S, ServerProcess, start_server
from waiting import wait_for

pytestmark = pytest.mark.engine

KEY = "sk-embeddings-test"
MODEL = "tiny-bert-embedder"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, embedding_model: Path) -> Iterator[ServerProcess]:
    s = start_server(
        tmp_path_factory.mktemp("embed-serve"),
        ["--model", str(embedding_model), "--n-parallel", "2", "--n-ctx", "512",
         "--canary-interval-s", "1"],
        api_key=KEY,
    )  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def post(srv: ServerProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=REQUEST_TIMEOUT_S)  # fmt: skip


def test_embeddings_answer_one_normalized_vector_per_input(srv: ServerProcess) -> None:
    from rerankmodel import N_EMBD

    resp = post(srv, "/v1/embeddings", {"model": MODEL, "input": ["paris", "the cat sat"]})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert [d["index"] for d in data["data"]] == [0, 1]
    for d in data["data"]:
        assert len(d["embedding"]) == N_EMBD
        assert math.isclose(math.hypot(*d["embedding"]), 1.0, rel_tol=1e-3)
    assert data["usage"]["prompt_tokens"] > 0


def test_rerank_and_generation_on_an_embedding_model_are_404(srv: ServerProcess) -> None:
    resp = post(srv, "/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a"]})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "rerank_unsupported"
    resp = post(srv, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert resp.status_code == 404, resp.text
    err = resp.json()["error"]
    assert err["code"] == "generation_unsupported" and "/v1/embeddings" in err["message"]


def test_the_liveness_probes_are_embeddings(srv: ServerProcess) -> None:
    def probed() -> dict[str, Any] | None:
        live: dict[str, Any] = (srv.health() or {}).get("liveness") or {}
        return live if live.get("step_s") is not None and live["canaries"] >= 3 else None

    live = wait_for(probed, 120, "the step probe and a canary", interval_s=1.0)
    assert isinstance(live["step_s"], float), live
    log = srv.log_path.read_text(errors="replace")
    assert "answered 500" not in log and "logits computation" not in log, log[-4000:]
