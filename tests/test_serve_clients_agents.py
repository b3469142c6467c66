"""The client matrix's agent frameworks and openai<3 libraries (issue 38), run by
``make test`` (which installs them and passes ``--clients``) and alone by ``make clients``
(their cost in DEVELOPERS.md): ``pydantic-ai`` and ``openai-agents`` (chat, stream, tools,
structured output, Responses; the ``clients`` extra), ``instructor`` and ``llama-index``, which need
openai < 3, in a venv of their own (``.venv/openai2``, ``tests/clients-openai2.txt``), as
child processes. Marked ``clients``: a bare ``pytest`` deselects them unless ``--clients``.

One real server with the real engine and the template fixture, as
``tests/test_serve_clients_matrix.py``; the base model's words are never checked. Where a
library must get a tool call back (instructor's named ``tool_choice``), the conversation
teaches the model the call first (``tests/fewshot.py``) and decoding is greedy; what
reached the engine is checked by its prompt count.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clientmatrix import (
    ALIAS,
    KEY,
    PROMPT,
    SERVER_ARGS,
    Verdict,
    no_client_environment,
    prompt_tokens,
)
from fewshot import STOP_AFTER_CALL, few_shot
from serveproc import REQUEST_TIMEOUT_S, ServerProcess, module_server

pytestmark = [pytest.mark.engine, pytest.mark.clients]

OPENAI2 = Path(sys.executable).parent.parent / "openai2" / "bin" / "python"

srv = module_server("agents", SERVER_ARGS, api_key=KEY)


@pytest.fixture(autouse=True)
def _no_client_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    no_client_environment(monkeypatch)


def _needs(module: str) -> None:
    pytest.importorskip(module, reason="the clients extra: `make clients` installs it")


# ------------------------------------------------------------------ pydantic-ai


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_pydantic_ai_run_stream_and_native_output(srv: ServerProcess, kind: str) -> None:
    _needs("pydantic_ai")
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
    _needs("agents")
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
        pytest.skip(f"{OPENAI2} is not there: `make clients` builds it")
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
    assert got["prompt_tokens"] == prompt_tokens(srv, {**required, "tool_choice": "required",
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
