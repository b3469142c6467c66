"""A declared field's rule and the typed reader of untrusted JSON values it checks.

Owns :class:`Rule` (what a field may hold beyond its type: a range, choices, a pattern, a
path under a prefix, a length, items), :func:`rule` (a field's metadata), :func:`build`
(a JSON value made into a field's type, dataclasses, tuples, dicts and unions included,
every field checked against its rule) and the one-line ConfigError each violation is,
naming the field's path (``plan.engine.n_threads: 1000000 is above 4096``). Knows no plan:
:mod:`slmguard.plan.schema` declares the fields, :mod:`slmguard.plan.relations` their relations.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from slmguard.errors import ConfigError
from slmguard.plan.text import problem, shown

MAX_PATH_CHARS = 4096  # PATH_MAX
#: The most entries a tuple or a dict field may hold unless its rule says (CPU lists).
MAX_ITEMS = 4096


@dataclass(frozen=True)
class Rule:
    """What a plan field may hold beyond its type, declared next to the field.

    Numbers: ``lo``/``hi`` (inclusive). Strings: ``choices``, ``pattern`` (the
    whole string), ``path`` (absolute, no ``..``; ``under`` a prefix), else
    printable text of at most ``max_chars`` (``empty_ok`` to allow ""); no
    string may hold a control character. Tuples and dicts: ``min_items``,
    ``max_items``, ``unique``; their elements (dict values) follow the rest.
    """

    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] | None = None
    pattern: str | None = None
    path: bool = False
    under: str | None = None
    max_chars: int = 256
    empty_ok: bool = False
    min_items: int = 0
    max_items: int = MAX_ITEMS
    unique: bool = False


def rule(**limits: Any) -> dict[str, Rule]:
    """Field metadata: ``field(metadata=rule(lo=1, hi=4096))``."""
    return {"rule": Rule(**limits)}


def _num(x: float) -> str:
    """A number as a message shows it: 4096, 150 (not 150.0), 97.5."""
    return str(int(x)) if float(x).is_integer() else str(x)


def _number(value: float, r: Rule, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {value} is not a finite number")
    if r.lo is not None and value < r.lo:
        raise ConfigError(f"{where}: {_num(value)} is below {_num(r.lo)}")
    if r.hi is not None and value > r.hi:
        raise ConfigError(f"{where}: {_num(value)} is above {_num(r.hi)}")


def _string(value: str, r: Rule, where: str) -> None:
    if r.choices is not None:
        if value not in r.choices:
            raise ConfigError(f"{where}: {shown(value)} is not one of {', '.join(r.choices)}")
        return
    limit = MAX_PATH_CHARS if r.path else r.max_chars
    why = problem(value, limit, empty_ok=r.empty_ok)
    if why:
        raise ConfigError(f"{where}: {shown(value)} {why}")
    if r.pattern is not None and not re.fullmatch(r.pattern, value):
        raise ConfigError(f"{where}: {shown(value)} does not match {r.pattern}")
    if r.path:
        if not value.startswith("/"):
            raise ConfigError(f"{where}: {shown(value)} is not an absolute path")
        if ".." in value.split("/"):
            raise ConfigError(f"{where}: {shown(value)} has a '..' component")
        if r.under is not None and not value.startswith(r.under):
            raise ConfigError(f"{where}: {shown(value)} is not under {r.under}")


def check_value(value: Any, r: Rule, where: str) -> None:
    """``value`` (a built field value) against its rule; raises ConfigError with ``where``."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int | float):
        _number(value, r, where)
    elif isinstance(value, str):
        _string(value, r, where)
    elif isinstance(value, tuple | dict):
        n = len(value)
        if n < r.min_items:
            raise ConfigError(f"{where}: needs at least {r.min_items} entries, has {n}")
        if n > r.max_items:
            raise ConfigError(f"{where}: {n} entries (at most {r.max_items})")
        items = list(value.values()) if isinstance(value, dict) else list(value)
        if r.unique:
            seen: set[str] = set()
            for x in items:
                if repr(x) in seen:
                    raise ConfigError(f"{where}: {shown(x)} appears twice")
                seen.add(repr(x))
        if isinstance(value, dict):
            for k, v in value.items():
                key_rule = Rule(pattern=r"[a-z0-9_.]{1,64}")
                _string(k, key_rule, f"{where} key")
                check_value(v, r, f"{where}.{k}")
        else:
            for i, x in enumerate(items):
                if not dataclasses.is_dataclass(x):
                    check_value(x, r, f"{where}[{i}]")


def build(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return build(a, value, where)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if errors else ConfigError(f"{where}: unexpected null")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {kind(value)}")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                built = build(hints[f.name], value[f.name], f"{where}.{f.name}")
                r = f.metadata.get("rule")
                if r is not None:
                    check_value(built, r, f"{where}.{f.name}")
                kwargs[f.name] = built
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing field {f.name!r}")
        return tp(**kwargs)  # type: ignore[operator]
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {kind(value)}")
        (item,) = typing.get_args(tp)[:1]
        return tuple(build(item, x, f"{where}[{i}]") for i, x in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {kind(value)}")
        _, vt = typing.get_args(tp)
        return {str(k): build(vt, v, f"{where}.{shown(k, 64)}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {kind(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {kind(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {kind(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {kind(value)}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp!r}")  # pragma: no cover


def kind(value: Any) -> str:
    """What a JSON value is, for "expected X, got Y" (never the whole value)."""
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return shown(value, 60)
