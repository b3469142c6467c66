"""``/v1/rerank`` end to end: a real ``slmguard serve`` and the real engine with a real
reranking model (the tiny BERT cross-encoder of ``tests/rerankmodel.py``, written for
the session: rank pooling, a classification head, a WordPiece vocabulary).

Its weights are random, so its scores mean nothing: the tests check what the front and
the engine do with them (one result per document, the engine's order, ``top_n``, the
usage and the metrics, the bounds), never which document is the most relevant. The
server is planned for this host as ``serve`` does without ``--plan`` (2 slots of 256
tokens: ``--n-ctx 512``, ``--n-parallel 2``), with an API key and an idle canary every
second; a second one serves the same model given a rerank prompt template, which the
engine renders and tokenizes with its special tokens parsed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serveproc import REQUEST_TIMEOUT_S, ServerProcess, engine_available, free_port, start_server
from waiting import scaled, wait_for

pytestmark = pytest.mark.engine

KEY = "sk-rerank-test"
MODEL = "tiny-bert-reranker"  # the file's stem: the served model id
QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital of france",
    "the cat sat on the mat",
    "berlin is a city in germany",
    "coffee with milk and bread for breakfast",
    "the river runs through the town",
]
SLOT_CTX = 256


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, rerank_model: Path) -> Iterator[ServerProcess]:
    s = start_server(
        tmp_path_factory.mktemp("rerank-serve"),
        [
            "--model",
            str(rerank_model),
            "--n-parallel",
            "2",
            "--n-ctx",
            str(2 * SLOT_CTX),
            "--canary-interval-s",
            "1",
        ],
        api_key=KEY,
    )
    try:
        yield s
    finally:
        s.stop()


def post(srv: ServerProcess, path: str, body: Any) -> httpx.Response:
    """POST ``body`` as JSON (escaped: a lone surrogate is sent as ``\\ud800``)."""
    return httpx.post(srv.url + path, content=json.dumps(body),
                      headers={"Authorization": f"Bearer {KEY}",
                               "Content-Type": "application/json"},
                      timeout=REQUEST_TIMEOUT_S)  # fmt: skip


def rerank(srv: ServerProcess, **fields: Any) -> httpx.Response:
    return post(srv, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS,
                                    **fields})  # fmt: skip


def metric(srv: ServerProcess, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


# ------------------------------------------------------------------ the engine alone


def test_the_engine_itself_loads_the_fixture_and_reranks(rerank_model: Path) -> None:
    """The fixture is a model llama-server reranks with, before the front is involved."""
    from slmguard.serve.llamaserver import find_llama_server

    if not engine_available():
        pytest.skip("the llama-server binary is not there (run `make`)")
    port = free_port()
    proc = subprocess.Popen(
        [str(find_llama_server()), "--model", str(rerank_model), "--reranking", "--host",
         "127.0.0.1", "--port", str(port), "--ctx-size", "512", "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert proc.poll() is None, f"llama-server exited with {proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/health", timeout=scaled(5)).status_code == 200
            return False

        wait_for(ready, 120, "llama-server to load the fixture")
        resp = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS},
                          timeout=REQUEST_TIMEOUT_S)  # fmt: skip
        assert resp.status_code == 200, resp.text
        results = resp.json()["results"]
        assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
        tokens = httpx.post(
            url + "/tokenize", json={"content": "Paris, France!", "with_pieces": True}
        ).json()["tokens"]
        assert [t["piece"] for t in tokens] == [" paris", " ,", " france", " !"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(scaled(10))


# ------------------------------------------------------------------ answers


def test_rerank_scores_every_document_in_the_engines_order(srv: ServerProcess) -> None:
    resp = rerank(srv)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["object"] == "list" and data["model"] == MODEL
    results = data["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    scores = [r["relevance_score"] for r in results]
    assert all(isinstance(s, float) for s in scores)
    assert scores == sorted(scores, reverse=True)  # the engine's order: best first
    assert len(set(scores)) == len(scores)  # the documents differ, so do their scores
    usage = data["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0
    again = rerank(srv).json()["results"]
    assert again == results  # the same request, the same scores and order


def test_top_n_keeps_the_best_n_of_the_same_order(srv: ServerProcess) -> None:
    full = rerank(srv).json()["results"]
    for n in (1, 2, len(DOCUMENTS), len(DOCUMENTS) + 10):
        resp = rerank(srv, top_n=n)
        assert resp.status_code == 200, resp.text
        assert resp.json()["results"] == full[:n]


def test_one_document_and_a_full_slot_of_them(srv: ServerProcess) -> None:
    one = rerank(srv, documents=["paris"])
    assert one.status_code == 200, one.text
    assert [r["index"] for r in one.json()["results"]] == [0]
    many = [f"document {i} about the city" for i in range(256)]
    resp = rerank(srv, documents=many, top_n=3)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["results"]) == 3


def test_rerank_is_counted_in_the_metrics_with_the_engines_prompt_tokens(
    srv: ServerProcess,
) -> None:
    ok = 'slmguard_requests_total{endpoint="rerank",outcome="ok"}'
    before_ok, before_tokens = metric(srv, ok), metric(srv, "slmguard_prompt_tokens_total")
    usage = rerank(srv).json()["usage"]
    assert metric(srv, ok) == before_ok + 1
    assert metric(srv, "slmguard_prompt_tokens_total") == before_tokens + usage["prompt_tokens"]


def test_openapi_lists_rerank_with_its_bounds(srv: ServerProcess) -> None:
    doc = httpx.get(srv.url + "/openapi.json").json()
    op = doc["paths"]["/v1/rerank"]["post"]
    assert "404" in op["responses"]
    schema = doc["components"]["schemas"]["RerankRequest"]
    assert schema["properties"]["model"]["enum"] == [MODEL]
    assert schema["properties"]["documents"]["maxItems"] == 256
    assert schema["properties"]["query"]["minLength"] == 1


# ------------------------------------------------------------------ bounds


def _refused(resp: httpx.Response, status: int, code: str, param: str) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    return str(err["message"])


def test_the_bounds_are_400_naming_the_field(srv: ServerProcess) -> None:
    too_many = [f"d{i}" for i in range(257)]
    _refused(rerank(srv, documents=too_many), 400, "invalid_value", "documents")
    _refused(rerank(srv, documents=[]), 400, "invalid_value", "documents")
    _refused(rerank(srv, query=""), 400, "invalid_value", "query")
    _refused(rerank(srv, query=["a"]), 400, "invalid_value", "query")
    _refused(rerank(srv, documents=["a", 5]), 400, "invalid_value", "documents.1")
    _refused(rerank(srv, top_n=0), 400, "invalid_value", "top_n")
    _refused(rerank(srv, return_documents=True), 400, "unsupported_parameter",
             "return_documents")  # fmt: skip
    _refused(rerank(srv, texts=["a"]), 400, "unsupported_parameter", "texts")
    _refused(rerank(srv, model="gpt-4o-mini"), 404, "model_not_found", "model")


def test_hostile_strings_are_refused_or_scored_as_text(srv: ServerProcess) -> None:
    for where in ("query", "documents.2"):
        field, _, i = where.partition(".")
        bad: Any = "\ud800 paris" if not i else [*DOCUMENTS[:2], "\ud800 paris"]
        _refused(rerank(srv, **{field: bad}), 400, "invalid_text", where)
    # Text is text: a NUL, the model's own special tokens, control characters and
    # characters outside the vocabulary are scored as what they say (the engine
    # tokenizes a rerank query and document without parsing special tokens).
    odd = ["a\0b", "[SEP] [CLS] paris", "\x1b[31m\u202e\u200b", "\u65e5\u672c \U0001f600", " "]
    resp = rerank(srv, documents=odd)
    assert resp.status_code == 200, resp.text
    assert sorted(r["index"] for r in resp.json()["results"]) == list(range(len(odd)))


def test_a_document_too_long_for_one_slot_is_400_naming_it(srv: ServerProcess) -> None:
    """Each (query, document) pair is one engine task in one slot, computed in one batch
    (an encoder's attention is not causal): a longer one is the client's 400, never the
    engine's 500 (it answers `input is too large to process`)."""
    long = " ".join(["city"] * (SLOT_CTX + 10))
    message = _refused(rerank(srv, documents=["paris", long]), 400, "context_length_exceeded",
                       "documents.1")  # fmt: skip
    assert f"{SLOT_CTX} tokens" in message
    long_query = " ".join(["city"] * (SLOT_CTX + 10))
    _refused(rerank(srv, query=long_query), 400, "context_length_exceeded", "query")
    # Just within one slot: scored.
    fits = " ".join(["city"] * (SLOT_CTX - 20))
    assert rerank(srv, query="paris", documents=[fits]).status_code == 200


# ------------------------------------------------------------------ a rerank template

#: A rerank prompt template in the GGUF: the engine renders it and parses its special
#: tokens (a Qwen3-Reranker's is its chat turns; this one is BERT's own pair).
TEMPLATE = "[CLS] {query} [SEP] {document} [SEP]"


@pytest.fixture(scope="module")
def templated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from rerankmodel import write_reranker

    tmp = tmp_path_factory.mktemp("rerank-template")
    model = write_reranker(tmp / f"{MODEL}.gguf", template=TEMPLATE)
    s = start_server(tmp, ["--model", str(model), "--n-parallel", "2", "--n-ctx",
                           str(2 * SLOT_CTX)], api_key=KEY)  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def test_a_rerank_templates_control_tokens_are_refused_in_the_texts(
    templated: ServerProcess,
) -> None:
    """With a template the engine parses special tokens in the query and the documents
    too: a [SEP] in a document would end it and start another part of the prompt."""
    ok = rerank(templated)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["results"]) == len(DOCUMENTS)
    forged = rerank(templated, documents=["paris", "paris [SEP] is the capital"])
    _refused(forged, 400, "control_token_in_message", "documents.1")
    _refused(rerank(templated, query="[CLS] paris"), 400, "control_token_in_message", "query")
    # Brackets that are no control token are text.
    assert rerank(templated, documents=["[paris] [sep"]).status_code == 200


