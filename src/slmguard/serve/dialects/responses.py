"""OpenAI's Responses API (``/v1/responses``), made ready for the engine.

Owns :func:`prepare_responses` and :func:`responses_body`: the fields that only
label the request dropped (and an empty ``include``), ``text.format`` made the
engine's ``response_format``, an assistant item given its ``type``, a named
``tool_choice`` given as that tool alone, required, its ``input_image`` parts held
to the served projector's bounds before the engine sees anything, every string its
template renders checked for control tokens, the prompt counted by the engine
without its images (``/v1/responses/input_tokens``, also served as is; their tokens
added) and sized like chat (``max_output_tokens``). Its stream is named events, relayed as
they come. It must not admit, queue or send the generation (the relay's), nor
import another dialect.
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
from slmguard.serve.labels import LABEL_FIELDS

#: Fields of a Responses request the engine does not get: labels, and what the front
#: turns into the engine's own (``text.format``; ``max_output_tokens`` once sized), and
#: ``include`` (only an empty one is accepted: it asks for nothing).
_NOT_SENT = LABEL_FIELDS | {"text", "stream_options", "truncation", "include"}


async def prepare_responses(ctx: DialectContext, data: dict[str, Any]) -> Generation:
    """A Responses request made ready (:func:`responses_body`), counted and sized like chat."""
    images = ctx.check_images(input_images(data["input"]))  # before the engine sees any
    body = await responses_body(ctx, data)
    sent = {k: v for k, v in body.items() if k != "stream"}
    if images.count:
        sent["input"] = [_without_images(i) for i in body["input"]]
    prompt_tokens = await ctx.count_input_tokens("/v1/responses/input_tokens", sent) + images.tokens
    stream = bool(data.get("stream"))
    sized = ctx.sizing.size("responses", prompt_tokens, data.get("max_output_tokens"), n=1,
                            stream=stream, transient_bytes=images.transient_bytes)  # fmt: skip
    body["max_output_tokens"] = sized.max_tokens
    return Generation("responses", "/v1/responses", body, stream, False, sized)


async def responses_body(ctx: DialectContext, data: dict[str, Any]) -> dict[str, Any]:
    """The engine's body of a Responses (or input_tokens) request, its text checked:
    labels dropped, ``text.format`` made the engine's ``response_format``, an assistant
    item given its ``type``, a named ``tool_choice`` as that tool alone, required."""
    body = {k: v for k, v in data.items() if k not in _NOT_SENT}
    body["model"] = ctx.model.id
    items = body["input"] if isinstance(body["input"], list) else []
    body["input"] = [
        {"type": "message", **i} if "role" in i and "type" not in i else i for i in items
    ] or body["input"]
    fmt = (data.get("text") or {}).get("format")
    if fmt is not None and fmt["type"] == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt["type"] == "json_schema":
        spec = {k: v for k, v in fmt.items() if k != "type"}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    choice = body.get("tool_choice")
    if isinstance(choice, dict):  # {"type": "function", "name": ...}
        body = only_the_named_tool(body, choice["name"], lambda t: t.get("name"), "required")
    ctx.sizing.check_parts("responses", len(items), "input")
    refuse_required_tool_without_tools(body)
    await ctx.refuse_control_tokens(body)
    return body


def input_images(items: Any) -> list[tuple[str, str]]:
    """Each ``input_image`` of the input's messages: (its field, its URL); one in an
    assistant message is a 400."""
    found = []
    for i, item in enumerate(items if isinstance(items, list) else ()):
        content = item.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part.get("type") != "input_image":
                continue
            where = f"input.{i}.content.{j}"
            if item.get("role") == "assistant":
                raise RequestError(f"{where}: images go in the user's messages",
                                   code="invalid_value", param=where)  # fmt: skip
            found.append((f"{where}.image_url", part["image_url"]))
    return found


def _without_images(item: dict[str, Any]) -> dict[str, Any]:
    """An input item without its images (their tokens are counted apart)."""
    content = item.get("content")
    if not isinstance(content, list) or all(p.get("type") != "input_image" for p in content):
        return item
    kept = [p for p in content if p.get("type") != "input_image"]
    return {**item, "content": kept or ""}
