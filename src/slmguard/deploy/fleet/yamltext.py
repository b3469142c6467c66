"""YAML text from Python values, with untrusted strings that can never become syntax.

Owns the one YAML writer of the fleet renderers (:mod:`slmguard.deploy.fleet.ansible`,
:mod:`slmguard.deploy.fleet.k8s`, :mod:`slmguard.deploy.fleet.kubelet`): block style
only, no anchors, aliases or flow collections but ``[]`` and ``{}``. The rules:

- every string is double-quoted, in printable ASCII: anything outside 0x20-0x7e
  (newlines, NUL, C1, U+2028/9, a BOM, non-ASCII letters) escaped as ``\\xXX``,
  ``\\uXXXX`` or ``\\UXXXXXXXX``, read alike by YAML 1.1 and 1.2;
- keys are plain only in this module's own shape (``[A-Za-z_][A-Za-z0-9_./-]*``, not
  a YAML 1.1 boolean or null word), otherwise quoted;
- :class:`Commented` text is printable ASCII (others become ``?``), one ``#`` per line;
  a :class:`Literal` is a ``|`` block only when every line is printable ASCII;
- :class:`Unsafe` strings carry Ansible's ``!unsafe`` tag (never templated), but the
  empty string (ansible-core 2.19 templates ``!unsafe ""`` to None).

It must not decide what the documents say (the renderers do) nor write files.

Example::

    dump({"name": "x\\n- hosts: all", "size": 3})
    # '---\\nname: "x\\\\n- hosts: all"\\nsize: 3\\n'
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Commented", "Literal", "Unsafe", "comment_text", "dump", "dump_all", "quote"]

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
# YAML 1.1 reads these plain words as booleans or null (PyYAML and Ansible do).
_SPECIAL_WORDS = {
    "y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf",
}  # fmt: skip
_INDENT = "  "
_SHORT_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
#: YAML's limit on a simple (implicit) key.
MAX_KEY_CHARS = 1024
#: Comment lines are wrapped at this width (the text stays on its own lines).
COMMENT_WIDTH = 100


@dataclass(frozen=True)
class Unsafe:
    """A string Ansible must never template (written with the ``!unsafe`` tag)."""

    text: str


@dataclass(frozen=True)
class Literal:
    """A multi-line text written as a ``|`` block scalar when that is exact and safe.

    Only for text made of printable-ASCII lines with no trailing blanks that
    ends in one newline (a plan's JSON, which escapes everything else); any
    other text is written double-quoted instead. The block's indentation
    indicator is explicit, so a first line starting with a space is kept.
    """

    text: str


@dataclass(frozen=True)
class Commented:
    """A value with the comment lines written above its key (or list item)."""

    value: Any
    comment: str


def _tokens(text: str) -> list[str]:
    """Each character of ``text`` as it is written inside double quotes."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        elif ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif 0x20 <= code <= 0x7E:
            out.append(ch)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return out


def quote(text: str) -> str:
    """``text`` as a double-quoted YAML scalar in printable ASCII (see the module docstring)."""
    return '"' + "".join(_tokens(text)) + '"'


def _quote_lines(text: str, first_col: int, indent: str, width: int) -> list[str]:
    """``quote(text)`` over several lines, each at most ``width`` where it can be.

    Lines end in an escaped line break (``\\``), which YAML drops together with
    the next line's indentation; a space that would start a line is written
    ``\\ `` (leading white space is not content). Breaks go after a space when
    there is one, and never inside an escape: the value is unchanged.
    """
    tokens = _tokens(text)
    lines: list[str] = []
    line: list[str] = ['"']
    col = first_col + 1
    for tok in tokens:
        if col + len(tok) + 2 > width and len(line) > 1:
            cut = max((i for i, t in enumerate(line) if t == " "), default=-1)
            keep, carry = (line[: cut + 1], line[cut + 1 :]) if cut > 0 else (line, [])
            lines.append("".join(keep) + "\\")
            if carry and carry[0] == " ":
                carry[0] = "\\ "
            line = [indent, *carry]
            col = sum(len(t) for t in line)
        if tok == " " and len(line) == 1 and line[0] == indent:
            tok = "\\ "
        line.append(tok)
        col += len(tok)
    lines.append("".join(line) + '"')
    return lines


def comment_text(text: str) -> list[str]:
    """Comment lines (``# ...``) for ``text``: printable ASCII, one per line of it."""
    lines = []
    for line in text.split("\n"):
        safe = "".join(c if 0x20 <= ord(c) <= 0x7E else "?" for c in line).rstrip()
        wrapped = textwrap.wrap(safe, COMMENT_WIDTH, break_on_hyphens=False) or [""]
        lines += [f"# {part}" if part else "#" for part in wrapped]
    return lines


def _key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"YAML keys here are strings, not {type(key).__name__}")
    written = key if _PLAIN_KEY.fullmatch(key) and key.lower() not in _SPECIAL_WORDS else quote(key)
    if len(written) > MAX_KEY_CHARS:
        raise ValueError(f"a YAML key is at most 1024 characters, not {len(written)}")
    return written


