"""What every dialect is given to prepare a request, and what they share.

Owns :class:`DialectContext`: the engine's own count of a prompt (``/tokenize``
and the count routes, each call watched by the relay that runs the engine, so
a wedged engine never leaves a client hanging), the control-token check of the
text a client sends, the sizing (:class:`~slmguard.serve.sizing.Sizing`), the
served model, the session store and the served projector (a request's images
checked against it, :meth:`DialectContext.check_images`); :func:`only_the_named_tool`,
the one way a named ``tool_choice`` is honoured. A dialect reaches the engine only through
the ``call_json`` it is given here; it never admits, queues or relays (the
relay's), nor decides ``max_tokens`` itself (the sizing's).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from slmguard.errors import EngineError, RequestError
from slmguard.serve.generation import Message
from slmguard.serve.vision import NO_IMAGES, Images, no_projector

if TYPE_CHECKING:
    from slmguard.serve.served import ServedModel
    from slmguard.serve.sessions import SessionService
    from slmguard.serve.sizing import Sizing
    from slmguard.serve.vision import ServedVision

#: POST a body to one of the engine's routes (watched): its JSON answer, or its refusal raised.
CallJson = Callable[[str, Any], Awaitable[Any]]


class DialectContext:
    """One engine's side of preparing a request (see the module docstring)."""

    def __init__(
        self,
        call_json: CallJson,
        sizing: Sizing,
        model: ServedModel,
        sessions: SessionService | None,
        vision: ServedVision | None = None,
    ) -> None:
        self.call_json = call_json
        self.sizing = sizing
        self.model = model
        self.sessions = sessions
        self.vision = vision

    def check_images(self, found: list[tuple[str, str]]) -> Images:
        """A request's images (``(field, url)`` each, as the dialect found them) held to
        the served projector's bounds before the engine sees anything: their count, tokens
        and transient bytes; a 400 naming the field otherwise (the first image's on a
        server without a projector)."""
        if not found:
            return NO_IMAGES
        if self.vision is None:
            raise no_projector(found[0][0])
        return self.vision.check(found)

    async def count_tokens(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> int:
        """``text``'s tokens as the engine counts a prompt's (the vocabulary's BOS and
        EOS added, special tokens parsed), or as asked."""
        body = {"content": text, "add_special": add_special, "parse_special": parse_special}
        data = await self.call_json("/tokenize", body)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list):
            raise EngineError("the engine's /tokenize answer has no tokens")
        return len(tokens)

    async def count_input_tokens(self, route: str, body: dict[str, Any]) -> int:
        """The engine's ``input_tokens`` for ``body`` at its count ``route``."""
        data = await self.call_json(route, body)
        value = data.get("input_tokens") if isinstance(data, dict) else None
        if not isinstance(value, int):
            raise EngineError(f"the engine's {route} answer has no input_tokens")
        return value

    async def refuse_control_tokens(self, messages: list[Message]) -> None:
        """400 when message text holds one of the model's control tokens.

        llama-server renders the chat template to text and tokenizes it with special
        tokens parsed, so a message holding ``<end_of_turn>`` (Gemma) or ``<|im_end|>``
        (ChatML models) would end its turn and forge the next one. Text without
        ``<`` or ``[`` (the shape of every common control token) is not checked; the
        rest is tokenized twice, with and without special parsing: a control token
        makes the counts differ.
        """
        texts = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts += [str(p.get("text", "")) for p in content if isinstance(p, dict)]
        joined = "\n".join(t for t in texts if "<" in t or "[" in t)
        if await self.holds_control_token(joined):
            raise RequestError(
                "a message contains text that is one of this model's control tokens (such as a "
                "turn marker); it would forge a turn of the conversation, so it is refused",
                code="control_token_in_message",
                param="messages",
            )

    async def holds_control_token(self, text: str) -> bool:
        """Whether ``text`` holds one of the model's control tokens: not when it has no
        ``<`` or ``[`` (the shape of every common control token); else it is tokenized
        twice, with and without special parsing, and a control token makes the counts
        differ."""
        if "<" not in text and "[" not in text:
            return False
        counts = [
            await self.count_tokens(text, add_special=False, parse_special=parse)
            for parse in (True, False)
        ]
        return counts[0] != counts[1]


def texts(head: Any, items: list[Any]) -> list[Message]:
    """The text of a request's instructions or system prompt and its items or messages,
    as messages for :meth:`DialectContext.refuse_control_tokens` (which reads ``content``)."""
    out: list[Message] = []

    def add(value: Any) -> None:
        if isinstance(value, str):
            out.append({"content": value})
        elif isinstance(value, list):
            for part in value:
                if isinstance(part, dict):
                    for key in ("text", "content", "output", "thinking", "refusal", "arguments"):
                        add(part.get(key))
                    if isinstance(part.get("input"), dict):  # a tool_use block's arguments
                        add(json.dumps(part["input"], ensure_ascii=False))

    add(head)
    add(items)
    return out


def only_the_named_tool(
    body: dict[str, Any], name: str, name_of: Callable[[Any], Any], required: Any
) -> dict[str, Any]:
    """``body`` with its tools narrowed to the one named ``name`` (``name_of`` reads a
    tool's name in this dialect) and a call required (``required``: the dialect's word).

    The engine knows ``required`` (some tool must be called) but not a named tool, so a
    named ``tool_choice`` is honoured by giving it that tool alone: the template sees one
    tool and the engine's required call can only be that one. A name not among the
    tools is a 400 naming ``tool_choice``.
    """
    tools: Iterable[Any] = body.get("tools") or ()
    named = [t for t in tools if isinstance(t, dict) and name_of(t) == name]
    if not named:
        raise RequestError(f"tool_choice names {name!r}, which is not in tools",
                           code="invalid_value", param="tool_choice")  # fmt: skip
    return {**body, "tools": named, "tool_choice": required}