def test_a_rerank_templates_pairs_are_counted_exactly(templated: ServerProcess) -> None:
    """[CLS] paris [SEP] + k words + [SEP]: k + 4 tokens, within one slot of 256 when
    k + 4 + 1 <= 256 (the front keeps one token of room, as for a generation)."""
    fits = rerank(templated, query="paris", documents=[" ".join(["city"] * 251)])
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["prompt_tokens"] == 251 + 4
    over = rerank(templated, query="paris", documents=[" ".join(["city"] * 252)])
    message = _refused(over, 400, "context_length_exceeded", "documents.0")
    assert "256 tokens" in message and "256 tokens, the query alone 4" in message


# ------------------------------------------------------------------ the other routes


def test_embeddings_on_a_reranker_is_404_naming_the_reason(srv: ServerProcess) -> None:
    """llama-server would answer with a vector read past the end of the one score it
    computed (n_embd floats out of an array of n_cls_out)."""
    resp = post(srv, "/v1/embeddings", {"model": MODEL, "input": "paris"})
    assert resp.status_code == 404, resp.text
    err = resp.json()["error"]
    assert err["code"] == "embeddings_unsupported" and "reranker" in err["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ],
)
def test_generation_on_a_reranker_is_404_naming_the_reason(
    srv: ServerProcess, path: str, body: dict[str, Any]
) -> None:
    """The engine runs a reranker without a decoder's logits: a generation would be its
    500 (`the current context does not support logits computation`)."""
    resp = post(srv, path, {"model": MODEL, **body})
    assert resp.status_code == 404, resp.text
    data = resp.json()
    message = data["error"]["message"]
    assert "generat" in message and "/v1/rerank" in message
    if path != "/v1/messages":
        assert data["error"]["code"] == "generation_unsupported"


