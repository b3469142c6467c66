"""The kernel command line as text: split it, read an argument, replace one, sizes.

Owns what every place that handles kernel arguments must agree on: arguments
are separated by whitespace except inside double quotes (the kernel's
``next_arg()``), the last ``key=`` wins, sizes are ``memparse()`` sizes
(decimal or 0x hex, K/M/G/T/P/E suffix) and ``cma=`` is
``size[@start[-end]]``. Pure: text in, values out. The boot-file formats are
``slmguard.host.bootfiles``'s, /proc/cmdline is ``slmguard.host.procfs``'s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_MEMPARSE = re.compile(r"^(?P<num>0[xX][0-9a-fA-F]+|[0-9]+)(?P<suffix>[kKmMgGtTpPeE]?)$")
_SUFFIX_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50, "e": 60}


def split_args(text: str) -> list[tuple[int, int]]:
    """Spans (start, end) of the arguments in a command line.

    Whitespace separates arguments except inside double quotes, as the kernel's
    ``next_arg()`` does (``dyndbg="file x.c +p"`` is one argument).
    """
    spans: list[tuple[int, int]] = []
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            break
        start, quoted = i, False
        while i < n and (quoted or not text[i].isspace()):
            if text[i] == '"':
                quoted = not quoted
            i += 1
        spans.append((start, i))
    return spans


def tokens(text: str) -> tuple[str, ...]:
    """The arguments of a command line, quotes kept (``a="b c" d`` -> ``a="b c"``, ``d``)."""
    return tuple(text[a:b] for a, b in split_args(text))


def arg_value(args: Sequence[str], key: str) -> str | None:
    """The value of the last ``key=`` argument (the kernel honours the last), or None."""
    found = None
    for arg in args:
        name, sep, value = arg.partition("=")
        if sep and name == key:
            found = value
    return found


def has_root(args: Sequence[str]) -> bool:
    """True when a non-empty ``root=`` is among ``args`` (without it the board does not boot)."""
    return any(a.startswith("root=") and len(a) > len("root=") for a in args)


def set_arg(cmdline: str, key: str, value: str) -> str:
    """``cmdline`` with every ``key=`` argument replaced by one ``key=value``.

    The first occurrence is replaced in place, later ones removed (with the
    whitespace before them); when there is none the argument is appended after
    one space. Nothing else changes.
    """
    spans = [(a, b) for a, b in split_args(cmdline) if cmdline[a:b].split("=", 1)[0] == key]
    new = f"{key}={value}"
    if not spans:
        body = cmdline.rstrip()
        trail = cmdline[len(body) :]
        return f"{body} {new}{trail}" if body else f"{new}{trail}"
    out = cmdline
    for a, b in reversed(spans[1:]):
        cut = a
        while cut > 0 and out[cut - 1] in " \t":
            cut -= 1
        out = out[:cut] + out[b:]
    a, b = spans[0]
    return out[:a] + new + out[b:]


def parse_memparse(text: str) -> int:
    """Bytes from a kernel size (``memparse()``: decimal or 0x hex, K/M/G/T/P/E suffix)."""
    m = _MEMPARSE.match(text.strip())
    if not m:
        raise ValueError(f"not a kernel size: {text!r}")
    return int(m["num"], 0) << _SUFFIX_SHIFT[m["suffix"].lower()]


def format_memparse(n_bytes: int) -> str:
    """A kernel size for ``n_bytes``: the largest exact unit of G, M, K, else bytes."""
    if n_bytes <= 0:
        raise ValueError(f"size must be > 0, got {n_bytes}")
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n_bytes % (1 << shift) == 0:
            return f"{n_bytes >> shift}{suffix}"
    return str(n_bytes)


def cma_bytes(args: Sequence[str]) -> int | None:
    """Size of the ``cma=size[@start[-end]]`` pool in bytes, None when absent.

    Raises ValueError for a size memparse() would not accept.
    """
    raw = arg_value(args, "cma")
    if raw is None:
        return None
    return parse_memparse(raw.split("@", 1)[0])
