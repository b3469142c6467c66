"""The new routes' pure parts: engine flags from the GGUF, usage over choices, Anthropic
shapes, the request schemas' refusals, ``--model-alias`` (no engine)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from slmguard import settings
from slmguard.errors import ConfigError, EngineBusyError, RequestError
from slmguard.governor.request import NoPolicy
from slmguard.serve.answers import add_usage
from slmguard.serve.dialects.chat import prepare_chat
from slmguard.serve.dialects.context import DialectContext
from slmguard.serve.dialects.messages import anthropic_tools, tool_errors_as_text
from slmguard.serve.dialects.rerank import prepare_rerank
from slmguard.serve.dialects.responses import responses_body
from slmguard.serve.envelope import anthropic_body, anthropic_sse_event
from slmguard.serve.flights import Flights
from slmguard.serve.gather import Gathered, GatheredChat
from slmguard.serve.llamaserver import EngineConfig, engine_argv, pooling_flag
from slmguard.serve.readiness import RetryAfter
from slmguard.serve.relay import Relay
from slmguard.serve.schemas import (
    CompletionRequest,
    MessagesRequest,
    ResponsesRequest,
)
from slmguard.serve.served import ServedModel
from slmguard.serve.sizing import Sizing, TokenLimits


def argv_for(pooling_type: int | None) -> list[str]:
    cfg = EngineConfig(model_path="/m.gguf", n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1,
                       pooling_type=pooling_type)  # fmt: skip
    return engine_argv(Path("/x"), cfg, socket_path=Path("/s.sock"), api_key_file=Path("/k"),
                       alias="m")  # fmt: skip


def test_the_gguf_pooling_type_decides_the_engine_flag() -> None:
    assert pooling_flag(None) is None
    assert pooling_flag(1) == pooling_flag(2) == pooling_flag(3) == "--embeddings"
    assert pooling_flag(4) == "--reranking"
    plain = argv_for(None)
    assert "--embeddings" not in plain and "--reranking" not in plain
    assert "--embeddings" in argv_for(1) and "--reranking" not in argv_for(1)
    assert "--reranking" in argv_for(4) and "--embeddings" not in argv_for(4)


def test_usage_counts_each_prompt_once_and_every_choice() -> None:
    total = None
    # 2 prompts x 2 choices: indices 0,1 (prompt A, 5 tokens), 2,3 (prompt B, 7 tokens)
    for index, prompt, completion in ((1, 5, 3), (0, 5, 2), (3, 7, 4), (2, 7, 1)):
        total = add_usage(total, {"prompt_tokens": prompt, "completion_tokens": completion},
                           prompt=index % 2 == 0)  # fmt: skip
    assert total == {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22}


def test_gathered_stream_is_the_non_stream_answer_with_summed_usage() -> None:
    g = Gathered(per_prompt=2)
    chunks: list[dict[str, Any]] = [
        {"id": "c", "created": 1, "model": "m", "choices": [{"index": 1, "text": "b"}]},
        {"choices": [{"index": 0, "text": "a", "logprobs": {"content": [{"id": 1}]}}]},
        {"choices": [{"index": 0, "text": "A", "logprobs": {"content": [{"id": 2}]},
                      "finish_reason": "length"}],
         "usage": {"prompt_tokens": 4, "completion_tokens": 2}},
        {"choices": [{"index": 1, "text": "", "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 4, "completion_tokens": 1}},
    ]  # fmt: skip
    for c in chunks:
        g.feed(c)
    answer = g.answer()
    assert answer["object"] == "text_completion" and answer["id"] == "c"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == [
        (0, "aA", "length"), (1, "b", "stop")]  # fmt: skip
    assert answer["choices"][0]["logprobs"] == {"content": [{"id": 1}, {"id": 2}]}
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def chat_chunk(index: int, delta: dict[str, Any], finish: str | None = None,
               **extra: Any) -> dict[str, Any]:  # fmt: skip
    """One chunk of the engine's chat stream: one choice's delta."""
    choice = {"finish_reason": finish, "index": index, "delta": delta, **extra}
    return {"choices": [choice], "created": 1, "id": "chatcmpl-x", "model": "m",
            "system_fingerprint": "b1", "object": "chat.completion.chunk"}  # fmt: skip


def chat_usage(prompt: int, completion: int, **extra: Any) -> dict[str, Any]:
    """The usage chunk the engine sends when one choice of a chat stream finishes."""
    usage = {"completion_tokens": completion, "prompt_tokens": prompt,
             "total_tokens": prompt + completion}  # fmt: skip
    return {"choices": [], "created": 1, "id": "chatcmpl-x", "model": "m",
            "object": "chat.completion.chunk", "usage": usage, **extra}  # fmt: skip


#: A chat stream with n=2 as the engine sends it: the choices interleaved, each one's
#: finish chunk then its usage chunk (no choices) with its timings; choice 1 calls a tool.
CHAT_N2: list[dict[str, Any]] = [
    chat_chunk(0, {"role": "assistant", "content": None}),
    chat_chunk(1, {"role": "assistant", "content": None}),
    chat_chunk(0, {"reasoning_content": "hm"}, logprobs={"content": [{"id": 1}]}),
    chat_chunk(1, {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                   "function": {"name": "get_", "arguments": '{"ci'}}]}),
    chat_chunk(0, {"content": "Par"}, logprobs={"content": [{"id": 2}]}),
    chat_chunk(1, {"tool_calls": [{"index": 0, "function": {"name": "weather",
                                                            "arguments": 'ty": "Paris"}'}}]}),
    chat_chunk(0, {"content": "is"}, logprobs={"content": [{"id": 3}]}),
    chat_chunk(0, {}, "length"),
    chat_usage(9, 3, timings={"predicted_n": 3}),
    chat_chunk(1, {}, "tool_calls"),
    chat_usage(9, 5, timings={"predicted_n": 5}),
]  # fmt: skip


def test_gathered_chat_stream_is_the_non_stream_answer_with_summed_usage() -> None:
    g = GatheredChat()
    for c in CHAT_N2:
        g.feed(c)
    answer = g.answer()
    head = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint", "object")}
    assert head == {"id": "chatcmpl-x", "created": 1, "model": "m", "system_fingerprint": "b1",
                    "object": "chat.completion"}  # fmt: skip
    # The engine's non-stream shape: content always a string, the rest only when present.
    assert answer["choices"] == [
        {"finish_reason": "length", "index": 0,
         "message": {"role": "assistant", "content": "Paris", "reasoning_content": "hm"},
         "logprobs": {"content": [{"id": 1}, {"id": 2}, {"id": 3}]}},
        {"finish_reason": "tool_calls", "index": 1,
         "message": {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}},
    ]  # fmt: skip
    # Every choice's completion, the one prompt once; the first finished choice's timings.
    assert answer["usage"] == {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17}
    assert answer["timings"] == {"predicted_n": 3}


class FakeStream:
    """The engine's SSE answer to one streamed request, line by line."""

    status_code = 200

    def __init__(self, chunks: list[dict[str, Any]]) -> None:
        self.lines = ["data: null"] + [f"data: {json.dumps(c)}" for c in chunks]
        self.lines += ["", "data: [DONE]"]

    async def aiter_lines(self) -> AsyncIterator[str]:
        for line in self.lines:
            yield line


