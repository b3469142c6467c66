"""What every dialect is given to prepare a request, and what they share.

Owns :class:`DialectContext`: the engine's own count of a prompt (``/tokenize``
and the count routes, each call watched by the relay that runs the engine, so
a wedged engine never leaves a client hanging), the one control-token check of
every string the chat template renders (:mod:`slmguard.serve.rendered`), a
tool call required without tools refused, the sizing
(:class:`~slmguard.serve.sizing.Sizing`), the served model, the session store and
the served projector (a request's images checked against it,
:meth:`DialectContext.check_images`); :func:`only_the_named_tool`, the one way a
named ``tool_choice`` is honoured. A dialect reaches the engine only through the
``call_json`` it is given here; it never admits, queues or relays (the relay's),
nor decides ``max_tokens`` itself (the sizing's).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from slmguard.errors import EngineError, RequestError
from slmguard.serve.rendered import suspect_strings
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

    async def refuse_control_tokens(self, body: dict[str, Any]) -> None:
        """400 naming the field when any string the chat template renders of ``body``
        (:func:`~slmguard.serve.rendered.rendered_strings`: messages, tools and their
        schemas, tool calls, names, ...) holds one of the model's control tokens.

        llama-server renders the chat template to text and tokenizes it with special
        tokens parsed, so a message or a tool description holding ``<end_of_turn>``
        (Gemma) or ``<|im_end|>`` (ChatML models) would end its turn and forge the next
        one. The strings with a ``<`` or ``[`` (the shape of every common control token)
        are joined and checked at once (:meth:`holds_control_token`); only when they hold
        one are they halved until the one that does is found, to name it.
        """
        suspects = suspect_strings(body)
        if not suspects or not await self.holds_control_token(_joined(suspects)):
            return
        while len(suspects) > 1:
            half = suspects[: len(suspects) // 2]
            suspects = half if await self.holds_control_token(_joined(half)) else (
                suspects[len(half):]
            )  # fmt: skip
        path = suspects[0][0]
        raise RequestError(
            f"{path} contains text that is one of this model's control tokens (such as a "
            "turn marker); the chat template renders it into the prompt, where it would "
            "forge a turn of the conversation, so it is refused",
            code="control_token_in_message",
            param=path,
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


def refuse_required_tool_without_tools(body: dict[str, Any]) -> None:
    """400 naming ``tool_choice`` when it requires a tool call (``required``; Anthropic's
    ``any``) and the request has no tools: the engine then answered 200 with plain text,
    which a client that required a call would read as one."""
    choice = body.get("tool_choice")
    required = choice == "required" or (isinstance(choice, dict) and choice.get("type") == "any")
    if required and not body.get("tools"):
        raise RequestError("tool_choice requires a tool call, and the request has no tools",
                           code="invalid_value", param="tool_choice")  # fmt: skip


def _joined(strings: list[tuple[str, str]]) -> str:
    return "\n".join(text for _, text in strings)


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
