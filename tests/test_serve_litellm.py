"""``litellm`` against a real server: chat and text completion (through its OpenAI
provider), Responses (its own HTTP client) and Anthropic Messages (its Anthropic provider).

Its own module because ``import litellm`` takes 15-21 s; ``LITELLM_OFFLINE_MODE=true``
keeps it off the network (without it the import fetches a model cost map from GitHub),
and the environment variables it sets at import are put back afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from serveproc import MODEL_ID, REQUEST_TIMEOUT_S, ServerProcess, start_server

pytestmark = pytest.mark.engine

KEY = "sk-litellm-test"
MESSAGES = [{"role": "user", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def litellm() -> Iterator[Any]:
    saved = dict(os.environ)
    os.environ["LITELLM_OFFLINE_MODE"] = "true"
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    try:
        import litellm as module

        yield module
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = start_server(tmp_path_factory.mktemp("litellm"),
                     ["--no-governor", "--max-tokens-cap", "32"], api_key=KEY)  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def test_litellm_chat_and_text_completion(litellm: Any, srv: ServerProcess) -> None:
    common = {"api_base": srv.url + "/v1", "api_key": KEY, "timeout": REQUEST_TIMEOUT_S,
              "num_retries": 0}  # fmt: skip
    chat = litellm.completion(model=f"openai/{MODEL_ID}", messages=MESSAGES, max_tokens=3,
                              **common)  # fmt: skip
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    text = litellm.text_completion(model=f"openai/{MODEL_ID}", prompt="One, two,",
                                   max_tokens=3, **common)  # fmt: skip
    assert isinstance(text.choices[0].text, str) and text.usage.completion_tokens >= 1


def test_litellm_responses(litellm: Any, srv: ServerProcess) -> None:
    resp = litellm.responses(model=f"openai/{MODEL_ID}", input="The capital of France is",
                             max_output_tokens=16, api_base=srv.url + "/v1", api_key=KEY,
                             timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    assert resp.status == "completed" and resp.usage.output_tokens <= 16


def test_litellm_anthropic_messages(litellm: Any, srv: ServerProcess) -> None:
    reply = litellm.completion(
        model=f"anthropic/{MODEL_ID}", messages=MESSAGES, max_tokens=3, api_base=srv.url,
        api_key=KEY, timeout=REQUEST_TIMEOUT_S,
    )  # fmt: skip
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1


# litellm's stream handler builds a pydantic model of a TypedDict whose ReadOnly item pydantic
# warns about (its code, not ours): the warning, an error under filterwarnings, broke the stream.
@pytest.mark.filterwarnings("ignore:Item .* on TypedDict class .* qualifier:UserWarning")
def test_litellm_stream_and_structured_output(litellm: Any, srv: ServerProcess) -> None:
    """``stream=True`` and ``response_format`` with a pydantic class (its JSON schema, which
    the engine holds the answer to)."""
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]

    common = {"api_base": srv.url + "/v1", "api_key": KEY, "timeout": REQUEST_TIMEOUT_S,
              "num_retries": 0}  # fmt: skip
    chunks = list(litellm.completion(model=f"openai/{MODEL_ID}", messages=MESSAGES,
                                     max_tokens=3, stream=True, **common))  # fmt: skip
    assert chunks and all(c.choices[0].delta is not None for c in chunks if c.choices)
    answer = litellm.completion(
        model=f"openai/{MODEL_ID}", max_tokens=32, temperature=0, response_format=Verdict,
        messages=[{"role": "user", "content": "Is Paris in France?"}], **common,
    )  # fmt: skip
    assert Verdict.model_validate_json(answer.choices[0].message.content)
