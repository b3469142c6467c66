"""The engine's answers, read: JSON or nothing, its refusals, the usage it states.

Owns what the front takes from llama-server's answers, whole or streamed:
:func:`loads` (JSON, or None), :func:`engine_refusal` (the engine's own error
answer as an error of :mod:`slmguard.errors`: busy, broken, or its 4xx relayed),
the usage in each API's names (:func:`completion_tokens`,
:func:`event_usage` for the named events of a stream, :func:`add_usage` summed
over choices), and :class:`TurnBuilder`, one choice's message assembled from
streamed deltas. Pure: no I/O, no web stack.
"""

from __future__ import annotations

import json
from typing import Any

from slmguard.errors import (
    APIError,
    EngineBusyError,
    EngineError,
    GrammarLimitError,
    SlmguardError,
)

Message = dict[str, Any]
#: The endpoints whose streams are named events (``event:`` lines) ending with the body.
EVENT_STREAMS = frozenset({"responses", "messages"})


def loads(raw: bytes | str) -> Any:
    """JSON, or None when it is not."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


#: The engine's error type for a grammar past its work bound (slmguard's engine patch).
GRAMMAR_LIMIT = "grammar_limit_error"


def engine_refusal(status: int, data: Any, *, grammar_param: str | None = None) -> SlmguardError:
    """llama-server's own error answer: busy (503), broken (5xx), its grammar bound (400
    naming ``grammar_param``, the field the grammar came from: :class:`GrammarLimitError`,
    whatever status a stream's error event is read with), or its 4xx relayed."""
    err = data.get("error") if isinstance(data, dict) else None
    message = str(err.get("message", "")) if isinstance(err, dict) else ""
    kind = str(err.get("type", "")) if isinstance(err, dict) else ""
    if kind == GRAMMAR_LIMIT:
        where = f"{grammar_param}: " if grammar_param else ""
        return GrammarLimitError(
            f"{where}{message or 'the grammar needs too much work per token'}; the engine "
            "stopped this request alone (an ambiguous grammar: fewer alternatives that "
            "match the same text)",
            param=grammar_param,
        )
    if status == 503:
        return EngineBusyError(f"the engine is busy: {message}")
    if status >= 500 or status < 400:
        return EngineError(f"engine error ({status}): {message}")
    return APIError(
        status, message or f"the engine refused the request ({status})",
        code=kind or "engine_refused", error_type="invalid_request_error",
    )  # fmt: skip


def completion_tokens(endpoint: str, usage: Any) -> int | None:
    """The generated tokens a JSON answer's usage states, in its API's names."""
    if not isinstance(usage, dict):
        return None
    key = "output_tokens" if endpoint in EVENT_STREAMS else "completion_tokens"
    value = usage.get(key)
    return value if isinstance(value, int) else None


def usage_count(usage: Any, key: str) -> int:
    """A count of an answer's usage (0 when it has none)."""
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def event_usage(event: str, obj: dict[str, Any]) -> tuple[int | None, Any]:
    """The generated tokens and timings a stream's last events state."""
    if event == "response.completed":
        usage = (obj.get("response") or {}).get("usage")
        return completion_tokens("responses", usage), obj.get("timings")
    if event == "message_delta":
        return completion_tokens("messages", obj.get("usage")), None
    return None, None


def add_usage(total: Any, usage: Any, *, prompt: bool) -> Any:
    """OpenAI usage summed over choices: every choice's completion, each prompt once."""
    if not isinstance(usage, dict):
        return total
    if not isinstance(total, dict):
        total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    total["completion_tokens"] += int(usage.get("completion_tokens") or 0)
    if prompt:
        total["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    return total


class TurnBuilder:
    """Assembles the assistant message of one choice (choice 0 of a session turn) from
    streamed deltas."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def feed(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self.add(choice.get("delta") or {})

    def add(self, delta: dict[str, Any]) -> None:
        """One choice's delta: content, reasoning and tool-call parts appended."""
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        if isinstance(delta.get("reasoning_content"), str):
            self.reasoning.append(delta["reasoning_content"])
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            slot = self.calls.setdefault(
                int(call.get("index", 0)),
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call.get("id"):
                slot["id"] = call["id"]
            fn = call.get("function") or {}
            if fn.get("name"):
                slot["function"]["name"] += fn["name"]
            if fn.get("arguments"):
                slot["function"]["arguments"] += fn["arguments"]

    def message(self) -> Message:
        """The message as a session stores it (OpenAI's shape: no content beside calls)."""
        out: Message = {"role": "assistant", "content": "".join(self.content) or None}
        if self.calls:
            out["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        elif out["content"] is None:
            out["content"] = ""
        if self.reasoning:
            out["reasoning_content"] = "".join(self.reasoning)
        return out

    def engine_message(self) -> Message:
        """The message as the engine's own non-stream answer has it: ``content`` always a
        string, ``reasoning_content`` and ``tool_calls`` only when there are some, a call's
        ``id`` only when the model gave one."""
        out: Message = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            out["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            out["tool_calls"] = [
                {k: v for k, v in self.calls[i].items() if k != "id" or v}
                for i in sorted(self.calls)
            ]
        return out
