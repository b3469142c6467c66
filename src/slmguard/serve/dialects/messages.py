"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), made ready.

Owns :func:`prepare_messages` and :func:`messages_body`: the fields that only
label the request dropped, its ``tool_choice`` honoured as the engine can
(:func:`anthropic_tools`), every string its template renders checked for
control tokens, the prompt counted by the engine
(``/v1/messages/count_tokens``) and sized like chat (``max_tokens``). Its
stream is named events, its errors Anthropic's shape (the envelope's). It must
not admit, queue or send the generation (the relay's), nor import another
dialect.
"""

from __future__ import annotations

from typing import Any

from slmguard.errors import RequestError
from slmguard.serve.dialects.context import DialectContext, refuse_required_tool_without_tools
from slmguard.serve.generation import Generation
from slmguard.serve.labels import ANTHROPIC_LABEL_FIELDS


async def prepare_messages(ctx: DialectContext, data: dict[str, Any]) -> Generation:
    """An Anthropic Messages request made ready: labels dropped, its ``tool_choice``
    honoured (see :func:`anthropic_tools`), sized like chat."""
    ctx.sizing.check_parts("messages", len(data["messages"]), "messages")
    body = await messages_body(ctx, data)
    prompt_tokens = await ctx.count_input_tokens(
        "/v1/messages/count_tokens",
        {k: v for k, v in body.items() if k not in ("stream", "max_tokens")},
    )
    stream = bool(data.get("stream"))
    sized = ctx.sizing.size("messages", prompt_tokens, data.get("max_tokens"), n=1,
                            stream=stream)  # fmt: skip
    body["max_tokens"] = sized.max_tokens
    return Generation("messages", "/v1/messages", body, stream, False, sized)


async def messages_body(ctx: DialectContext, data: dict[str, Any]) -> dict[str, Any]:
    """The engine's body of a Messages (or count_tokens) request, its strings checked."""
    body = anthropic_tools({k: v for k, v in data.items() if k not in ANTHROPIC_LABEL_FIELDS})
    body["model"] = ctx.model.id
    await ctx.refuse_control_tokens(body)
    return body


def anthropic_tools(body: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's ``tool_choice`` as the engine honours it: ``none`` sends no tools,
    ``tool`` sends only the named one with ``any`` (the engine's ``required``); a name
    that is not among the tools, or ``any`` without tools, is a 400."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return body
    if choice["type"] == "none":
        return {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
    refuse_required_tool_without_tools(body)
    if choice["type"] == "tool":
        named = [t for t in body.get("tools") or () if t.get("name") == choice["name"]]
        if not named:
            raise RequestError(f"tool_choice names {choice['name']!r}, which is not in tools",
                               code="invalid_value", param="tool_choice")  # fmt: skip
        return {**body, "tools": named, "tool_choice": {"type": "any"}}
    return body