async def _open() -> None:
    """The engine's gate for calls outside a generation (held only during a recycle)."""


class FakeEngineClient:
    """``/apply-template`` and ``/tokenize`` answered, a generation streamed as CHAT_N2."""

    def __init__(self) -> None:
        self.streamed: list[dict[str, Any]] = []

    async def request(self, method: str, path: str, body: Any) -> tuple[int, bytes, str]:
        data = {"prompt": "<prompt>"} if path == "/apply-template" else {"tokens": [1] * 9}
        return 200, json.dumps(data).encode(), "application/json"

    @contextlib.asynccontextmanager
    async def stream(self, path: str, body: Any) -> AsyncIterator[FakeStream]:
        self.streamed.append(body)
        yield FakeStream(CHAT_N2)


def relay_of(
    engine: Any, queue: Any, flights: Flights, policy: Any, model: ServedModel
) -> tuple[Relay, DialectContext]:
    """A relay over a fake engine (no metrics) and the dialects' side of it."""
    sizing = Sizing(policy, TokenLimits(), settings=lambda: engine.config,
                    slots=lambda: queue.slots)  # fmt: skip
    relay = Relay(engine, queue, flights, None, policy, sizing,  # type: ignore[arg-type]
                  retry_after=RetryAfter(2, 60), sessions=None)  # fmt: skip
    return relay, DialectContext(relay.call_json, sizing, model, None)


