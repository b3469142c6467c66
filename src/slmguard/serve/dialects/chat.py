"""OpenAI's chat completions (``/v1/chat/completions``), made ready for the engine.

Owns :func:`prepare_chat`: a session's stored history in front of the new
messages (a session whose history no longer fits loses its oldest exchanges
until it does, and the answer says how many:
``slmguard.session.dropped_messages`` and ``X-Slmguard-Session-Dropped``), the
control-token check of every string the template renders (the new messages,
the tools, ...), their ``image_url`` parts held to the served projector's bounds
before the engine sees anything (a server without one: 400 naming the part; a
session turn takes none), the prompt counted as the engine will build it
(``/apply-template`` then ``/tokenize``, each image's tokens added), then sized; a
named ``tool_choice`` given to the engine as that tool alone, required; a
non-stream request with several choices is gathered from the engine's stream.
It must not admit, queue or send the generation (the relay's), nor import
another dialect.
"""

from __future__ import annotations

import logging
from typing import Any

from slmguard.errors import EngineError, RequestError
from slmguard.serve.dialects.context import (
    DialectContext,
    only_the_named_tool,
    refuse_required_tool_without_tools,
)
from slmguard.serve.generation import Generation, Message, Turn, openai_generation

log = logging.getLogger(__name__)

# Keys of a chat body /apply-template needs to build the same prompt as the completion.
_TEMPLATE_KEYS = (
    "messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
    "reasoning_effort", "response_format",
)  # fmt: skip


async def prepare_chat(
    ctx: DialectContext, data: dict[str, Any], session_id: str | None
) -> Generation:
    """A chat request (already validated by its schema) made ready for the engine."""
    sizing = ctx.sizing
    body = {k: v for k, v in data.items() if k not in ("session_id", "max_completion_tokens")}
    body["model"] = ctx.model.id
    choice = body.get("tool_choice")
    if isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}}
        name = choice["function"]["name"]
        body = only_the_named_tool(body, name, _function_name, "required")
    requested = data.get("max_completion_tokens") or data.get("max_tokens")
    new_messages: list[Message] = list(data["messages"])
    turn = None
    if session_id is not None:
        if ctx.sessions is None:
            raise RequestError("this server keeps no sessions (started with --no-sessions)",
                               code="sessions_unavailable", param="session_id")  # fmt: skip
        if (data.get("n") or 1) != 1:
            raise RequestError("a session turn has one answer: n must be 1", param="n",
                               code="invalid_value")  # fmt: skip
        turn = Turn(session_id, new_messages)
        body["messages"] = await ctx.sessions.session_prompt(session_id, new_messages)
    n = sizing.check_n(data.get("n"))
    sizing.check_parts("chat", len(new_messages), "messages")
    refuse_required_tool_without_tools(body)
    found = chat_images(new_messages)
    images = ctx.check_images(found)  # bounded before the engine sees anything (400)
    if images.count and turn is not None:
        field = found[0][0]
        raise RequestError(f"{field}: images are not kept in a session; send them without "
                           "session_id", code="invalid_value", param=field)  # fmt: skip
    await ctx.refuse_control_tokens({**body, "messages": new_messages})  # not the history
    prompt_tokens = await count_chat_tokens(ctx, body) + images.tokens
    if turn is not None and not sizing.fits(prompt_tokens, sizing.answer_room(requested)):
        prompt_tokens = await _fit_session(ctx, body, turn, prompt_tokens, requested)
    stream = bool(data.get("stream"))
    sized = sizing.size("chat", prompt_tokens, requested, n=n, stream=stream,
                        transient_bytes=images.transient_bytes)  # fmt: skip
    gen = openai_generation("/v1/chat/completions", body, data, sized, turn)
    if n > 1 and not stream:
        gen.gather_stream()  # never a session turn: a session takes n=1
    return gen


def chat_images(messages: list[Message]) -> list[tuple[str, str]]:
    """Each ``image_url`` part of ``messages``: (its field, its URL)."""
    found = []
    for i, m in enumerate(messages):
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part.get("type") == "image_url":
                found.append((f"messages.{i}.content.{j}.image_url.url", part["image_url"]["url"]))
    return found


def _without_images(m: Message) -> Message:
    """A message as the engine renders it, its images left out: text parts joined as the
    engine joins them around its media markers (their tokens are counted apart)."""
    content = m.get("content")
    if not isinstance(content, list) or all(p.get("type") == "text" for p in content):
        return m
    text = "\n".join(str(p["text"]) for p in content if p.get("type") == "text")
    return {**m, "content": text}


def _function_name(tool: dict[str, Any]) -> Any:
    function = tool.get("function")
    return function.get("name") if isinstance(function, dict) else None


async def count_chat_tokens(ctx: DialectContext, body: dict[str, Any]) -> int:
    """The prompt's tokens as the engine builds it, images left out (the caller counts
    them): its template applied, then tokenized."""
    sent = {k: body[k] for k in _TEMPLATE_KEYS if k in body}
    sent["messages"] = [_without_images(m) for m in sent["messages"]]
    data = await ctx.call_json("/apply-template", sent)
    prompt = data.get("prompt") if isinstance(data, dict) else None
    if not isinstance(prompt, str):
        raise EngineError("the engine's /apply-template answer has no prompt")
    return await ctx.count_tokens(prompt)


async def _fit_session(
    ctx: DialectContext, body: dict[str, Any], turn: Turn, prompt_tokens: int,
    requested: int | None,
) -> int:  # fmt: skip
    """Drop the session's oldest turns until prompt + answer fit one slot (and store that)."""
    messages: list[Message] = body["messages"]
    systems = [m for m in messages if m.get("role") == "system"]
    n_new = len(turn.new_messages)
    stored = [m for m in messages[: len(messages) - n_new] if m.get("role") != "system"]
    room = ctx.sizing.answer_room(requested)
    dropped = 0
    while stored and not ctx.sizing.fits(prompt_tokens, room):
        # Drop a whole exchange: the oldest message and what follows up to the next user
        # turn.
        cut = 1
        while cut < len(stored) and stored[cut].get("role") != "user":
            cut += 1
        stored = stored[cut:]
        dropped += cut
        body["messages"] = [*systems, *stored, *turn.new_messages]
        prompt_tokens = await count_chat_tokens(ctx, body)
    if dropped:
        assert ctx.sessions is not None
        await ctx.sessions.drop_oldest(turn.session_id, dropped)
        turn.dropped_messages = dropped
        log.info("session %s: dropped its %d oldest messages to fit the context",
                 turn.session_id, dropped)  # fmt: skip
    return prompt_tokens
