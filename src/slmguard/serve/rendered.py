"""Every string of a request that the engine's chat template renders into the prompt.

Owns :func:`rendered_strings`: from a chat, Responses or Messages body as the engine
gets it, each string the template may put in the prompt, with the path of the field
that holds it: message and item text, names, tool calls (names, call ids, arguments),
tool results, the system prompt and instructions, the tools (names, descriptions,
every key and string of their parameter schemas: property names, enum values, titles,
patterns), and what else the engine hands its template (``chat_template_kwargs``, the
``response_format``). llama-server tokenizes the rendered prompt with special tokens
parsed, so any of them holding ``<end_of_turn>`` would forge a turn; the dialects check
them all with one tokenizer comparison
(:meth:`slmguard.serve.dialects.context.DialectContext.refuse_control_tokens`). Keys
are strings too (argument keys, property names), and a call's ``arguments`` string is
read as the JSON the engine parses and renders again. Pure: no I/O, no engine.
"""

from __future__ import annotations

import json
from typing import Any

#: The fields of a chat, Responses or Messages body the engine hands its chat template
#: (the messages or input items, the system prompt or instructions, the tools and the tool
#: choice, the template's own arguments, the output format the engine may describe).
RENDERED_FIELDS = (
    "messages", "input", "system", "instructions", "tools", "tool_choice",
    "chat_template_kwargs", "response_format",
)  # fmt: skip
#: A string the engine parses as JSON and renders again (``tojson``): its escapes
#: (``\\u003e``) are undone there, so its decoded keys and strings are checked too.
JSON_STRINGS = ("arguments",)
#: Strings the control-token check need not tokenize: no control token of the models
#: served has neither of these characters (``<end_of_turn>``, ``<|im_end|>``, ``[INST]``).
CONTROL_MARKS = ("<", "[")


def rendered_strings(body: Any) -> list[tuple[str, str]]:
    """(path, text) of every string (keys included) under :data:`RENDERED_FIELDS` of
    ``body``; the path is dotted (``tools.0.function.parameters``)."""
    if not isinstance(body, dict):
        return []
    out: list[tuple[str, str]] = []
    for field in RENDERED_FIELDS:
        if field in body:
            out += _strings(body[field], (field,))
    return out


def suspect_strings(body: Any) -> list[tuple[str, str]]:
    """The rendered strings that may hold a control token (:data:`CONTROL_MARKS`)."""
    return [(p, t) for p, t in rendered_strings(body) if any(m in t for m in CONTROL_MARKS)]


def _strings(value: Any, path: tuple[Any, ...]) -> list[tuple[str, str]]:
    """Iteratively (a body nested as deep as the bounds allow must not exhaust the stack)."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [(path, value)]
    while stack:
        here, v = stack.pop()
        if isinstance(v, str):
            out.append((_name(here), v))
            if here and here[-1] in JSON_STRINGS:
                decoded = _json(v)
                if isinstance(decoded, (dict, list)):
                    stack.append((here, decoded))
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str):
                    out.append((_name((*here, k)), k))  # a key is rendered too
                stack.append(((*here, k), x))
        elif isinstance(v, list):
            stack.extend(((*here, i), x) for i, x in enumerate(v))
    return out


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # the bounds cap a body's nesting, not a string's
        return None


def _name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)