def test_a_chat_with_several_choices_and_no_stream_is_gathered_from_the_stream() -> None:
    client = FakeEngineClient()
    engine = SimpleNamespace(client=client, state="ready", recycling=False, calls_open=_open,
                             config=SimpleNamespace(n_ctx_slot=512))  # fmt: skip
    flights = Flights()
    queue = SimpleNamespace(slots=2)
    relay, dialects = relay_of(engine, queue, flights, NoPolicy(), ServedModel("m", "/m", 1))
    data = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "n": 2,
            "max_tokens": 8}  # fmt: skip

    async def main() -> tuple[Any, tuple[int, bytes, str], Any]:
        one = await prepare_chat(dialects, {**data, "n": 1}, None)
        gen = await prepare_chat(dialects, data, None)
        flight = flights.open("chat", stream=False, slots=2)
        return one, await relay._gather(gen, flight), gen

    one, (status, raw, _), gen = asyncio.run(main())
    assert not one.gathered and "stream" not in one.body  # one choice: the engine's answer
    assert gen.gathered and not gen.stream and gen.sized.n == 2
    assert client.streamed == [gen.body]
    assert gen.body["stream"] is True and gen.body["stream_options"] == {"include_usage": True}
    answer = json.loads(raw)
    assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"] == {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17}
    assert flights.events == len(CHAT_N2)  # each chunk is progress for the liveness check


