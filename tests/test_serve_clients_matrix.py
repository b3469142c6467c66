"""The client matrix (issue 38): each library people point at an OpenAI-compatible server,
each call its users make, against one real server with the real engine.

Here: the calls ``tests/test_serve_clients.py`` and ``tests/test_serve_litellm.py`` do not
make (docs/clients.md has the whole matrix): the ``openai`` SDK's chat stream, named
``tool_choice``, ``parse`` and ``responses.input_tokens.count``; ``anthropic``'s
``tool_result`` with ``is_error``; LangChain's ``with_structured_output`` by function
calling; ``pydantic-ai`` and ``openai-agents`` (chat, stream, tools, structured output,
Responses); ``instructor`` and ``llama-index``, which need openai < 3, in the venv of their
own that ``make`` builds (``.venv/openai2``, ``tests/clients-openai2.txt``), as child
processes.

The server runs the template fixture ``tests/fixtures/templates/tools-chatml.jinja``. The
embedded model is a base model: its words are never checked. Where a library must get a
tool call back (a named ``tool_choice``: instructor's default mode, LangChain's
function-calling structured output), the conversation teaches the model the call first
(``tests/fewshot.py``) and decoding is greedy; what reached the engine is checked by its
prompt count (the template lists every tool it is given).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel

from fewshot import STOP_AFTER_CALL, few_shot, tool
from serveproc import REQUEST_TIMEOUT_S, ServerProcess, module_server

pytestmark = pytest.mark.engine

TEMPLATE = Path(__file__).parent / "fixtures" / "templates" / "tools-chatml.jinja"
KEY = "sk-matrix-test"
ALIAS = "gpt-4o-mini"
PROMPT = "The capital of France is"
OPENAI2 = Path(sys.executable).parent.parent / "openai2" / "bin" / "python"

srv = module_server(
    "matrix",
    ["--chat-template-file", str(TEMPLATE), "--n-parallel", "2", "--n-ctx", "4096",
     "--model-alias", ALIAS, "--no-governor", "--max-tokens-cap", "64"],
    api_key=KEY,
)  # fmt: skip


class Weather(BaseModel):
    """The weather in a city."""

    city: str


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


@pytest.fixture(autouse=True)
def _no_client_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("OPENAI_", "ANTHROPIC_", "LLM_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")


@pytest.fixture
def oai(srv: ServerProcess) -> Iterator[Any]:
    import openai

    with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0,
                       timeout=REQUEST_TIMEOUT_S) as c:  # fmt: skip
        yield c


def _prompt_tokens(srv: ServerProcess, body: dict[str, Any]) -> int:
    resp = httpx.post(srv.url + "/v1/chat/completions", json={"model": ALIAS, **body},
                      headers={"Authorization": f"Bearer {KEY}"},
                      timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens"])


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
    assert resp.usage.prompt_tokens == _prompt_tokens(srv, alone)
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


# ------------------------------------------------------------------ pydantic-ai


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_pydantic_ai_run_stream_and_native_output(srv: ServerProcess, kind: str) -> None:
    from openai import AsyncOpenAI
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    async def scenario() -> tuple[Any, list[str], Any]:
        async with AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0,
                               timeout=REQUEST_TIMEOUT_S) as client:  # fmt: skip
            cls = OpenAIResponsesModel if kind == "responses" else OpenAIChatModel
            model = cls(ALIAS, provider=OpenAIProvider(openai_client=client))
            agent = Agent(model, model_settings=ModelSettings(max_tokens=8, temperature=0))

            @agent.tool_plain
            def get_weather(city: str) -> str:
                """The weather in a city."""
                return "sunny"

            plain = await agent.run(PROMPT)
            async with agent.run_stream(PROMPT) as run:
                texts = [text async for text in run.stream_text(delta=True)]
            to_json = ModelSettings(max_tokens=32, temperature=0)
            structured = Agent(model, output_type=NativeOutput(Verdict), model_settings=to_json)
            verdict = await structured.run("Is Paris in France?")
        return plain.output, texts, verdict.output

    plain, texts, verdict = asyncio.run(scenario())
    assert isinstance(plain, str) and all(isinstance(t, str) for t in texts)
    assert isinstance(verdict, Verdict)


# ------------------------------------------------------------------ openai-agents


@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_openai_agents_run_stream_tools_and_output_type(srv: ServerProcess, kind: str) -> None:
    """openai-agents sends ``include: []`` with every Responses call (it was refused)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
    )
    from openai import AsyncOpenAI

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    async def scenario() -> tuple[Any, list[str], Any]:
        async with AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0,
                               timeout=REQUEST_TIMEOUT_S) as client:  # fmt: skip
            cls = OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel
            model = cls(ALIAS, client)
            settings = ModelSettings(max_tokens=8, temperature=0)
            agent = Agent(name="a", instructions="Be brief.", model=model,
                          model_settings=settings, tools=[get_weather])  # fmt: skip
            plain = await Runner.run(agent, PROMPT, max_turns=3)
            run = Runner.run_streamed(agent, PROMPT, max_turns=3)
            kinds = [event.type async for event in run.stream_events()]
            typed = Agent(name="t", model=model, output_type=Verdict,
                          model_settings=ModelSettings(max_tokens=32, temperature=0))  # fmt: skip
            verdict = await Runner.run(typed, "Is Paris in France?", max_turns=1)
        return plain.final_output, kinds, verdict.final_output

    plain, kinds, verdict = asyncio.run(scenario())
    assert isinstance(plain, str) and "raw_response_event" in kinds
    assert isinstance(verdict, Verdict)


