"""OpenAI's Responses API (``/v1/responses``), made ready for the engine.

Owns :func:`prepare_responses`: the fields that only label the request dropped,
``text.format`` made the engine's ``response_format``, an assistant item given
its ``type``, every string its template renders checked for control tokens,
the prompt counted by the engine (``/v1/responses/input_tokens``) and
sized like chat (``max_output_tokens``). Its stream is named events, relayed as
they come. It must not admit, queue or send the generation (the relay's), nor
import another dialect.
"""

from __future__ import annotations

from typing import Any

from slmguard.serve.dialects.context import DialectContext, refuse_required_tool_without_tools
from slmguard.serve.generation import Generation
from slmguard.serve.labels import LABEL_FIELDS

#: Fields of a Responses request the engine does not get: labels, and what the front
#: turns into the engine's own (``text.format``; ``max_output_tokens`` once sized).
_NOT_SENT = LABEL_FIELDS | {"text", "stream_options", "truncation"}


async def prepare_responses(ctx: DialectContext, data: dict[str, Any]) -> Generation:
    """A Responses request made ready: labels dropped, ``text.format`` made the engine's
    ``response_format``, an assistant item given its ``type``, sized like chat."""
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
    ctx.sizing.check_parts("responses", len(items), "input")
    refuse_required_tool_without_tools(body)
    await ctx.refuse_control_tokens(body)
    prompt_tokens = await ctx.count_input_tokens(
        "/v1/responses/input_tokens", {k: v for k, v in body.items() if k != "stream"}
    )
    stream = bool(data.get("stream"))
    sized = ctx.sizing.size("responses", prompt_tokens, data.get("max_output_tokens"), n=1,
                            stream=stream)  # fmt: skip
    body["max_output_tokens"] = sized.max_tokens
    return Generation("responses", "/v1/responses", body, stream, False, sized)