class WordTokenizer:
    """An engine whose ``/tokenize`` makes a token of each word (and counts its calls)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def request(self, method: str, path: str, body: Any) -> tuple[int, bytes, str]:
        assert path == "/tokenize"
        self.bodies.append(body)
        words = body["content"].split()
        # [SEP] is the one special token: three pieces of text unless parsed.
        n = sum(1 if w != "[SEP]" or body["parse_special"] else 3 for w in words)
        return 200, json.dumps({"tokens": list(range(n))}).encode(), "application/json"


def rerank_relay(
    *, one_batch: bool, policy: Any = None, template: str | None = None
) -> tuple[DialectContext, WordTokenizer]:
    client = WordTokenizer()
    config = SimpleNamespace(n_ctx_slot=512, n_batch=512, n_ubatch=128)
    engine = SimpleNamespace(client=client, state="ready", config=config, recycling=False,
                             calls_open=_open)  # fmt: skip
    model = ServedModel("m", "/m", 1, causal=not one_batch, rerank_template=template)
    _, dialects = relay_of(engine, SimpleNamespace(slots=2), Flights(), policy or NoPolicy(),
                           model)  # fmt: skip
    return dialects, client


def test_a_rerank_template_is_rendered_counted_and_its_control_tokens_refused() -> None:
    relay, client = rerank_relay(one_batch=True, template="[CLS] {query} [SEP] {document}")
    gen = asyncio.run(prepare_rerank(relay, {"query": "q", "documents": ["a b", "c"]}))
    counted = [b for b in client.bodies if b["content"].startswith("[CLS]")]
    assert [b["content"] for b in counted] == ["[CLS] q [SEP] a b", "[CLS] q [SEP] c"]
    assert all(not b["add_special"] and b["parse_special"] for b in counted)
    assert gen.sized.prompt_tokens == 5  # exact: no special tokens guessed
    for data, param in (({"query": "q", "documents": ["a", "b [SEP] c"]}, "documents.1"),
                        ({"query": "[SEP]", "documents": ["a"]}, "query")):  # fmt: skip
        with pytest.raises(RequestError, match="control tokens") as info:
            asyncio.run(prepare_rerank(relay, data))
        assert info.value.param == param  # type: ignore[attr-defined]
        assert info.value.code == "control_token_in_message"  # type: ignore[attr-defined]
    plain, _ = rerank_relay(one_batch=True)  # without a template [SEP] is text
    assert asyncio.run(prepare_rerank(plain, {"query": "[SEP]", "documents": ["a"]}))


def test_a_rerank_pair_must_fit_one_batch_on_an_encoder_and_one_slot_always() -> None:
    words = " ".join(["w"] * 200)
    data = {"model": "m", "query": "two words", "documents": ["a", words, "b c"]}
    relay, client = rerank_relay(one_batch=False)
    gen = asyncio.run(prepare_rerank(relay, data))
    # Tokenized as the engine tokenizes a rerank's texts; the longest pair sized.
    assert [b["content"] for b in client.bodies] == ["two words", "a", words, "b c"]
    assert all(not b["add_special"] and not b["parse_special"] for b in client.bodies)
    assert (gen.sized.prompt_tokens, gen.sized.max_tokens, gen.sized.n) == (2 + 200 + 4, 0, 2)
    assert gen.prompt_from_answer and gen.body["model"] == "m"
    encoder, _ = rerank_relay(one_batch=True)  # BERT: a task is computed in one batch of 128
    with pytest.raises(RequestError, match="one batch of 128 tokens") as info:
        asyncio.run(prepare_rerank(encoder, data))
    assert info.value.param == "documents.1"  # type: ignore[attr-defined]
    assert info.value.code == "context_length_exceeded"  # type: ignore[attr-defined]
    long_query = {**data, "query": " ".join(["q"] * 600), "documents": ["a"]}
    with pytest.raises(RequestError, match="context of 512 tokens") as info:
        asyncio.run(prepare_rerank(relay, long_query))
    assert info.value.param == "query"  # type: ignore[attr-defined]


def test_a_rerank_pair_over_a_shrunk_context_gets_the_policys_verdict() -> None:
    shrunk = EngineBusyError("the context is reduced")
    policy = SimpleNamespace(context_verdict=lambda sized: shrunk)
    relay, _ = rerank_relay(one_batch=False, policy=policy)
    data = {"model": "m", "query": "q", "documents": [" ".join(["w"] * 600)]}
    with pytest.raises(EngineBusyError) as info:
        asyncio.run(prepare_rerank(relay, data))
    assert info.value is shrunk


def test_anthropic_tool_choice_is_honoured() -> None:
    tools = [{"name": "a", "input_schema": {}}, {"name": "b", "input_schema": {}}]
    none = anthropic_tools({"tools": tools, "tool_choice": {"type": "none"}, "x": 1})
    assert none == {"x": 1}  # no tool offered: none can be called
    named = anthropic_tools({"tools": tools, "tool_choice": {"type": "tool", "name": "b"}})
    assert named == {"tools": [tools[1]], "tool_choice": {"type": "any"}}
    with pytest.raises(RequestError, match="'c'") as info:
        anthropic_tools({"tools": tools, "tool_choice": {"type": "tool", "name": "c"}})
    assert info.value.param == "tool_choice"  # type: ignore[attr-defined]
    auto = {"tools": tools, "tool_choice": {"type": "auto"}}
    assert anthropic_tools(auto) == auto


class TemplateEngine(FakeEngineClient):
    """An engine whose ``/apply-template`` and count routes remember what they were sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, Any] = {}

    async def request(self, method: str, path: str, body: Any) -> tuple[int, bytes, str]:
        self.sent[path] = body
        return await super().request(method, path, body)


