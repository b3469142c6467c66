"""A plan file's JSON, read within the reader's own bounds.

Owns :func:`parse_plan_json`: JSON whose nesting, integer sizes and numbers are bounded
(a plan is a few KB, three levels deep, with integers of at most 16 digits), that
refuses NaN, infinities and duplicate keys, and whose every failure is one
:class:`~slmguard.errors.ConfigError` line, never a RecursionError or ValueError. The
reader (:mod:`slmguard.plan.planfile`) validates what it gives; this module knows nothing
of plans beyond those bounds.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from slmguard.errors import ConfigError
from slmguard.plan.text import shown

MAX_JSON_DEPTH = 16
MAX_INT_DIGITS = 20


class _JsonLimit(Exception):
    """The plan's JSON breaks one of the reader's own bounds (message: which)."""


def _json_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` outside strings."""
    depth = deepest = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        tok = m.group()
        if tok in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif tok in "]}":
            depth -= 1
    return deepest


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _JsonLimit(f"an integer of {len(digits)} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _JsonLimit(f"the number {text[:40]} is not finite")
    return value


def _parse_constant(name: str) -> Any:
    raise _JsonLimit(f"{name} is not a number JSON allows")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _JsonLimit(f"duplicate key {shown(k, 64)}")
        out[k] = v
    return out


def parse_plan_json(text: str) -> Any:
    """JSON with the reader's bounds: depth, integer size, finite numbers, unique keys.

    Raises ConfigError (one line) for anything else, never RecursionError or
    ValueError.
    """
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ConfigError(f"JSON nested {depth} deep (a plan needs at most {MAX_JSON_DEPTH})")
    try:
        return json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
            object_pairs_hook=_unique_keys,
        )
    except _JsonLimit as err:
        raise ConfigError(f"not a plan: {err}") from err
    except json.JSONDecodeError as err:
        raise ConfigError(f"not valid JSON (line {err.lineno}: {err.msg})") from err
    except (RecursionError, ValueError) as err:
        raise ConfigError(f"not valid JSON ({type(err).__name__})") from err
