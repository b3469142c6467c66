"""What an untrusted string may hold before slmguard keeps it: printable and bounded.

Owns the one definition of "a control character" (Unicode categories Cc, Cf,
Cs, Co, Cn and the line/paragraph separators Zl, Zp: newlines, NULs, escape
sequences, bidirectional overrides, lone surrogates, unassigned code points)
and two ways of dealing with them: :func:`sanitize` for display names taken
from a model file (a GGUF's ``general.name`` is free text from the internet:
control characters become spaces, the result is cut to a length), and
:func:`problem` for plan fields, which are refused rather than repaired (the
plan reader turns the answer into a ConfigError with the field path).
:func:`shown` quotes a hostile value for a one-line error message.

The escaping for each output format (systemd units, sysctl, boot files) is
the deploy code's; this module only decides what is never kept at all.

Example::

    sanitize("tiny\\n[Service]\\nExecStartPre=+/bin/true", 128)
    # -> 'tiny [Service] ExecStartPre=+/bin/true'
    problem("eth0\\n", 64)  # 'contains a control character (U+000A)'
"""

from __future__ import annotations

import unicodedata

_BAD_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def is_control(ch: str) -> bool:
    return unicodedata.category(ch) in _BAD_CATEGORIES


def first_control(text: str) -> str | None:
    """The first control character of ``text``, or None."""
    return next((ch for ch in text if is_control(ch)), None)


def sanitize(text: str, max_chars: int) -> str:
    """Control characters and whitespace runs become one space; cut to ``max_chars``."""
    cleaned = "".join(" " if is_control(ch) or ch.isspace() else ch for ch in text)
    return " ".join(cleaned.split())[:max_chars].rstrip()


def problem(text: str, max_chars: int, *, empty_ok: bool = False) -> str | None:
    """Why ``text`` may not be kept as it is (None: it may)."""
    if not text and not empty_ok:
        return "is empty"
    if len(text) > max_chars:
        return f"is {len(text)} characters long (at most {max_chars})"
    bad = first_control(text)
    if bad is not None:
        return f"contains a control character (U+{ord(bad):04X})"
    return None


def shown(value: object, max_chars: int = 80) -> str:
    """``value`` for an error message: one line (``repr`` escapes every character
    that is not printable), cut to about ``max_chars``."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value[: max_chars + 1] if isinstance(value, str) else value)
    return text if len(text) <= max_chars else text[:max_chars] + "..."
