"""The OpenAI surface llama-server implements, through the front, with the official client.

Real engine, real model. The embedded Gemma 3 270M is a base model without a
chat template, so the chat features that need one (tools) run with the
template fixture ``tests/fixtures/templates/tools-chatml.jinja``
(``--chat-template-file``), and the tool call is coaxed out of the base model
by a few-shot history in which the assistant always calls the tool: a base
model continues a pattern, and llama-server's grammar keeps the call well
formed once it starts.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from serveproc import MODEL_ID, REQUEST_TIMEOUT_S, ServeFactory, ServerProcess, scaled

pytestmark = pytest.mark.engine

TEMPLATE = Path(__file__).parent / "fixtures" / "templates" / "tools-chatml.jinja"

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _call(call_id: str, city: str) -> dict[str, Any]:
    function = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    return {"id": call_id, "type": "function", "function": function}


FEW_SHOT: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer every question by calling a function."},
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("c1", "Rome")]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny in Rome."},
    {"role": "user", "content": "What is the weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("c2", "Oslo")]},
    {"role": "tool", "tool_call_id": "c2", "content": "snow"},
    {"role": "assistant", "content": "It snows in Oslo."},
]


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=REQUEST_TIMEOUT_S)  # fmt: skip


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from serveproc import start_server

    s = start_server(
        tmp_path_factory.mktemp("tools"),
        ["--chat-template-file", str(TEMPLATE), "--n-ctx", "2048", "--no-governor"],
    )
    try:
        yield s
    finally:
        s.stop()


def test_json_schema_output_parses_and_validates(server: ServerProcess) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }  # fmt: skip
    resp = client(server).chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "A city and its population, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        max_tokens=48,
        temperature=0,
    )
    content = resp.choices[0].message.content
    assert content is not None
    data = json.loads(content)  # grammar-constrained: it parses
    assert set(data) == {"city", "population"}
    assert isinstance(data["city"], str) and len(data["city"]) <= 12
    assert isinstance(data["population"], int)


def test_json_object_mode_gives_an_object(server: ServerProcess) -> None:
    resp = client(server).chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "Any JSON object."}],
        response_format={"type": "json_object"},
        max_tokens=32,
        temperature=0,
    )
    content = resp.choices[0].message.content or ""
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut by max_tokens: still the start of an object, never free text
        assert content.lstrip().startswith("{")


def test_logprobs_with_top_logprobs(server: ServerProcess) -> None:
    resp = client(server).chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.content
    for token in lp.content:
        assert token.logprob <= 0.0
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob


def test_completion_logprobs_and_logit_bias(server: ServerProcess) -> None:
    c = client(server)
    first = c.completions.create(model=MODEL_ID, prompt="The capital of France is",
                                 max_tokens=1, temperature=0, logprobs=2)  # fmt: skip
    assert first.choices[0].logprobs is not None
    # Ban the greedy token: the next most likely one must come out instead.
    tok = httpx.post(server.url + "/tokenize",
                     json={"content": first.choices[0].text}).json()["tokens"]  # fmt: skip
    banned = c.completions.create(
        model=MODEL_ID, prompt="The capital of France is", max_tokens=1, temperature=0,
        logit_bias={str(tok[0]): -100},
    )  # fmt: skip
    assert banned.choices[0].text != first.choices[0].text


def test_penalties_reach_the_engine(server: ServerProcess) -> None:
    """Greedy decoding of a repetitive prompt: strong penalties change what comes out."""
    c = client(server)
    kwargs: dict[str, Any] = {"model": MODEL_ID, "prompt": "yes yes yes yes yes yes yes",
                              "max_tokens": 6, "temperature": 0, "seed": 1234}  # fmt: skip
    plain = c.completions.create(**kwargs).choices[0].text
    penalised = (
        c.completions.create(**kwargs, presence_penalty=2.0, frequency_penalty=2.0).choices[0].text
    )
    assert plain != penalised, plain


def test_unsupported_field_is_a_400_naming_it(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            extra_body={"web_search_options": {}},
        )  # fmt: skip
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == "web_search_options" and body["code"] == "unsupported_parameter"


def test_models_by_id(server: ServerProcess) -> None:
    c = client(server)
    model = c.models.retrieve(MODEL_ID)
    assert model.id == MODEL_ID
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-9")


def test_tokenize_detokenize_round_trip(server: ServerProcess) -> None:
    tokens = httpx.post(server.url + "/tokenize", json={"content": "Hello world"}).json()
    assert tokens["tokens"] and all(isinstance(t, int) for t in tokens["tokens"])
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["content"].strip() == "Hello world"
    bad = httpx.post(server.url + "/tokenize", json={"content": 5})
    assert bad.status_code == 400


def test_embeddings_on_a_generative_model_is_not_supported(server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(server).embeddings.create(model=MODEL_ID, input="hello")
    assert info.value.code == "embeddings_unsupported"
    assert "not an embedding model" in info.value.message


def test_null_message_fields_are_absent_ones(server: ServerProcess) -> None:
    """OpenAI clients send ``"name": null``; llama-server would fail to parse it (a 500)."""
    messages = [
        {"role": "user", "content": "Hi", "name": None},
        {"role": "assistant", "content": "Hello", "name": None, "reasoning_content": None},
        {"role": "user", "content": "Bye"},
    ]
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL_ID, "messages": messages, "max_tokens": 1},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert resp.status_code == 200, resp.text


def test_token_ids_outside_the_vocabulary_are_400(server: ServerProcess) -> None:
    """The engine would index past its vocabulary (a 500 from inside llama-server)."""
    doc = httpx.get(server.url + "/openapi.json").json()
    n_vocab = (
        doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"][
            "maximum"
        ]
        + 1
    )
    assert n_vocab == 262144  # Gemma 3's vocabulary
    for path, body in (
        ("/detokenize", {"tokens": [1, n_vocab]}),
        ("/v1/completions", {"model": MODEL_ID, "prompt": [2, n_vocab + 7], "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL_ID, "prompt": [2, -1], "max_tokens": 1}),
    ):
        resp = httpx.post(server.url + path, json=body, timeout=REQUEST_TIMEOUT_S)
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"]["param"] in ("tokens", "prompt", "prompt.1")
    ok = httpx.post(server.url + "/detokenize", json={"tokens": [n_vocab - 1]})
    assert ok.status_code == 200


def test_tool_call_comes_back_as_tool_calls(tools_server: ServerProcess) -> None:
    resp = client(tools_server).chat.completions.create(
        model=MODEL_ID,
        messages=[*FEW_SHOT, {"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=40,
        temperature=0,
    )
    calls = resp.choices[0].message.tool_calls
    assert calls, resp
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]


def test_streamed_tool_call_and_its_session_turn(tools_server: ServerProcess) -> None:
    """A tool-call turn is stored whole: the next turn replays the call exactly."""
    c = client(tools_server)
    history = [*FEW_SHOT, {"role": "user", "content": "What is the weather in Paris?"}]
    stream = c.chat.completions.create(
        model=MODEL_ID, messages=history, tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="required", max_tokens=40, temperature=0, stream=True,
        extra_body={"session_id": "tools-1"},
    )  # fmt: skip
    call_id, name, args = "", "", ""
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call_id = call.id or call_id
            name += (call.function.name or "") if call.function else ""
            args += (call.function.arguments or "") if call.function else ""
    assert name == "get_weather" and json.loads(args) == {"city": "Paris"} and call_id
    result = {"role": "tool", "tool_call_id": call_id, "content": "rain"}
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
    base = {"model": MODEL_ID, "tools": [WEATHER_TOOL], "max_tokens": 4, "temperature": 0}

    def prompt_tokens(body: dict[str, Any]) -> int:
        resp = httpx.post(tools_server.url + "/v1/chat/completions", json={**base, **body},
                          timeout=REQUEST_TIMEOUT_S)  # fmt: skip
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["prompt_tokens"])

    explicit = prompt_tokens(
        {"messages": [*history, {"role": "assistant", "content": None, "tool_calls": [call]},
                      result]}
    )  # fmt: skip
    # The session sends only the tool's result: the stored history carries the rest.
    assert prompt_tokens({"session_id": "tools-1", "messages": [result]}) == explicit


def test_four_concurrent_streams_complete_with_their_own_text(
    serve_factory: ServeFactory,
) -> None:
    s = serve_factory("--n-parallel", "4", "--n-ctx", "2048", "--no-governor")
    prompts = ["The capital of France is", "Water boils at", "One, two, three,",
               "The first letter is"]  # fmt: skip
    solo = {}
    c = client(s)
    for p in prompts:
        r = c.completions.create(model=MODEL_ID, prompt=p, max_tokens=12, temperature=0)
        solo[p] = r.choices[0].text
    got: dict[str, str] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def run(p: str) -> None:
        try:
            barrier.wait(scaled(30))
            text = "".join(
                ch.choices[0].text
                for ch in c.completions.create(
                    model=MODEL_ID, prompt=p, max_tokens=12, temperature=0, stream=True
                )
            )
            got[p] = text
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(300))
    assert not errors, errors
    # Each stream got its own continuation. Batched decoding may round a late token
    # differently from a solo run, so "its own" means: closer to its prompt's solo
    # text than to any other prompt's.
    from difflib import SequenceMatcher

    for p in prompts:
        assert got[p], p
        own = SequenceMatcher(None, got[p], solo[p]).ratio()
        others = [SequenceMatcher(None, got[p], solo[q]).ratio() for q in prompts if q != p]
        assert own > max(others), (p, got[p], solo)
    metrics = httpx.get(s.url + "/metrics").text
    assert 'llamacpp:n_busy_slots_per_decode{engine="llama-server"}' in metrics
