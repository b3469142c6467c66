"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), made ready.

Owns :func:`prepare_messages` and :func:`messages_body`: the fields that only
label the request dropped, its ``tool_choice`` honoured as the engine can
(:func:`anthropic_tools`), a failed tool's result given as its error text
(:func:`tool_errors_as_text`), its ``image`` blocks (base64 only: a URL source is a
400) held to the served projector's bounds before the engine sees anything, every
string its template renders checked for control tokens, the prompt counted by the
engine without its images (``/v1/messages/count_tokens``, their tokens added:
:func:`count_messages`) and sized like chat (``max_tokens``). Its
stream is named events, its errors Anthropic's shape (the envelope's). It must
not admit, queue or send the generation (the relay's), nor import another
dialect.
"""

from __future__ import annotations

from typing import Any

from slmguard.errors import RequestError
from slmguard.serve.dialects.context import (
    DialectContext,
    only_the_named_tool,
    refuse_required_tool_without_tools,
)
from slmguard.serve.generation import Generation
from slmguard.serve.labels import ANTHROPIC_LABEL_FIELDS
from slmguard.serve.vision import Images


async def prepare_messages(ctx: DialectContext, data: dict[str, Any]) -> Generation:
    """An Anthropic Messages request made ready: labels dropped, its ``tool_choice``
    honoured (see :func:`anthropic_tools`), its images bounded, sized like chat."""
    ctx.sizing.check_parts("messages", len(data["messages"]), "messages")
    body, images = await messages_body(ctx, data)
    prompt_tokens = await count_messages(ctx, body, images)
    stream = bool(data.get("stream"))
    sized = ctx.sizing.size("messages", prompt_tokens, data.get("max_tokens"), n=1,
                            stream=stream, transient_bytes=images.transient_bytes)  # fmt: skip
    body["max_tokens"] = sized.max_tokens
    return Generation("messages", "/v1/messages", body, stream, False, sized)


async def messages_body(ctx: DialectContext, data: dict[str, Any]) -> tuple[dict[str, Any], Images]:
    """The engine's body of a Messages (or count_tokens) request, its images held to the
    served projector's bounds before the engine sees anything, then its text checked."""
    body = anthropic_tools({k: v for k, v in data.items() if k not in ANTHROPIC_LABEL_FIELDS})
    body["model"] = ctx.model.id
    images = ctx.check_images(message_images(body["messages"]))
    body["messages"] = tool_errors_as_text(body["messages"])
    await ctx.refuse_control_tokens(body)
    return body, images


async def count_messages(ctx: DialectContext, body: dict[str, Any], images: Images) -> int:
    """The prompt's tokens: the engine's count of it without its images, and theirs."""
    sent = {k: v for k, v in body.items() if k not in ("stream", "max_tokens")}
    sent["messages"] = [_without_images(m) for m in body["messages"]]
    return await ctx.count_input_tokens("/v1/messages/count_tokens", sent) + images.tokens


def message_images(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each ``image`` block of the user's messages as a data URL, with the field named in
    errors (its ``source.data``); one in an assistant message, or from a URL, is a 400."""
    found = []
    for i, m in enumerate(messages):
        content = m.get("content")
        for j, block in enumerate(content if isinstance(content, list) else ()):
            if block.get("type") != "image":
                continue
            where = f"messages.{i}.content.{j}"
            source = block["source"]
            if source["type"] == "url":
                raise RequestError(
                    f"{where}.source: only base64 images are accepted, not a URL: this server "
                    "fetches nothing", code="image_url_not_allowed", param=f"{where}.source",
                )  # fmt: skip
            if m.get("role") != "user":
                raise RequestError(f"{where}: images go in the user's messages",
                                   code="invalid_value", param=where)  # fmt: skip
            url = f"data:{source['media_type']};base64,{source['data']}"
            found.append((f"{where}.source.data", url))
    return found


def _without_images(m: dict[str, Any]) -> dict[str, Any]:
    """A message without its image blocks (their tokens are counted apart)."""
    content = m.get("content")
    if not isinstance(content, list) or all(b.get("type") != "image" for b in content):
        return m
    kept = [b for b in content if b.get("type") != "image"]
    return {**m, "content": kept or ""}


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
        return only_the_named_tool(body, choice["name"], lambda t: t.get("name"), {"type": "any"})
    return body


def tool_errors_as_text(messages: list[Any]) -> list[Any]:
    """``messages`` with each ``tool_result`` that has ``is_error: true`` given as the
    tool's error text, ``Error: <content>`` (the engine's converter drops the flag and
    a chat template has none: the model would read a failure as a result)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(_failed(b) for b in content):
            message = {**message, "content": [_as_error(b) if _failed(b) else b for b in content]}
        out.append(message)
    return out


def _failed(block: Any) -> bool:
    return (
        isinstance(block, dict)
        and block.get("type") == "tool_result"
        and bool(block.get("is_error"))
    )


def _as_error(block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content")
    if isinstance(content, list):  # text blocks only (the schema's); the engine joins them
        content = "".join(str(part.get("text", "")) for part in content)
    text = f"Error: {content}" if content else "Error"
    rest = {k: v for k, v in block.items() if k not in ("is_error", "content")}
    return {**rest, "content": text}
