"""Every string the chat template renders is found (:mod:`slmguard.serve.rendered`), pure.

Issue 37: ``<end_of_turn>`` was refused in message content but passed in tool
descriptions, parameter descriptions, enum values, schema titles, tool-call names, call
ids and argument keys, on chat, Messages and Responses. Each request below is swept:
every string position (keys included) in turn holds the control token, and the check's
input names it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from slmguard.serve.rendered import RENDERED_FIELDS, rendered_strings, suspect_strings

TOKEN = "<end_of_turn>"
SCHEMA = {
    "type": "object", "title": "Where", "description": "the place",
    "properties": {
        "city": {"type": "string", "description": "a city", "pattern": "^A.*$"},
        "unit": {"enum": ["c", "f"], "title": "Unit"},
    },
    "required": ["city"],
}  # fmt: skip
CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}], "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
    "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "the weather", "parameters": SCHEMA}}],
    "tool_choice": "auto",
    "max_tokens": 4,
}  # fmt: skip
MESSAGES = {
    "model": "m", "max_tokens": 4, "system": [{"type": "text", "text": "be brief"}],
    "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ],
    "tools": [{"name": "get_weather", "description": "the weather", "input_schema": SCHEMA}],
}  # fmt: skip
RESPONSES = {
    "model": "m", "instructions": "be brief",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "fc_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "fc_1", "output": "sunny"},
    ],
    "tools": [{"type": "function", "name": "get_weather", "description": "the weather",
               "parameters": SCHEMA}],
}  # fmt: skip


BODIES = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}


def positions(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], bool]]:
    """Every string position: (path, is it a key)."""
    out: list[tuple[tuple[Any, ...], bool]] = []
    if isinstance(value, str):
        out.append((path, False))
    elif isinstance(value, dict):
        for k, v in value.items():
            out.append(((*path, k), True))
            out += positions(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += positions(v, (*path, i))
    return out


def planted(body: dict[str, Any], path: tuple[Any, ...], key: bool) -> dict[str, Any]:
    out = copy.deepcopy(body)
    parent = out
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if key:
        parent[f"{last}{TOKEN}"] = parent.pop(last)
    else:
        parent[last] = f"{parent[last]}{TOKEN}"
    return out


@pytest.mark.parametrize("body", [CHAT, MESSAGES, RESPONSES], ids=["chat", "messages", "responses"])
def test_every_string_position_the_template_renders_is_checked(body: dict[str, Any]) -> None:
    assert not suspect_strings(body)
    swept = 0
    for path, key in positions(body):
        if path[0] not in RENDERED_FIELDS:
            continue
        if key and len(path) == 1:
            continue  # the field's own name: that is another field
        found = suspect_strings(planted(body, path, key))
        assert any(TOKEN in text for _, text in found), path
        swept += 1
    assert swept > 30


def test_the_path_names_the_field() -> None:
    body = planted(CHAT, ("tools", 0, "function", "parameters", "properties", "unit", "enum", 1),
                   key=False)  # fmt: skip
    assert suspect_strings(body) == [
        ("tools.0.function.parameters.properties.unit.enum.1", f"f{TOKEN}")
    ]
    assert ("model", "m") not in rendered_strings(CHAT)  # not rendered by the template


def test_a_body_nested_deeper_than_python_recurses_is_walked() -> None:
    deep: Any = TOKEN
    for _ in range(5_000):  # the bounds stop a body at 64 levels before this runs
        deep = {"a": deep}
    assert len(suspect_strings({"tools": [deep]})) == 1


def test_items_and_blocks_of_every_shape_are_read() -> None:
    """Responses items and Messages blocks of each shape, and the system prompt."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "<a>"}]},
        {"type": "function_call_output", "call_id": "c", "output": "<b>"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"type": "text", "text": "<c>"}]}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {"q": "<d>"}}]},
    ]  # fmt: skip
    found = [text for _, text in suspect_strings({"system": "<sys>", "input": items})]
    assert sorted(found) == ["<a>", "<b>", "<c>", "<d>", "<sys>"]


def test_escaped_arguments_are_read_as_the_engine_renders_them() -> None:
    """A call's ``arguments`` is JSON the engine parses and renders again with
    ``tojson``: ``\\u003c`` there is a ``<`` in the prompt."""
    escaped = '{"\\u003cend_of_turn\\u003e": "\\u003cend_of_turn\\u003e"}'
    assert TOKEN not in escaped
    body = copy.deepcopy(CHAT)
    body["messages"][2]["tool_calls"][0]["function"]["arguments"] = escaped
    found = suspect_strings(body)
    paths = {path for path, text in found if text == TOKEN}
    args = "messages.2.tool_calls.0.function.arguments"
    assert paths == {f"{args}.{TOKEN}"}
    assert (f"{args}.{TOKEN}", TOKEN) in found  # the key, and the value under it
    assert len([1 for _, text in found if text == TOKEN]) == 2
    assert suspect_strings({"input": [{"arguments": "[" * 100_000}]})  # not JSON: as is