def fake_dialects() -> tuple[TemplateEngine, DialectContext]:
    client = TemplateEngine()
    engine = SimpleNamespace(client=client, state="ready", recycling=False, calls_open=_open,
                             config=SimpleNamespace(n_ctx_slot=512))  # fmt: skip
    queue = SimpleNamespace(slots=1)
    _, dialects = relay_of(engine, queue, Flights(), NoPolicy(), ServedModel("m", "/m", 1))
    return client, dialects


def chat_tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def test_a_named_chat_tool_choice_is_that_tool_alone_required() -> None:
    """The engine knows "required" (any tool) but no named tool: it is given the named one
    alone, so its required call is that one; the template counts that body too."""
    client, dialects = fake_dialects()
    tools = [chat_tool("get_time"), chat_tool("get_weather")]
    named = {"type": "function", "function": {"name": "get_weather"}}
    data = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": tools,
            "tool_choice": named, "max_tokens": 8}  # fmt: skip
    gen = asyncio.run(prepare_chat(dialects, data, None))
    assert gen.body["tools"] == [tools[1]] and gen.body["tool_choice"] == "required"
    assert client.sent["/apply-template"]["tools"] == [tools[1]]
    assert client.sent["/apply-template"]["tool_choice"] == "required"
    missing = {**data, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}
    with pytest.raises(RequestError, match="'get_stock'") as info:
        asyncio.run(prepare_chat(dialects, missing, None))
    assert info.value.param == "tool_choice"  # type: ignore[attr-defined]
    for plain in ("auto", "required", "none"):
        gen = asyncio.run(prepare_chat(dialects, {**data, "tool_choice": plain}, None))
        assert gen.body["tools"] == tools and gen.body["tool_choice"] == plain


def test_a_named_responses_tool_choice_and_an_empty_include() -> None:
    _, dialects = fake_dialects()
    tools = [{"type": "function", "name": n, "parameters": {}} for n in ("a", "b")]
    data = {"model": "m", "input": "Hi", "tools": tools, "include": [],
            "tool_choice": {"type": "function", "name": "b"}}  # fmt: skip
    body = asyncio.run(responses_body(dialects, data))
    assert body["tools"] == [tools[1]] and body["tool_choice"] == "required"
    assert "include" not in body  # it asked for nothing; the engine is not told
    with pytest.raises(RequestError, match="'c'"):
        asyncio.run(responses_body(dialects, {**data, "tool_choice": {"type": "function",
                                                                      "name": "c"}}))  # fmt: skip
    ResponsesRequest.model_validate({"model": "m", "input": "x", "include": []})
    with pytest.raises(ValidationError, match="include"):
        ResponsesRequest.model_validate({"model": "m", "input": "x", "include": ["x"]})
    with pytest.raises(ValidationError, match="include"):
        ResponsesRequest.model_validate({"model": "m", "input": "x", "include": [""] * 17})


def test_a_failed_tool_result_reaches_the_template_as_its_error_text() -> None:
    def result(content: Any, **flag: Any) -> dict[str, Any]:
        return {"type": "tool_result", "tool_use_id": "t", "content": content, **flag}

    texts_ = [{"type": "text", "text": "timed "}, {"type": "text", "text": "out"}]
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": [result("timed out", is_error=True),
                                     result(texts_, is_error=True), result(None, is_error=True),
                                     result("sunny", is_error=False), result("rain")]},
    ]  # fmt: skip
    out = tool_errors_as_text(messages)
    assert out[0] is messages[0]
    assert out[1]["content"] == [result("Error: timed out"), result("Error: timed out"),
                                 result("Error"), result("sunny", is_error=False),
                                 result("rain")]  # fmt: skip
    assert messages[1]["content"][0]["is_error"] is True  # the request itself is untouched
    MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": messages})


