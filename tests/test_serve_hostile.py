"""One client cannot take the service from the others: hostile requests against the real server.

Each request of issue 24 that crashed, wedged or bloated llama-server, or made the
front answer 500, is sent to a real ``slmguard serve`` (real engine, default model):
it gets a 400 naming the field (and the limit), and the engine neither crashes nor
restarts (same pid, ``restarts`` 0), alone or six in a row, while another client's
stream completes. Then a property-based run (Hypothesis, seeded and bounded) puts
generated JSON values (deep nesting, lone surrogates, huge numbers, long strings,
NULs) in every field of every JSON route: never a 5xx, the server stays ready and
the next normal request succeeds. The pure checks are in ``test_serve_bounds.py``.

Also here, because they are the same untrusted-input rule applied to the operator's
side: a plan cannot choose the engine binary, an admin token equal to the API key
is refused at start, ``--state-dir`` keeps the mode of a directory it did not make,
and the fault log is private.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from serveproc import (
    MODEL_ID,
    REQUEST_TIMEOUT_S,
    SLMGUARD,
    ServeFactory,
    ServerProcess,
    default_model_path,
    free_port,
    start_server,
)
from slmguard.serve.rendered import RENDERED_FIELDS
from waiting import wait_for

pytestmark = pytest.mark.engine

CHAT = "/v1/chat/completions"
TOKEN = "<end_of_turn>"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": HI, "max_tokens": 2, **fields}


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


# fmt: off
HOSTILE = [
    # id, path, body, the param of the 400
    ("grammar-20000-nested-parentheses", CHAT,
     chat(grammar="root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000), "grammar"),
    ("grammar-nesting", CHAT, chat(grammar="root ::= " + "(" * 200 + '"a"' + ")" * 200),
     "grammar"),
    ("grammar-100k-alternatives", COMPLETIONS,
     {"model": MODEL_ID, "prompt": "x", "grammar": "root ::= " + "|".join(['"a"'] * 10_000)},
     "grammar"),
    ("grammar-repetition", CHAT, chat(grammar='root ::= "a"{100000}'), "grammar"),
    ("grammar-nul", CHAT, chat(grammar='\0root ::= "a"'), "grammar"),
    ("repeat-last-n-250m", CHAT, chat(repeat_last_n=250_000_000), "repeat_last_n"),
    ("repeat-last-n-int-max", COMPLETIONS,
     {"model": MODEL_ID, "prompt": "x", "max_tokens": 2, "repeat_last_n": 2_147_483_647},
     "repeat_last_n"),
    ("top-k-beyond-vocabulary", CHAT, chat(top_k=10**9), "top_k"),
    ("max-tokens-beyond-the-slot", CHAT, chat(max_tokens=10**6), "max_tokens"),
    ("schema-enum-50k", CHAT, chat(json_schema={"enum": [str(i) for i in range(50_000)]}),
     "json_schema"),
    ("schema-max-items", CHAT, chat(json_schema={"type": "array", "maxItems": 10**6}),
     "json_schema.maxItems"),
    # Nested repetitions, each count within --max-repetition: the engine's decoding stopped
    # (no token in 30-60 s) for two levels of 100 in a pattern, 50 x 50 in named rules.
    ("pattern-nested-repetitions", COMPLETIONS,
     {"model": MODEL_ID, "prompt": "x", "max_tokens": 2,
      "json_schema": {"type": "string", "pattern": "^((a|b){0,100}){0,100}$"}},
     "json_schema.pattern"),
    ("grammar-nested-rules", CHAT,
     chat(grammar='root ::= "\\"" x{0,50} "\\""\nx ::= y{0,50}\ny ::= "a" | "b"'), "grammar"),
    # Ambiguous grammars within every other bound reach the engine, whose own bound stops
    # them alone (--grammar-max-work): tests/test_serve_grammarbound.py.
    ("json-schema-400-deep", CHAT, chat(json_schema=nested(400)), "json_schema.a.a"),
    ("tool-parameters-400-deep", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": nested(400)}}]),
     "tools.0.function"),
    ("response-format-400-deep", CHAT,
     chat(response_format={"type": "json_schema",
                           "json_schema": {"name": "x", "schema": nested(400)}}),
     "response_format.json_schema.schema"),
    ("template-kwargs-400-deep", CHAT, chat(chat_template_kwargs=nested(400)),
     "chat_template_kwargs.a.a"),
    ("template-kwargs-messages", CHAT,
     chat(chat_template_kwargs={"messages": [{"role": "user", "content": "<end_of_turn>"}]}),
     "chat_template_kwargs.messages"),
    ("surrogate-in-content", CHAT, chat(messages=[{"role": "user", "content": "\ud800"}]),
     "messages.0.content"),
    ("surrogate-in-stop", CHAT, chat(stop=["\ud800"]), "stop.0"),
    ("surrogate-in-grammar", CHAT, chat(grammar='root ::= "\ud800"'), "grammar"),
    ("surrogate-in-prompt", COMPLETIONS, {"model": MODEL_ID, "prompt": "\udc00"}, "prompt"),
    ("surrogate-in-tokenize", "/tokenize", {"content": "\ud800"}, "content"),
    ("surrogate-in-tool-arguments", CHAT,
     chat(messages=[*HI, {"role": "assistant", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "\ud800"}}]}]),
     "messages.1.tool_calls.0.function.arguments"),
    ("surrogate-in-template-kwargs", CHAT, chat(chat_template_kwargs={"x": "\ud800"}),
     "chat_template_kwargs.x"),
]
# fmt: on
CRASHERS = [
    "grammar-20000-nested-parentheses",
    "repeat-last-n-int-max",
    "schema-enum-50k",
    "json-schema-400-deep",
    "surrogate-in-content",
    "grammar-nul",
    "pattern-nested-repetitions",
]  # fmt: skip


def send(
    s: ServerProcess, path: str, body: Any, timeout_s: float = REQUEST_TIMEOUT_S
) -> httpx.Response:
    # ensure_ascii: a lone surrogate travels as the JSON escape a client would send.
    raw = json.dumps(body, ensure_ascii=True).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(s.url + path, content=raw, headers=headers, timeout=timeout_s)


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = start_server(tmp_path_factory.mktemp("hostile"), ["--max-tokens-cap", "4"])
    try:
        yield s
    finally:
        s.stop()


def unharmed(s: ServerProcess, pid: int) -> None:
    """Same engine, never restarted, ready, and a normal request answered."""
    health = s.health()
    assert health is not None and health["state"] == "ready", health
    assert health["engine"]["restarts"] == 0 and health["engine"]["pid"] == pid
    ok = send(s, CHAT, chat())
    assert ok.status_code == 200, ok.text
    assert s.engine_pid() == pid


@pytest.mark.parametrize(
    ("path", "body", "param"), [pytest.param(*c[1:], id=c[0]) for c in HOSTILE]
)
def test_a_hostile_request_is_a_400_naming_its_field(
    hostile_server: ServerProcess, path: str, body: Any, param: str
) -> None:
    pid = hostile_server.engine_pid()
    resp = send(hostile_server, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param or err["param"].startswith(param + "."), err
    assert err["type"] == "invalid_request_error"
    unharmed(hostile_server, pid)


def test_six_in_a_row_while_another_client_streams(hostile_server: ServerProcess) -> None:
    s = hostile_server
    pid = s.engine_pid()
    streamed: list[str] = []

    def other_client() -> None:
        body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", s.url + COMPLETIONS, json=body, timeout=REQUEST_TIMEOUT_S) as r:
            assert r.status_code == 200
            streamed.extend(line for line in r.iter_lines() if line.startswith("data: "))

    by_id = {c[0]: c for c in HOSTILE}
    for name in CRASHERS:
        _, path, body, _ = by_id[name]
        other = threading.Thread(target=other_client)
        other.start()
        statuses = [send(s, path, body).status_code for _ in range(6)]
        other.join(REQUEST_TIMEOUT_S)
        assert statuses == [400] * 6, name
        assert streamed and streamed[-1] == "data: [DONE]", name
        streamed.clear()
    unharmed(s, pid)


@pytest.mark.parametrize(
    ("raw", "content_type"),
    [(b"", "application/json"), (b"{", "application/json"), (b"{not json", "text/plain"),
     (b"", "text/plain"), (b'{"content": "\\ud800"}', "text/plain")],
)  # fmt: skip
def test_a_body_that_is_not_json_is_the_schemas_400(
    hostile_server: ServerProcess, raw: bytes, content_type: str
) -> None:
    for path in (CHAT, "/tokenize"):
        resp = httpx.post(hostile_server.url + path, content=raw,
                          headers={"Content-Type": content_type})  # fmt: skip
        assert resp.status_code == 400, (path, resp.text)


def test_openapi_states_the_bounds_of_this_server(hostile_server: ServerProcess) -> None:
    doc = httpx.get(hostile_server.url + "/openapi.json").json()
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]

    def maximum(name: str) -> int:
        return next(m["maximum"] for m in props[name]["anyOf"] if "maximum" in m)

    assert maximum("repeat_last_n") == maximum("max_tokens") == 512  # --n-ctx 512, one slot
    assert maximum("top_k") == 262_144  # Gemma 3's vocabulary
    resp = send(hostile_server, CHAT, chat(repeat_last_n=512, top_k=262_144))
    assert resp.status_code == 200, resp.text  # the bounds themselves are accepted


@pytest.mark.parametrize(
    ("death", "refused"),
    [(signal.SIGSEGV, True), (signal.SIGKILL, False)],
    ids=["crash-is-remembered", "oom-kill-is-not"],
)
def test_a_request_the_engine_crashed_running_is_refused_when_sent_again(
    serve_factory: ServeFactory, death: signal.Signals, refused: bool
) -> None:
    # A crash (SIGSEGV: a grammar of 20,000 nested parentheses did this) is the request's:
    # refused from then on. SIGKILL is the kernel's OOM killer (a neighbour took the
    # memory) or an operator: the request sent again is served.
    s = serve_factory()
    pid = s.engine_pid()
    body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", s.url + COMPLETIONS, json=body, timeout=REQUEST_TIMEOUT_S) as r:
        assert r.status_code == 200
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        next(events)  # decoding: the engine dies now, under this request
        os.kill(pid, death)
        rest = list(events)
    assert rest and '"error"' in rest[-1], rest[-3:]

    def restarted() -> bool:
        h = s.health()
        return h is not None and h["state"] == "ready" and h["engine"]["pid"] != pid

    wait_for(restarted, 120, "the engine restarted")
    if refused:
        again = send(s, COMPLETIONS, body)
        assert again.status_code == 400, again.text
        assert again.json()["error"]["code"] == "request_crashed_engine"
    else:  # the same request is served: its first event says so (not its 400 tokens)
        with httpx.stream("POST", s.url + COMPLETIONS, json=body, timeout=REQUEST_TIMEOUT_S) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert '"error"' not in first, first
    other = send(s, COMPLETIONS, {**body, "stream": False, "max_tokens": 2})
    assert other.status_code == 200, other.text


def test_the_control_token_check_holds_on_the_normal_path(hostile_server: ServerProcess) -> None:
    # What chat_template_kwargs.messages would have carried past it.
    resp = send(hostile_server, CHAT, chat(messages=[{"role": "user", "content": "<end_of_turn>"}]))
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "control_token_in_message"


ROUTE_OF = {"chat": CHAT, "messages": "/v1/messages", "responses": "/v1/responses"}


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
def test_no_control_token_reaches_the_engine_from_any_string(
    hostile_server: ServerProcess, dialect: str
) -> None:
    """Issue 37: ``<end_of_turn>`` in any string the template renders (a tool or
    parameter description, an enum value, a schema title, a tool-call name, a call id,
    an argument key, ...; every position of ``test_serve_rendered``'s bodies in turn) is
    refused before the engine generates: 400 naming that string's field when the
    request's schema takes the text (``param`` on OpenAI's routes, the message on
    Messages), the schema's own 400 where it does not (a role, a type). The same body
    without it is served."""
    from test_serve_rendered import BODIES, planted, positions

    s, route = hostile_server, ROUTE_OF[dialect]
    body = {**BODIES[dialect], "model": MODEL_ID}
    pid = s.engine_pid()
    fine = send(s, route, body)
    assert fine.status_code == 200, fine.text
    swept = [
        (path, key)
        for path, key in positions(body)
        if path[0] in RENDERED_FIELDS and not (key and len(path) == 1)
    ]
    with ThreadPoolExecutor(4) as pool:  # the engine's HTTP threads tokenize side by side
        answers = list(pool.map(lambda pk: send(s, route, planted(body, *pk)), swept))
    named = 0
    for (path, key), resp in zip(swept, answers, strict=True):
        assert resp.status_code == 400, (path, resp.text)
        err = resp.json()["error"]
        where = ".".join(str(p) for p in path[:-1]) + "." if len(path) > 1 else ""
        field = where + (f"{path[-1]}{TOKEN}" if key else str(path[-1]))
        if err.get("code") == "control_token_in_message" or "control token" in err["message"]:
            assert err.get("param", field) == field and field in err["message"], (path, err)
            named += 1
    assert named > 25, named  # most positions are free text the schema takes
    assert s.engine_pid() == pid


#: 20,000 messages (or items), each a few tokens: far more than one slot holds.
MANY = {
    "chat": {"model": MODEL_ID, "messages": HI * 20_000, "max_tokens": 2},
    "responses": {"model": MODEL_ID, "input": HI * 20_000, "max_output_tokens": 2},
    "messages": {"model": MODEL_ID, "messages": HI * 20_000, "max_tokens": 2},
}


@pytest.mark.parametrize("dialect", sorted(MANY))
def test_more_messages_than_the_slot_has_tokens_are_refused_before_the_engine(
    hostile_server: ServerProcess, dialect: str
) -> None:
    """Issue 37: a chat of 20,000 messages got a retryable 503 ("made no progress") after
    the engine spent 72-81 s rendering and counting it; each message is at least one token,
    so it is 400 ``context_length_exceeded`` naming the field before the engine sees it."""
    s = hostile_server
    pid = s.engine_pid()
    resp = send(s, ROUTE_OF[dialect], MANY[dialect])
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    field = "input" if dialect == "responses" else "messages"
    if dialect == "messages":  # Anthropic's shape: no code or param, the message names it
        assert err["message"].startswith(f"{field}: 20000 of them"), err
    else:
        assert err["code"] == "context_length_exceeded" and err["param"] == field, err
    unharmed(s, pid)


def test_prompts_that_together_overflow_the_slots_are_refused(
    hostile_server: ServerProcess,
) -> None:
    """Issue 37: one completion of many prompts (at most 64), each fitting a slot, queued
    their sum (256,000 prompt tokens from 768 KB) in the engine; now the prompts of a request
    together hold at most what the slots hold at once (each prompt once per choice)."""
    s = hostile_server
    pid = s.engine_pid()
    card = httpx.get(f"{s.url}/v1/models/{MODEL_ID}", timeout=REQUEST_TIMEOUT_S).json()
    slot, slots = card["slmguard"]["n_ctx_slot"], card["slmguard"]["slots"]
    each = [2] + [1000] * (slot - 8)  # token ids: fits one slot with its 2 answer tokens
    fine = {"model": MODEL_ID, "prompt": [[2, 1000]] * (slots + 1), "max_tokens": 2}
    assert send(s, COMPLETIONS, fine).status_code == 200
    bodies = [
        {"model": MODEL_ID, "prompt": [each] * (slots + 1), "max_tokens": 2},
    ]
    if slots > 1:
        bodies.append({"model": MODEL_ID, "prompt": [each] * slots, "n": 2, "max_tokens": 2})
    for body in bodies:
        resp = send(s, COMPLETIONS, body)
        assert resp.status_code == 400, resp.text[:300]
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    unharmed(s, pid)


#: Routes that keep no session, each with a valid body.
SESSIONLESS = {
    COMPLETIONS: {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2},
    "/v1/responses": {"model": MODEL_ID, "input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL_ID, "messages": HI, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL_ID, "messages": HI},
    "/v1/embeddings": {"model": MODEL_ID, "input": "Hi"},
    "/v1/rerank": {"model": MODEL_ID, "query": "q", "documents": ["a"]},
}


@pytest.mark.parametrize("route", sorted(SESSIONLESS))
def test_a_session_header_where_no_session_is_kept_is_refused(
    hostile_server: ServerProcess, route: str
) -> None:
    """Issue 37: an X-Session-Id header on completions, Responses or Messages was accepted
    and ignored (the body's ``session_id`` is refused there): the client believed its
    conversation kept. Now 400 naming the header; without it the route answers as before."""
    s = hostile_server
    headers = {"Content-Type": "application/json", "X-Session-Id": "conv-1"}
    body = json.dumps(SESSIONLESS[route]).encode()
    resp = httpx.post(s.url + route, content=body, headers=headers, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert "X-Session-Id" in err["message"], err
    if "param" in err:
        assert err["param"] == "X-Session-Id", err
    plain = send(s, route, SESSIONLESS[route])
    assert plain.status_code != 400, plain.text  # 200, or 404 where the model cannot serve it


def test_two_session_headers_are_refused(hostile_server: ServerProcess) -> None:
    """Issue 37: with two X-Session-Id headers the first silently won; which session the
    client meant is not guessed."""
    s = hostile_server
    headers = [("Content-Type", "application/json"), ("X-Session-Id", "conv-a"),
               ("X-Session-Id", "conv-b")]  # fmt: skip
    resp = httpx.post(s.url + CHAT, content=json.dumps(chat()).encode(), headers=headers,
                      timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "invalid_session_id" and err["param"] == "X-Session-Id", err
    one = httpx.post(s.url + CHAT, content=json.dumps(chat()).encode(), headers=headers[:2],
                     timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    assert one.status_code == 200, one.text


#: A tool call required of a request without tools, on each route, and the field named.
REQUIRED_WITHOUT_TOOLS = [
    (CHAT, chat(tool_choice="required"), "tool_choice"),
    ("/v1/responses", {"model": MODEL_ID, "input": "Hi", "max_output_tokens": 2,
                       "tool_choice": "required"}, "tool_choice"),
    ("/v1/messages", {"model": MODEL_ID, "messages": HI, "max_tokens": 2,
                      "tool_choice": {"type": "any"}}, "tool_choice"),
    ("/v1/messages", {"model": MODEL_ID, "messages": HI, "max_tokens": 2,
                      "thinking": {"type": "enabled", "budget_tokens": 10**12}},
     "thinking.budget_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "field"), REQUIRED_WITHOUT_TOOLS)
def test_what_the_engine_cannot_honour_is_a_400_naming_it(
    hostile_server: ServerProcess, route: str, body: dict[str, Any], field: str
) -> None:
    """Issue 37: ``tool_choice`` required (Anthropic's ``any``) of a request without tools
    answered 200 with plain text, and Messages took ``thinking.budget_tokens`` 10^12; each
    is now a 400 naming the field (``param``, or Anthropic's message)."""
    resp = send(hostile_server, route, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err.get("param", field) == field and field in err["message"], err
    fine = {k: v for k, v in body.items() if k not in ("tool_choice", "thinking")}
    assert send(hostile_server, route, fine).status_code == 200


# ------------------------------------------------------------------ generated values everywhere

#: Every JSON route, a valid body, and the fields (dotted paths) a value is put in.
ROUTES: dict[str, tuple[dict[str, Any], list[str]]] = {
    CHAT: (
        chat(),
        [
            "model",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "n",
            "stream",
            "stop",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "top_k",
            "min_p",
            "typical_p",
            "repeat_penalty",
            "repeat_last_n",
            "mirostat",
            "mirostat_tau",
            "mirostat_eta",
            "grammar",
            "json_schema",
            "logprobs",
            "top_logprobs",
            "response_format",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "reasoning_effort",
            "chat_template_kwargs",
            "session_id",
            "stream_options",
            "messages",
            "messages.0.content",
            "messages.0.role",
            "messages.0.name",
            "unknown_field",
        ],
    ),
    COMPLETIONS: (
        {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2},
        [
            "model",
            "prompt",
            "max_tokens",
            "logprobs",
            "echo",
            "stop",
            "grammar",
            "json_schema",
            "repeat_last_n",
            "top_k",
            "seed",
            "n",
            "logit_bias",
        ],
    ),
    "/v1/embeddings": ({"model": MODEL_ID, "input": "Hi"}, ["model", "input", "encoding_format"]),
    "/tokenize": ({"content": "Hi"}, ["content", "add_special", "parse_special", "with_pieces"]),
    "/detokenize": ({"tokens": [1, 2]}, ["tokens"]),
}
FIELDS = [(path, field) for path, (_, fields) in ROUTES.items() for field in fields]

_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(1 << 80), max_value=1 << 80),
    st.sampled_from([2_147_483_647, 250_000_000, -1, 0, 10**18, 1 << 64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["\ud800", "a\udfffb", "\0", "\0root ::= x", "<end_of_turn>", "x" * 70_000,
                     "root ::= " + "(" * 5000 + ")" * 5000, "é\U0001f600"]),
)  # fmt: skip
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)  # fmt: skip
VALUES = st.one_of(
    _json,
    st.integers(min_value=60, max_value=700).map(nested),
    st.integers(min_value=60, max_value=700).map(lambda d: nested(d, "\ud800")),
)


def put(body: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    parts = field.split(".")
    target = out
    for part in parts[:-1]:
        target = target[int(part)] if part.isdigit() else target[part]
    target[parts[-1]] = value
    return out


@settings(
    max_examples=120, derandomize=True, database=None, deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)  # fmt: skip
@given(where=st.sampled_from(FIELDS), value=VALUES)
def test_generated_values_in_every_field_never_get_a_5xx(
    hostile_server: ServerProcess, where: tuple[str, str], value: Any
) -> None:
    path, field = where
    body = put(ROUTES[path][0], field, value)
    resp = send(hostile_server, path, body)
    assert resp.status_code < 500, (path, field, resp.text[:500])


def test_after_the_generated_values_the_server_is_unharmed(hostile_server: ServerProcess) -> None:
    # Runs after the property test (file order): the same engine, never restarted.
    health = hostile_server.health()
    assert health is not None
    unharmed(hostile_server, health["engine"]["pid"])


# ------------------------------------------------------------------ the operator's side


def run_serve(
    args: list[str], env: dict[str, str], timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")}
    return subprocess.run([SLMGUARD, "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, env={**base, **env},
                          timeout=timeout_s)  # fmt: skip


def test_a_plan_cannot_choose_the_engine_binary(tmp_path: Path) -> None:
    model = default_model_path()
    if not model.exists():
        pytest.skip("default model not prepared (run `slmguard model prepare`)")
    plan_text = subprocess.run([SLMGUARD, "plan", "--model", str(model), "--json"],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    plan = json.loads(plan_text)
    marker = tmp_path / "ran"
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    binary.chmod(0o755)
    plan["engine"]["llama_server"] = str(binary)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    env = {"SLMGUARD_STATE_DIR": str(tmp_path / "state")}
    refused = run_serve(["--plan", str(plan_file)], env)
    assert refused.returncode == 78, refused.stderr
    assert "engine.llama_server" in refused.stderr and "--llama-server" in refused.stderr
    assert not marker.exists()  # never run
    # The operator naming it on the command line is trusted (it runs, fails --version: 69).
    chosen = run_serve(["--plan", str(plan_file), "--llama-server", str(binary)], env)
    assert chosen.returncode == 69, chosen.stderr
    assert marker.exists()


def test_an_admin_token_equal_to_the_api_key_is_refused_at_start(tmp_path: Path) -> None:
    token = tmp_path / "admin"
    token.write_text("same-secret\n")
    result = run_serve(["--admin-token-file", str(token)],
                       {"SLMGUARD_API_KEY": "same-secret",
                        "SLMGUARD_STATE_DIR": str(tmp_path / "state")})  # fmt: skip
    assert result.returncode == 78, result.stderr
    assert "admin token equals the API key" in result.stderr
    assert "Traceback" not in result.stderr


def test_state_dir_keeps_the_mode_of_a_directory_it_did_not_make(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    busy = free_port()
    with socket.socket() as taken:  # the bind fails after the state directory is opened
        taken.bind(("127.0.0.1", busy))
        taken.listen(1)
        result = subprocess.run(
            [SLMGUARD, "serve", "--port", str(busy), "--state-dir", str(shared)],
            capture_output=True, text=True, timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")},
        )  # fmt: skip
    assert result.returncode == 78, result.stderr
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


def test_the_fault_log_is_private_and_engine_views_need_the_admin_token(tmp_path: Path) -> None:
    admin = tmp_path / "admin-token"
    admin.write_text("admin-secret\n")
    s = start_server(tmp_path, ["--no-sessions", "--admin-token-file", str(admin)], api_key="k")
    try:
        for path in ("/slots", "/props", "/engine/metrics"):
            keyed = httpx.get(s.url + path, headers={"Authorization": "Bearer k"})
            assert keyed.status_code == 401, (path, keyed.text)
            ok = httpx.get(s.url + path, headers={"Authorization": "Bearer admin-secret"})
            assert ok.status_code == 200, (path, ok.text)
        faults = s.state_dir / "faults"
        assert stat.S_IMODE(s.state_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(faults.stat().st_mode) == 0o700
        assert stat.S_IMODE((faults / "front.log").stat().st_mode) == 0o600
    finally:
        s.stop()
