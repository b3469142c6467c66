"""Real client libraries against a real server: ``openai`` (Responses, embeddings),
``anthropic`` (Messages, stream, token count), ``langchain-openai`` (``ChatOpenAI`` with
tools and ``with_structured_output``, ``OpenAI`` with list prompts) and the ``llm``
command line (its ``extra-openai-models.yaml``). ``litellm`` has its own module (its
import is slow).

The server runs the template fixture ``tests/fixtures/templates/tools-chatml.jinja``
(the embedded model is a base model without a chat template), 2 slots, an API key and
``--model-alias gpt-4o-mini``. Base-model text is arbitrary: shapes and counts are
checked, never words. No network but localhost: every client gets its base URL and key
explicitly, and the environment variables they would read instead are cleared.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serveproc import MODEL_ID, REQUEST_TIMEOUT_S, ServerProcess, module_server

pytestmark = pytest.mark.engine

TEMPLATE = Path(__file__).parent / "fixtures" / "templates" / "tools-chatml.jinja"
KEY = "sk-clients-test"
ALIAS = "gpt-4o-mini"
PROMPT = "The capital of France is"


srv = module_server(
    "clients",
    ["--chat-template-file", str(TEMPLATE), "--n-parallel", "2", "--n-ctx", "2048",
     "--model-alias", ALIAS, "--no-governor", "--max-tokens-cap", "16"],
    api_key=KEY,
)  # fmt: skip


@pytest.fixture(autouse=True)
def _no_client_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("OPENAI_", "ANTHROPIC_", "LLM_")):
            monkeypatch.delenv(name)


# ------------------------------------------------------------------ openai


@pytest.fixture
def oai(srv: ServerProcess) -> Iterator[Any]:
    import openai

    with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0,
                       timeout=REQUEST_TIMEOUT_S) as c:  # fmt: skip
        yield c


def test_openai_responses_create_and_stream(oai: Any) -> None:
    c = oai
    resp = c.responses.create(model=ALIAS, input=PROMPT, max_output_tokens=4)
    assert resp.status == "completed" and isinstance(resp.output_text, str)
    assert resp.usage is not None and 1 <= resp.usage.output_tokens <= 4
    kinds = [event.type for event in c.responses.create(
        model=ALIAS, input=PROMPT, max_output_tokens=4, stream=True)]  # fmt: skip
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds


def test_openai_embeddings_say_why_not(oai: Any) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        oai.embeddings.create(model=MODEL_ID, input="x")
    assert info.value.code == "embeddings_unsupported"


def test_openai_models_list_the_alias(oai: Any) -> None:
    assert [m.id for m in oai.models.list()] == [MODEL_ID, ALIAS]


# ------------------------------------------------------------------ anthropic


@pytest.fixture
def anth(srv: ServerProcess) -> Iterator[Any]:
    import anthropic

    with anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0,
                             timeout=REQUEST_TIMEOUT_S) as c:  # fmt: skip
        yield c


MESSAGES = [{"role": "user", "content": PROMPT}]


def test_anthropic_messages_create_stream_and_count(anth: Any) -> None:
    c = anth
    msg = c.messages.create(model=ALIAS, max_tokens=4, messages=MESSAGES)
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.stop_reason in ("end_turn", "max_tokens") and 1 <= msg.usage.output_tokens <= 4
    with c.messages.stream(model=ALIAS, max_tokens=4, messages=MESSAGES) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert isinstance(text, str) and final.usage.output_tokens <= 4
    counted = c.messages.count_tokens(model=ALIAS, messages=MESSAGES)
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def test_anthropic_errors_are_the_sdk_errors(srv: ServerProcess, anth: Any) -> None:
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as info:
        anth.messages.create(model="claude-unknown", max_tokens=4, messages=MESSAGES)
    assert info.value.body["error"]["type"] == "not_found_error"
    with (
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0) as wrong,
        pytest.raises(anthropic.AuthenticationError),
    ):
        wrong.messages.create(model=ALIAS, max_tokens=4, messages=MESSAGES)


def test_anthropic_tools_reach_the_template(anth: Any) -> None:
    c = anth
    tool = {"name": "get_weather", "description": "the weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}}  # fmt: skip
    plain = c.messages.count_tokens(model=ALIAS, messages=MESSAGES).input_tokens
    offered = c.messages.count_tokens(model=ALIAS, messages=MESSAGES, tools=[tool])
    assert offered.input_tokens > plain  # the template lists the tool
    # tool_choice none: no tool offered at all (the engine alone would make it "auto")
    none = c.messages.count_tokens(model=ALIAS, messages=MESSAGES, tools=[tool],
                                   tool_choice={"type": "none"})  # fmt: skip
    assert none.input_tokens == plain
    msg = c.messages.create(model=ALIAS, max_tokens=24, messages=MESSAGES, tools=[tool],
                            tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    assert msg.stop_reason in ("tool_use", "end_turn", "max_tokens")
    for block in msg.content:
        if block.type == "tool_use":
            assert block.name == "get_weather"


# ------------------------------------------------------------------ langchain-openai


def test_langchain_chat_with_tools(srv: ServerProcess) -> None:
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:  # closed here, not at exit
        llm = ChatOpenAI(model=ALIAS, base_url=srv.url + "/v1", api_key=KEY, max_tokens=24,
                         temperature=0, max_retries=0, timeout=REQUEST_TIMEOUT_S,
                         http_client=http)  # fmt: skip
        answer = llm.bind_tools([get_weather]).invoke(
            [("system", "You answer by calling a function."), ("user", "Weather in Oslo?")]
        )
    assert isinstance(answer, AIMessage)
    assert all(call["name"] == "get_weather" for call in answer.tool_calls)
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] >= 1


def test_langchain_completions_with_list_prompts(srv: ServerProcess) -> None:
    from langchain_openai import OpenAI

    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:  # closed here, not at exit
        llm = OpenAI(model=MODEL_ID, base_url=srv.url + "/v1", api_key=KEY, max_tokens=3,
                     max_retries=0, timeout=REQUEST_TIMEOUT_S, http_client=http)  # fmt: skip
        out = llm.batch([PROMPT, "One, two, three,"])  # one request, prompt as a list
        assert len(out) == 2 and all(isinstance(t, str) for t in out)
        assert isinstance(llm.invoke(PROMPT), str)


def test_langchain_with_structured_output(srv: ServerProcess) -> None:
    """``with_structured_output`` (its default, ``method="json_schema"``) sends
    ``response_format`` with the schema; the engine constrains the answer to it and
    LangChain parses it into the model class."""
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]

    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:  # closed here, not at exit
        llm = ChatOpenAI(model=ALIAS, base_url=srv.url + "/v1", api_key=KEY, max_tokens=16,
                         temperature=0, max_retries=0, timeout=REQUEST_TIMEOUT_S,
                         http_client=http)  # fmt: skip
        out = llm.with_structured_output(Verdict, include_raw=True).invoke(
            [("user", "Is Paris in France? Answer in JSON.")]
        )
    assert out["parsing_error"] is None, out["raw"]
    assert isinstance(out["parsed"], Verdict)


# ------------------------------------------------------------------ the llm command line


def run_llm(srv: ServerProcess, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    home = tmp_path / "llm"
    home.mkdir(exist_ok=True)
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: slm-completion\n  model_name: {MODEL_ID}\n  api_base: {srv.url}/v1\n"
        "  api_key_name: slm\n  completion: true\n"
        f"- model_id: slm-responses\n  model_name: {ALIAS}\n  api_base: {srv.url}/v1\n"
        "  api_key_name: slm\n  responses: true\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "LLM_"))}
    env.update(LLM_USER_PATH=str(home), LLM_LOAD_PLUGINS="")
    llm = Path(sys.executable).parent / "llm"
    return subprocess.run([str(llm), *args, "--key", KEY], capture_output=True, text=True,
                          env=env, timeout=REQUEST_TIMEOUT_S, check=False)  # fmt: skip


@pytest.mark.parametrize("stream", ["--no-stream", "stream"])
def test_llm_cli_completion_model(srv: ServerProcess, tmp_path: Path, stream: str) -> None:
    flags = ["--no-stream"] if stream == "--no-stream" else []
    done = run_llm(srv, tmp_path, "-m", "slm-completion", *flags, "-o", "max_tokens", "3", PROMPT)
    assert done.returncode == 0, done.stderr
    assert "Error" not in done.stderr


def test_llm_cli_responses_model(srv: ServerProcess, tmp_path: Path) -> None:
    done = run_llm(srv, tmp_path, "-m", "slm-responses", "-o", "max_tokens", "4", PROMPT)
    assert done.returncode == 0, done.stderr