def test_tokenize_uses_the_rerankers_vocabulary(srv: ServerProcess) -> None:
    resp = post(srv, "/tokenize", {"content": "Paris", "with_pieces": True})
    assert resp.status_code == 200, resp.text
    assert [t["piece"] for t in resp.json()["tokens"]] == [" paris"]


# ------------------------------------------------------------------ liveness, the plan


def test_the_liveness_probes_run_on_a_reranker(srv: ServerProcess) -> None:
    """The front's own step probe and idle canary are reranks on a reranker (a one-token
    generation would be the engine's 500 every time): the step is measured, the canary
    answers (the server runs a canary every second while idle)."""

    def probed() -> dict[str, Any] | None:
        live: dict[str, Any] = (srv.health() or {}).get("liveness") or {}
        # The step probe's two batches, then a canary.
        return live if live.get("step_s") is not None and live["canaries"] >= 3 else None

    live = wait_for(probed, 120, "the step probe and a canary", interval_s=1.0)
    assert isinstance(live["step_s"], float), live
    log = srv.log_path.read_text(errors="replace")  # the whole log, from the start
    assert "answered 500" not in log and "logits computation" not in log, log[-4000:]


def test_serve_plans_a_reranker_for_this_host(rerank_model: Path) -> None:
    """Without --plan, serve plans for its host: a BERT reranker gets slots of its trained
    context (512 tokens), a batch that holds a whole slot, and no KV cache (llama.cpp
    runs BERT without one: its load log has no ``llama_kv_cache`` line)."""
    from rerankmodel import N_CTX_TRAIN
    from slmguard.serve.modelcheck import plan_host

    plan = plan_host(rerank_model, fork=False).plan
    e = plan.engine
    assert e.n_ctx // e.n_parallel == N_CTX_TRAIN
    assert e.n_ubatch == e.n_batch == N_CTX_TRAIN
    assert plan.model.n_ctx_train == N_CTX_TRAIN
    kv = plan.part("kv_cache")
    assert kv is not None and kv.bytes == 0, kv
    assert "without a KV cache" in plan.reasons["kv_type"]


def test_the_governor_never_shrinks_a_reranker(srv: ServerProcess) -> None:
    """The served governor knows the reranker has no KV cache: nothing per token, and a
    context shrink (an engine restart that frees nothing) is off its ladder."""
    data = httpx.get(srv.url + "/api/v1/governor", headers=srv.headers(), timeout=30).json()
    assert data["kv_bytes_per_token"] == 0 and data.get("kv_cache") is False, data
    assert data["resizes"] == [] and data["n_ctx"] == data["n_ctx_full"] == 2 * SLOT_CTX


def test_health_and_models_describe_the_reranker(srv: ServerProcess) -> None:
    health = srv.health() or {}
    assert health["model"] == MODEL and health["engine"]["n_ctx_slot"] == SLOT_CTX
    models = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert [m["id"] for m in models.json()["data"]] == [MODEL]
    assert json.dumps(models.json())  # every field serializable
