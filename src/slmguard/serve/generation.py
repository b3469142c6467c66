"""A prepared generation: the record a dialect hands the relay.

Owns :class:`Generation` (the engine's route and body, sized, with what the
front needs to answer it: the stream, the usage asked for, a session's turn)
and :class:`Turn` (a session's part of it), and the two rewrites every
OpenAI-shaped body takes once sized (:func:`openai_generation`,
:meth:`Generation.gather_stream`). Plain data: it does no I/O and imports
nothing of the server's parts (the dialects build it, the relay and the stream
read it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from slmguard.governor.request import SizedRequest

Message = dict[str, Any]


@dataclass
class Turn:
    """A session's part of a chat request."""

    session_id: str
    new_messages: list[Message]
    dropped_messages: int = 0
    stored: bool = True  # False: the answer came, the store could not keep the turn


@dataclass
class Generation:
    """A prepared request, ready to be admitted and sent."""

    endpoint: str  # "chat" | "completions" | "responses" | "messages" | "rerank"
    path: str  # the engine's route
    body: dict[str, Any]
    stream: bool
    include_usage: bool  # the client asked for the usage chunk
    sized: SizedRequest
    turn: Turn | None = None
    arrived_s: float = field(default_factory=time.monotonic)
    per_prompt: int = 1  # choices per prompt (n): usage counts a prompt once per n choices
    prompt_total: int | None = None  # the prompt tokens of every prompt (several prompts)
    gathered: bool = False  # a non-stream answer the front gathers from the engine's stream
    prompt_from_answer: bool = False  # the prompt tokens are counted from the answer's usage

    def gather_stream(self) -> None:
        """A non-stream request with several choices asked of the engine as a stream: its
        non-stream answer counts the usage of choice 0 only, its stream every choice's, so
        the relay gathers the stream into the answer (:mod:`slmguard.serve.gather`)."""
        self.gathered = True
        self.body["stream"] = True
        self.body["stream_options"] = {"include_usage": True}

    def session_header(self) -> dict[str, str]:
        """``X-Slmguard-Session-Dropped`` when the session lost its oldest turns, with
        ``X-Slmguard-Session-Stored: false`` when the store could not keep the turn (a
        full disk, say: the answer is whole)."""
        if self.turn is None or (self.turn.stored and not self.turn.dropped_messages):
            return {}
        headers = {"X-Slmguard-Session-Dropped": str(self.turn.dropped_messages)}
        if not self.turn.stored:
            headers["X-Slmguard-Session-Stored"] = "false"
        return headers


def openai_generation(
    path: str, body: dict[str, Any], data: dict[str, Any], sized: SizedRequest,
    turn: Turn | None,
) -> Generation:  # fmt: skip
    """A chat completion or completion once sized: its ``max_tokens`` the sized one, and
    the usage always asked of a stream (the front counts it; the client gets it only if
    it asked)."""
    body["max_tokens"] = sized.max_tokens
    opts = data.get("stream_options") or {}
    include_usage = bool(opts.get("include_usage"))
    if sized.stream:
        # The front needs the usage for its metrics and the session store.
        body["stream_options"] = {**opts, "include_usage": True}
    return Generation(sized.endpoint, path, body, sized.stream, include_usage, sized, turn)
