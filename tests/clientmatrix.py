"""What the client matrix's two modules share (issue 38): one server's arguments, its key
and model alias, the classes the libraries parse into, and the count of a prompt.

``tests/test_serve_clients_matrix.py`` (the libraries of the test extra, in ``make test``)
and ``tests/test_serve_clients_agents.py`` (the agent frameworks and the openai<3
libraries, ``make test`` with ``--clients``) each start one server with these arguments. The
server runs the template fixture ``tests/fixtures/templates/tools-chatml.jinja``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel

from serveproc import REQUEST_TIMEOUT_S, ServerProcess

TEMPLATE = Path(__file__).parent / "fixtures" / "templates" / "tools-chatml.jinja"
KEY = "sk-matrix-test"
ALIAS = "gpt-4o-mini"
PROMPT = "The capital of France is"
SERVER_ARGS = ("--chat-template-file", str(TEMPLATE), "--n-parallel", "2", "--n-ctx", "4096",
               "--model-alias", ALIAS, "--no-governor", "--max-tokens-cap", "64")  # fmt: skip


class Weather(BaseModel):
    """The weather in a city."""

    city: str


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


def no_client_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No client library reads a key, a URL or a setting of this machine's environment."""
    for name in list(os.environ):
        if name.startswith(("OPENAI_", "ANTHROPIC_", "LLM_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")


def prompt_tokens(srv: ServerProcess, body: dict[str, Any]) -> int:
    """The prompt count of a chat request (what reached the engine: the template lists
    every tool it is given)."""
    resp = httpx.post(srv.url + "/v1/chat/completions", json={"model": ALIAS, **body},
                      headers={"Authorization": f"Bearer {KEY}"},
                      timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens"])
