"""The client matrix (issue 38): each library people point at an OpenAI-compatible server,
each call its users make, against one real server with the real engine.

Here, in ``make test``: the calls ``tests/test_serve_clients.py`` and
``tests/test_serve_litellm.py`` do not make (docs/clients.md has the whole matrix): the
``openai`` SDK's chat stream, named ``tool_choice``, ``parse`` and
``responses.input_tokens.count``; ``anthropic``'s ``tool_result`` with ``is_error``;
LangChain's ``with_structured_output`` by function calling. The agent frameworks and the
openai<3 libraries are ``tests/test_serve_clients_agents.py`` (``make clients``).

The embedded model is a base model: its words are never checked. Where a library must
get a tool call back (a named ``tool_choice``: LangChain's function-calling structured
output), the conversation teaches the model the call first (``tests/fewshot.py``) and
decoding is greedy; what reached the engine is checked by its prompt count (the template
lists every tool it is given).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from clientmatrix import (
    ALIAS,
    KEY,
    PROMPT,
    SERVER_ARGS,
    Verdict,
    Weather,
    no_client_environment,
    prompt_tokens,
)
from fewshot import STOP_AFTER_CALL, few_shot, tool
from serveproc import REQUEST_TIMEOUT_S, ServerProcess, module_server

pytestmark = pytest.mark.engine

srv = module_server("matrix", SERVER_ARGS, api_key=KEY)


@pytest.fixture(autouse=True)
def _no_client_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    no_client_environment(monkeypatch)


@pytest.fixture
def oai(srv: ServerProcess) -> Iterator[Any]:
    import openai

    with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0,
                       timeout=REQUEST_TIMEOUT_S) as c:  # fmt: skip
        yield c


# ------------------------------------------------------------------ openai


def test_openai_chat_stream(oai: Any) -> None:
    chunks = list(oai.chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= 4
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_openai_named_tool_choice_answers_with_that_tool(srv: ServerProcess, oai: Any) -> None:
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: the front sends
    the engine that tool alone with a required call, so the answer calls it."""
    messages = few_shot("get_weather")
    tools = [tool("get_time", "the time in a city"), tool("get_weather")]
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = oai.chat.completions.create(model=ALIAS, messages=messages, tools=tools,
                                       tool_choice=named, max_tokens=40, temperature=0,
                                       stop=STOP_AFTER_CALL)  # fmt: skip
    calls = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls", resp
    assert calls and [c.function.name for c in calls] == ["get_weather"], resp
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    # What reached the engine: the named tool alone (the template lists each tool given).
    alone = {"messages": messages, "tools": [tool("get_weather")], "tool_choice": "required",
             "max_tokens": 1}  # fmt: skip
    assert resp.usage.prompt_tokens == prompt_tokens(srv, alone)
    with pytest.raises(Exception, match="tool_choice") as info:
        oai.chat.completions.create(
            model=ALIAS, messages=messages, tools=tools, max_tokens=1,
            tool_choice={"type": "function", "function": {"name": "get_stock"}})  # fmt: skip
    assert info.value.status_code == 400  # type: ignore[attr-defined]


def test_openai_parse_structured_output(oai: Any) -> None:
    """``chat.completions.parse(response_format=Model)``: a JSON schema the engine holds
    the answer to, parsed by the SDK."""
    done = oai.chat.completions.parse(
        model=ALIAS, messages=[{"role": "user", "content": "Is Paris in France?"}],
        response_format=Verdict, max_tokens=32, temperature=0)  # fmt: skip
    assert isinstance(done.choices[0].message.parsed, Verdict)


def test_openai_responses_input_tokens_and_include(oai: Any) -> None:
    """``responses.input_tokens.count`` counts what ``responses.create`` is charged; an
    empty ``include`` (openai-agents sends one every time) asks for nothing extra."""
    import openai

    counted = oai.responses.input_tokens.count(model=ALIAS, input=PROMPT, instructions="Be brief.")
    resp = oai.responses.create(model=ALIAS, input=PROMPT, instructions="Be brief.",
                                max_output_tokens=4, include=[])  # fmt: skip
    assert counted.input_tokens == resp.usage.input_tokens > 0
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model=ALIAS, input=PROMPT, max_output_tokens=4,
                             include=["reasoning.encrypted_content"])  # fmt: skip
    assert info.value.body["param"] == "include"  # type: ignore[index]


# ------------------------------------------------------------------ anthropic


def _tool_turn(is_error: bool | None, content: str) -> list[dict[str, Any]]:
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": "t1", "content": content}
    if is_error is not None:
        result["is_error"] = is_error
    return [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [result]},
    ]  # fmt: skip


def test_anthropic_tool_result_error_reaches_the_template(srv: ServerProcess) -> None:
    """An agent loop reports a failed tool with ``is_error: true``: the model reads it as
    the tool's error text (counted as that text), and the request is answered."""
    import anthropic

    weather = {
        "name": "get_weather",
        "description": "the weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    with anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0,
                             timeout=REQUEST_TIMEOUT_S) as c:  # fmt: skip

        def count(turn: list[dict[str, Any]]) -> int:
            return int(c.messages.count_tokens(model=ALIAS, messages=turn,  # type: ignore[arg-type]
                                               tools=[weather]).input_tokens)  # fmt: skip

        failed = count(_tool_turn(True, "the weather service timed out"))
        assert failed == count(_tool_turn(None, "Error: the weather service timed out"))
        assert failed > count(_tool_turn(False, "the weather service timed out"))
        msg = c.messages.create(
            model=ALIAS,
            max_tokens=4,
            tools=[weather],  # type: ignore[list-item]
            messages=_tool_turn(True, "timed out"),
        )  # type: ignore[arg-type]
    assert msg.type == "message" and msg.usage.output_tokens <= 4


# ------------------------------------------------------------------ langchain-openai


def _chat_openai(srv: ServerProcess, http: httpx.Client, **kw: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=ALIAS, base_url=srv.url + "/v1", api_key=KEY, temperature=0,  # type: ignore[arg-type]
                      max_retries=0, timeout=REQUEST_TIMEOUT_S, http_client=http, **kw)  # fmt: skip


def test_langchain_structured_output_by_function_calling(srv: ServerProcess) -> None:
    """``with_structured_output(method="function_calling")`` names its tool in
    ``tool_choice`` and parses the call into the model class."""
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        llm = _chat_openai(srv, http, max_tokens=40, stop=STOP_AFTER_CALL)
        out = llm.with_structured_output(Weather, method="function_calling",
                                         include_raw=True).invoke(few_shot("Weather"))  # fmt: skip
    assert out["parsing_error"] is None, out["raw"]
    assert out["parsed"] == Weather(city="Paris")


def test_langchain_stream(srv: ServerProcess) -> None:
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        chunks = list(_chat_openai(srv, http, max_tokens=4).stream([("user", PROMPT)]))
    assert chunks and all(isinstance(c.content, str) for c in chunks)