# ------------------------------------------------ openai < 3: instructor, llama-index


def _openai2(srv: ServerProcess, code: str) -> Any:
    """Run ``code`` in the openai<3 clients' venv; it prints one JSON line, returned."""
    if not OPENAI2.exists():
        pytest.skip(f"{OPENAI2} is not there: `make` builds it (tests/clients-openai2.txt)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
    env.update(SLM_URL=srv.url, SLM_KEY=KEY, SLM_MODEL=ALIAS,
               SLM_FEW_SHOT=json.dumps(few_shot("Weather")), SLM_TIMEOUT=str(REQUEST_TIMEOUT_S),
               SLM_STOP=json.dumps(STOP_AFTER_CALL))  # fmt: skip
    done = subprocess.run([str(OPENAI2), "-c", code], capture_output=True, text=True, env=env,
                          timeout=REQUEST_TIMEOUT_S * 2, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


INSTRUCTOR = """
import json, os
import httpx, instructor, openai
from pydantic import BaseModel

class Weather(BaseModel):
    \"\"\"The weather in a city.\"\"\"
    city: str

sent = []
http = httpx.Client(timeout=float(os.environ["SLM_TIMEOUT"]),
                    event_hooks={"request": [lambda r: sent.append(json.loads(r.content))]})
client = instructor.from_openai(openai.OpenAI(base_url=os.environ["SLM_URL"] + "/v1",
                                              api_key=os.environ["SLM_KEY"], max_retries=0,
                                              http_client=http))
assert client.mode == instructor.Mode.TOOLS  # the default
weather, completion = client.chat.completions.create_with_completion(
    model=os.environ["SLM_MODEL"], response_model=Weather, max_retries=0, max_tokens=40,
    temperature=0, messages=json.loads(os.environ["SLM_FEW_SHOT"]),
    stop=json.loads(os.environ["SLM_STOP"]))
print(json.dumps({"weather": weather.model_dump(), "sent": sent,
                  "prompt_tokens": completion.usage.prompt_tokens}))
"""


def test_instructor_default_mode_names_its_tool(srv: ServerProcess) -> None:
    """instructor's default mode (``Mode.TOOLS``) sends its model class as the one tool,
    named in ``tool_choice`` (refused before), and validates the call's arguments."""
    got = _openai2(srv, INSTRUCTOR)
    assert got["weather"] == {"city": "Paris"}
    [sent] = got["sent"]  # one request: no retry
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "Weather"}}
    # What reached the engine: its one tool, a call required.
    required = {k: sent[k] for k in ("messages", "tools")}
    assert got["prompt_tokens"] == _prompt_tokens(srv, {**required, "tool_choice": "required",
                                                        "max_tokens": 1})  # fmt: skip


LLAMA_INDEX = """
import json, os
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike

def Weather(city: str) -> str:
    \"\"\"The weather in a city.\"\"\"
    return "sunny"

llm = OpenAILike(model=os.environ["SLM_MODEL"], api_base=os.environ["SLM_URL"] + "/v1",
                 api_key=os.environ["SLM_KEY"], is_chat_model=True,
                 is_function_calling_model=True, context_window=2048, max_tokens=40,
                 temperature=0, max_retries=0, timeout=float(os.environ["SLM_TIMEOUT"]),
                 additional_kwargs={"stop": json.loads(os.environ["SLM_STOP"])})
out = {"complete": llm.complete("The capital of France is", max_tokens=4).text}
out["chat"] = llm.chat([ChatMessage(role="user", content="Hi")], max_tokens=4).message.content
out["stream"] = [c.delta for c in llm.stream_chat([ChatMessage(role="user", content="Hi")],
                                                   max_tokens=4)]
history = []
for m in json.loads(os.environ["SLM_FEW_SHOT"]):
    extra = {k: m[k] for k in ("tool_calls", "tool_call_id") if k in m}
    history.append(ChatMessage(role=m["role"], content=m.get("content") or "",
                               additional_kwargs=extra))
question = history.pop()
resp = llm.chat_with_tools([FunctionTool.from_defaults(fn=Weather)], user_msg=question,
                           chat_history=history, tool_choice="Weather")
calls = llm.get_tool_calls_from_response(resp, error_on_no_tool_call=True)
out["calls"] = [{"name": c.tool_name, "kwargs": c.tool_kwargs} for c in calls]
print(json.dumps(out))
"""


def test_llama_index_complete_chat_stream_and_a_named_tool(srv: ServerProcess) -> None:
    got = _openai2(srv, LLAMA_INDEX)
    assert isinstance(got["complete"], str) and isinstance(got["chat"], str)
    assert all(isinstance(d, str) for d in got["stream"])
    assert got["calls"] == [{"name": "Weather", "kwargs": {"city": "Paris"}}]
