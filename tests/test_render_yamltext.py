"""The fleet renderers' YAML writer: untrusted text stays one scalar, read back exactly.

Read back with PyYAML (YAML 1.1, what Ansible uses), ruamel.yaml (YAML 1.2)
and Ansible's own loader (``!unsafe``).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from slmguard.deploy.fleet.yamltext import Commented, Literal, Unsafe, comment_text, dump, quote

HOSTILE = [
    "x\n- hosts: all",
    "tiny\n[Service]\nExecStartPre=+/bin/touch /x\n",
    'it\'s "quoted" `and` $HOME ${HOME} {{ lookup("pipe", "id") }} {% raw %}',
    "nul\x00cr\rtab\tesc\x1b[31m del\x7f nel\x85 ls\u2028ps\u2029 rlo\u202e bom\ufeff",
    "a: b\n# c\n---\n...\n- d",
    "\\ trailing backslash \\",
    " leading and trailing spaces ",
    "emoji \U0001f999 and CJK 中文",
    "yes",
    "~",
    "!unsafe not a tag",
    "&anchor *alias",
    "",
    "Q" * 5000 + "\n- hosts: all",
]


def _load12(text: str) -> Any:
    return YAML(typ="safe", pure=True).load(io.StringIO(text))


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
@pytest.mark.parametrize("width", [None, 40, 150])
def test_hostile_text_is_one_scalar_holding_exactly_it(text: str, width: int | None) -> None:
    doc = {"name": text, "list": [text, {"key": text}]}
    if len(text) < 1000:  # YAML's simple keys are at most 1024 characters
        doc[text or "empty"] = 1
    out = dump(doc, header=text, width=width)
    assert out.isascii()
    assert yaml.safe_load(out) == doc
    assert _load12(out) == doc


@pytest.mark.parametrize("width", [20, 60])
def test_long_strings_are_split_under_the_width_and_unchanged(width: int) -> None:
    text = "word " * 40 + "nospacesatallinthispartofthestringthatgoesonandon" * 3 + "  end"
    out = dump({"k": text, "l": [text]}, width=width)
    assert yaml.safe_load(out) == {"k": text, "l": [text]}
    assert len(out.splitlines()) > 10
    for line in out.splitlines():
        assert len(line) <= width or "nospaces" in line, line


@settings(max_examples=300, deadline=None)
@given(st.text(), st.sampled_from([None, 12, 80]))
def test_any_text_round_trips(text: str, width: int | None) -> None:
    out = dump({"v": text, "l": [text]}, width=width)
    assert yaml.safe_load(out) == {"v": text, "l": [text]}


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_comments_never_end_early(text: str) -> None:
    out = dump(_commented_doc(text), header=text)
    assert yaml.safe_load(out) == {"a": 1, "b": [2]}
    for line in comment_text(text):
        assert line.startswith("#") and line.isascii() and "\n" not in line


def _commented_doc(text: str) -> dict[str, Any]:
    return {"a": Commented(1, text), "b": [Commented(2, text)]}


def test_unsafe_is_read_by_ansible_as_the_exact_text() -> None:
    """The tag itself; that Ansible then never templates it is run for real in
    tests/test_render_ansible.py (a lookup in a board name, with and without the tag)."""
    from ansible.parsing.yaml.loader import AnsibleLoader

    text = "{{ lookup('pipe', 'echo INJECTED') }}\n- hosts: all"
    out = dump({"v": Unsafe(text), "l": [Unsafe(text)]}, width=30)
    assert "!unsafe " in out
    assert AnsibleLoader(out).get_single_data() == {"v": text, "l": [text]}
    # ansible-core 2.19 templates `!unsafe ""` to None: the empty string goes untagged.
    assert dump({"v": Unsafe("")}) == '---\nv: ""\n'


def test_literal_blocks_hold_a_plan_exactly_and_fall_back_to_quotes() -> None:
    plan = '{\n  "a": "x\\n- hosts: all",\n  "b": [\n    1\n  ]\n}\n'
    out = dump({"plan.json": Literal(plan)})
    assert "plan.json: |2" in out
    assert yaml.safe_load(out) == {"plan.json": plan}
    for odd in ("no newline", "two\n\n", "trailing \n", "tab\there\n", " lead\n", "\u2028\n"):
        out = dump({"v": Literal(odd)})
        assert yaml.safe_load(out) == {"v": odd}, out


def test_scalars_and_keys() -> None:
    doc = {"t": True, "f": False, "n": None, "i": -3, "x": 1.5, "e": [], "m": {}, "yes": "no"}
    out = dump(doc)
    assert yaml.safe_load(out) == doc
    assert '"yes": "no"' in out  # a YAML 1.1 boolean word is never a plain key
    assert quote('a"b\\c') == '"a\\"b\\\\c"'
    with pytest.raises(ValueError):
        dump({"x": float("nan")})
    with pytest.raises(TypeError):
        dump({"x": object()})
    with pytest.raises(ValueError, match="1024"):
        dump({"k" * 2000: 1})
