"""A conversation that teaches the embedded base model to call a tool, for client tests.

The embedded Gemma 3 270M is a base model: asked once, it does not call a tool. Two
calls and their answers before the question (``few_shot``) make it answer, at
temperature 0, with a call of the same tool for the new city: what a client library
then parses into its tool call or its structured output. Messages are in OpenAI's chat
format.

A required call is held to the template's call syntax by the engine's grammar
(``tests/fixtures/templates/tools-chatml.jinja``: ``<tool_call>...</tool_call>``), but a
base model never ends its turn (its vocabulary has no ``<|im_end|>``, and it does not
emit its own end of turn), so after the call the grammar's trailing whitespace runs to
``max_tokens`` and the answer ends "length", which instructor refuses as incomplete.
:data:`STOP_AFTER_CALL`, sent as the request's ``stop``, ends the turn where an
instruct model would: after the call.
"""

from __future__ import annotations

import json
from typing import Any

#: The request's ``stop`` that ends a base model's turn after its call (see above).
STOP_AFTER_CALL = ["</tool_call>"]

CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


def tool(name: str, description: str = "the weather in a city") -> dict[str, Any]:
    """A chat ``tools`` entry taking one string, ``city``."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": CITY_SCHEMA},
    }


def call(call_id: str, name: str, city: str) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps({"city": city})}
    return {"id": call_id, "type": "function", "function": function}


def few_shot(name: str, question: str = "What is the weather in Paris?") -> list[dict[str, Any]]:
    """Two calls of ``name`` with their results and answers, then ``question``."""
    return [
        {"role": "system", "content": "You answer every question by calling a function."},
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", name, "Rome")]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny in Rome."},
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c2", name, "Oslo")]},
        {"role": "tool", "tool_call_id": "c2", "content": "snow"},
        {"role": "assistant", "content": "It snows in Oslo."},
        {"role": "user", "content": question},
    ]