def _scalar(value: object) -> str:
    if isinstance(value, Unsafe):
        return "!unsafe " + quote(value.text) if value.text else '""'
    if isinstance(value, Literal):
        return quote(value.text)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"not a finite number: {value!r}")
        return repr(value)
    if value is None:
        return "null"
    if isinstance(value, str):
        return quote(value)
    raise TypeError(f"cannot write a {type(value).__name__} as YAML")


_LITERAL_LINE = re.compile(r"[ -~]*[!-~]|")


def _literal_ok(text: str) -> bool:
    if not text.endswith("\n") or text.endswith("\n\n"):
        return False
    return all(_LITERAL_LINE.fullmatch(line) for line in text[:-1].split("\n"))


def _literal_lines(text: str, depth: int) -> list[str]:
    pad = _INDENT * depth
    return [pad + line if line else "" for line in text[:-1].split("\n")]


def _is_block(value: object) -> bool:
    """A non-empty mapping or list: written on the lines below its key."""
    if isinstance(value, Mapping):
        return bool(value)
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value)


def _inline(value: object) -> str:
    """A value that fits after ``key: `` or ``- ``: a scalar or an empty collection."""
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[]"
    return _scalar(value)


def _string_of(value: object) -> tuple[str, str] | None:
    """(tag prefix, text) of a string scalar, None for anything else."""
    if isinstance(value, Unsafe):
        return ("!unsafe " if value.text else ""), value.text
    if isinstance(value, Literal):
        return "", value.text
    if isinstance(value, str):
        return "", value
    return None


def _entry(lead: str, value: object, depth: int, width: int | None) -> list[str]:
    """``lead`` (``key: `` or ``- ``, indented) followed by an inline value."""
    line = lead + _inline(value)
    string = _string_of(value)
    if width is None or len(line) <= width or string is None:
        return [line]
    tag, text = string
    indent = _INDENT * (depth + 1)
    parts = _quote_lines(text, len(lead) + len(tag), indent, width)
    return [lead + tag + parts[0], *parts[1:]]


def _lines(value: object, depth: int, width: int | None = None) -> list[str]:
    pad = _INDENT * depth
    out: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(item, Commented):
                out += [pad + line for line in comment_text(item.comment)]
                item = item.value
            if isinstance(item, Literal) and _literal_ok(item.text):
                out.append(f"{pad}{_key(key)}: |{len(_INDENT)}")
                out += _literal_lines(item.text, depth + 1)
            elif _is_block(item):
                out.append(f"{pad}{_key(key)}:")
                out += _lines(item, depth + 1, width)
            else:
                out += _entry(f"{pad}{_key(key)}: ", item, depth, width)
        return out
    if isinstance(value, Sequence) and not isinstance(value, str):
        for item in value:
            if isinstance(item, Commented):
                out += [pad + line for line in comment_text(item.comment)]
                item = item.value
            if _is_block(item):
                inner = _lines(item, depth + 1, width)
                # "- " followed by the first line of the item, the rest below it.
                out.append(f"{pad}- {inner[0].lstrip()}")
                out += inner[1:]
            else:
                out += _entry(f"{pad}- ", item, depth, width)
        return out
    return [pad + _scalar(value)]


def dump(value: object, header: str = "", width: int | None = None) -> str:
    """One YAML document: ``header`` as comment lines, ``---``, then ``value``.

    ``width``: long strings are split over lines of at most this many characters
    (escaped line breaks, the value unchanged); None keeps each on one line.
    """
    head = comment_text(header) if header else []
    body = _lines(value, 0, width) if _is_block(value) else [_inline(value)]
    return "\n".join([*head, "---", *body]) + "\n"


def dump_all(values: Sequence[object], header: str = "") -> str:
    """Several documents in one stream (``---`` before each)."""
    head = "\n".join(comment_text(header)) + "\n" if header else ""
    return head + "".join(dump(v) for v in values)