def test_anthropic_error_shape() -> None:
    body = {"error": {"message": "too long", "type": "invalid_request_error", "code": "x"}}
    expected = {"type": "invalid_request_error", "message": "too long"}
    assert anthropic_body(400, body) == {"type": "error", "error": expected}
    assert anthropic_body(503, body)["error"]["type"] == "overloaded_error"
    assert anthropic_body(500, body)["error"]["type"] == "api_error"
    event = anthropic_sse_event(EngineBusyError("busy"))
    name, data = event.strip().split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: "))["type"] == "error"


def completion(prompt: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": prompt})


@pytest.mark.parametrize(
    "prompt",
    ["Hi", [1, 2], ["a", "b"], [[1], [2, 3]]],
    ids=["str", "tokens", "strs", "token-lists"],
)
def test_completions_take_every_prompt_form(prompt: Any) -> None:
    assert completion(prompt).prompt == prompt


@pytest.mark.parametrize(
    "prompt",
    [[], ["a", 5], [[]], ["x"] * 65, [True]],
    ids=["empty", "mixed", "empty-tokens", "too-many", "bool"],
)
def test_completions_refuse_other_prompts(prompt: Any) -> None:
    with pytest.raises(ValidationError):
        completion(prompt)


def test_label_fields_are_accepted_and_store_true_refused() -> None:
    labels = {"user": "u", "metadata": {"k": "v"}, "service_tier": "auto", "store": False,
              "safety_identifier": "h", "prompt_cache_key": "k"}  # fmt: skip
    CompletionRequest.model_validate({"model": "m", "prompt": "x", **labels})
    ResponsesRequest.model_validate({"model": "m", "input": "x", **labels})
    with pytest.raises(ValidationError, match="store: true"):
        ResponsesRequest.model_validate({"model": "m", "input": "x", "store": True})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "metadata": {"k": 1}})


@pytest.mark.parametrize(
    "extra",
    [
        {"include": ["reasoning.encrypted_content"]},
        {"previous_response_id": "r"},
        {"background": True},
        {"truncation": "auto"},
        {"n": 2},
        {"top_logprobs": 2},
        {"tools": [{"type": "web_search"}]},
        {"text": {"verbosity": "low"}},
        {"tool_choice": {"type": "function"}},
        {"tool_choice": {"type": "custom", "name": "f"}},
        {"conversation": "c"},
    ],
    ids=lambda e: "-".join(
        [next(iter(e)), *([e["tool_choice"]["type"]] if "tool_choice" in e else [])]
    ),
)
def test_responses_refuse_what_the_engine_would_drop(extra: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"model": "m", "input": "x", **extra})


def test_responses_text_format_is_checked() -> None:
    fmt = {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}
    req = ResponsesRequest.model_validate({"model": "m", "input": "x", "text": {"format": fmt}})
    assert req.text is not None and req.text.format is not None


@pytest.mark.parametrize(
    "extra",
    [
        {"output_config": {"format": {}}}, {"container": "c"},
        {"thinking": {"type": "adaptive"}},
        {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]},
        {"messages": []},
    ],
    ids=["output_config", "container", "thinking-adaptive", "disable-parallel", "image",
         "is-error-not-bool", "no-messages"],
)  # fmt: skip
def test_messages_refuse_what_the_engine_would_drop(extra: dict[str, Any]) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({**body, **extra})


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    return parser.parse_args(argv)


def test_model_alias_is_repeatable_and_checked() -> None:
    s = settings.resolve(parse(["--model-alias", "gpt-4o-mini", "--model-alias", "x"]), {}, None)
    assert s.model_alias == ("gpt-4o-mini", "x")
    env = settings.resolve(parse([]), {"SLMGUARD_MODEL_ALIAS": "a,b"}, None)
    assert env.model_alias == ("a", "b")
    for bad in ("two words", "", "x" * 257, "tab\there"):
        with pytest.raises(ConfigError, match="--model-alias"):
            settings.resolve(parse(["--model-alias", bad]), {}, None)
