"""What ``plan --model SPEC`` and ``--neighbour SPEC`` say, parsed (issue 39).

Owns the two small languages of a board on the command line and their refusals, each a
:class:`~slmguard.errors.UsageError` (exit 64) naming the argument and what is wrong:

- ``--model SPEC``: ``FILE`` alone (as before), or comma-separated items: the model
  (``FILE``, ``file=FILE``, ``preset=NAME[:QUANT]`` or ``embedded``, the embedded model),
  how it is served (``name=``, ``alias=`` (repeatable), ``role=chat|completion|embedding|
  rerank``, ``pinned`` or ``on-demand``, ``priority=0-1000``, ``idle-unload=SECONDS``
  with ``s``/``m``/``h``) and its engine (``ctx=TOKENS`` per slot, ``slots=N``). A text
  that names an existing file is that file whatever it holds (a path with a comma).
- ``--neighbour SPEC``: ``NAME=SIZE`` (bytes, or ``K``/``M``/``G``/``T``, powers of
  1024, ``KiB``... too) and optional items ``unit=NAME.service`` and ``min`` or ``low``
  (the protection); ``NAME,unit=UNIT`` without a size reads it from the running unit.

Pure: whether a text names a file is the caller's ``is_file``; the unit's memory is read
by :mod:`slmguard.plan.inputs` through :mod:`slmguard.host.systemd`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from slmguard.errors import UsageError
from slmguard.plan.schema import (
    MAX_ALIASES,
    MAX_BYTES,
    MAX_IDLE_UNLOAD_S,
    MAX_PRIORITY,
    NEIGHBOUR_NAME_PATTERN,
    NEIGHBOUR_UNIT_PATTERN,
    OWN_UNITS,
    PROTECTIONS,
    ROLES,
    SERVED_NAME_PATTERN,
)
from slmguard.plan.text import shown

#: Longest SPEC taken (a path of PATH_MAX and the items beside it).
MAX_SPEC_CHARS = 8192
MAX_CTX = 1 << 24
MAX_SLOTS = 64
#: How long an on-demand model may sit idle before it is unloaded, unless told.
DEFAULT_IDLE_UNLOAD_S = 300
MODEL_KEYS = ("file", "preset", "name", "alias", "role", "priority", "idle-unload", "ctx", "slots")
MODEL_FLAGS = ("embedded", "pinned", "on-demand")
_SIZE = re.compile(r"(\d{1,16}(?:\.\d{1,6})?)\s*(?:([KMGT])(?:iB)?|B)?", re.IGNORECASE)
_SHIFT = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
_SPAN = re.compile(r"(\d{1,9})\s*([smh]?)")
_SPAN_S = {"": 1, "s": 1, "m": 60, "h": 3600}


@dataclass(frozen=True)
class ModelArg:
    """One ``--model SPEC``: its source (one of ``file``, ``preset``, ``embedded``) and
    what was asked of it (None: the planner's or the default)."""

    file: str | None = None
    preset: str | None = None
    embedded: bool = False
    name: str | None = None
    aliases: tuple[str, ...] = ()
    role: str | None = None
    residency: str | None = None
    priority: int | None = None
    idle_unload_s: int | None = None
    ctx: int | None = None
    slots: int | None = None
    given: tuple[str, ...] = field(default=(), compare=False)  # the keys and flags given

    @property
    def plain(self) -> bool:
        """Only a file, as ``--model FILE`` always was."""
        return self.given in ((), ("file",))


@dataclass(frozen=True)
class NeighbourArg:
    """One ``--neighbour SPEC``: ``memory_bytes`` None to read it from ``unit``."""

    name: str
    memory_bytes: int | None
    unit: str | None = None
    protection: str = "min"


def _fail(arg: str, text: str, why: str, hint: str | None = None) -> UsageError:
    return UsageError(f"{arg} {shown(text)}: {why}", hint=hint)


def _items(arg: str, text: str) -> list[str]:
    if len(text) > MAX_SPEC_CHARS:
        raise _fail(arg, text, f"{len(text)} characters (at most {MAX_SPEC_CHARS})")
    if "\x00" in text or any(not ch.isprintable() for ch in text):
        raise _fail(arg, text, "holds a control character")
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise _fail(arg, text, "an empty item (two commas, or one at an end)")
    return items


def _int(arg: str, text: str, key: str, value: str, lo: int, hi: int) -> int:
    if not re.fullmatch(r"\d{1,12}", value):
        raise _fail(arg, text, f"{key}={shown(value, 40)} is not a whole number")
    n = int(value)
    if not lo <= n <= hi:
        raise _fail(arg, text, f"{key}={n} is not within {lo} to {hi}")
    return n


def _name(arg: str, text: str, key: str, value: str) -> str:
    if not re.fullmatch(SERVED_NAME_PATTERN, value):
        raise _fail(
            arg, text, f"{key}={shown(value, 60)} is not a model name (letters, digits and "
            "._:/@+-, starting with a letter or digit, at most 128)",
        )  # fmt: skip
    return value


def seconds(arg: str, text: str, value: str) -> int:
    """``300``, ``300s``, ``5m``, ``1h``: seconds, at most a week."""
    m = _SPAN.fullmatch(value.strip())
    if m is None:
        raise _fail(arg, text, f"idle-unload={shown(value, 40)} is not SECONDS, Nm or Nh")
    n = int(m.group(1)) * _SPAN_S[m.group(2)]
    if n > MAX_IDLE_UNLOAD_S:
        raise _fail(arg, text, f"idle-unload={value} is above {MAX_IDLE_UNLOAD_S} s (a week)")
    return n


def _model_item(arg: str, text: str, key: str, value: str, out: dict[str, object]) -> None:
    """One ``key=value`` of a model SPEC into ``out``."""
    if key == "alias":
        aliases = [*out.get("aliases", ()), _name(arg, text, key, value)]  # type: ignore[misc]
        if len(aliases) > MAX_ALIASES:
            raise _fail(arg, text, f"{len(aliases)} aliases (at most {MAX_ALIASES})")
        out["aliases"] = tuple(aliases)
        return
    if key in out or (key == "idle-unload" and "idle_unload_s" in out):
        raise _fail(arg, text, f"{key}= given twice")
    if key in ("file", "preset"):
        if not value:
            raise _fail(arg, text, f"{key}= names nothing")
        out[key] = value
    elif key == "name":
        out["name"] = _name(arg, text, key, value)
    elif key == "role":
        if value not in ROLES:
            raise _fail(arg, text, f"role={shown(value, 40)} is not one of {', '.join(ROLES)}")
        out["role"] = value
    elif key == "priority":
        out["priority"] = _int(arg, text, key, value, 0, MAX_PRIORITY)
    elif key == "idle-unload":
        out["idle_unload_s"] = seconds(arg, text, value)
    elif key == "ctx":
        out["ctx"] = _int(arg, text, key, value, 1, MAX_CTX)
    elif key == "slots":
        out["slots"] = _int(arg, text, key, value, 1, MAX_SLOTS)
    else:
        raise _fail(
            arg, text, f"unknown key {shown(key, 40)} (keys: {', '.join(MODEL_KEYS)}; flags: "
            f"{', '.join(MODEL_FLAGS)})",
        )  # fmt: skip


def parse_model(text: str, is_file: Callable[[str], bool], arg: str = "--model") -> ModelArg:
    """One ``--model SPEC`` (module docstring); UsageError for anything else."""
    if text and is_file(text):
        return ModelArg(file=text, given=("file",))
    items = _items(arg, text)
    out: dict[str, object] = {}
    given: list[str] = []
    for i, item in enumerate(items):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            if item in MODEL_FLAGS:
                _model_flag(arg, text, item, out)
            elif i == 0:
                out["file"] = item
                key = "file"
            else:
                raise _fail(arg, text, f"{shown(item, 40)} is neither key=value nor a flag")
        else:
            _model_item(arg, text, key, value.strip(), out)
        given.append(key)
    return _model_arg(arg, text, out, tuple(given))


def _model_flag(arg: str, text: str, flag: str, out: dict[str, object]) -> None:
    if flag == "embedded":
        if "embedded" in out:
            raise _fail(arg, text, "embedded given twice")
        out["embedded"] = True
        return
    residency = "pinned" if flag == "pinned" else "on_demand"
    if "residency" in out:
        raise _fail(arg, text, "give one of pinned and on-demand, once")
    out["residency"] = residency


def _model_arg(arg: str, text: str, out: dict[str, object], given: tuple[str, ...]) -> ModelArg:
    sources = [k for k in ("file", "preset", "embedded") if k in out]
    if len(sources) != 1:
        raise _fail(
            arg, text, "name one model: FILE, file=FILE, preset=NAME or embedded"
            + (f" (not {' and '.join(sources)})" if sources else ""),
        )  # fmt: skip
    if "idle_unload_s" in out and out.get("residency") != "on_demand":
        raise _fail(arg, text, "idle-unload= is for an on-demand model (add on-demand)")
    if out.get("residency") == "on_demand" and "idle_unload_s" not in out:
        out["idle_unload_s"] = DEFAULT_IDLE_UNLOAD_S
    return ModelArg(**out, given=given)  # type: ignore[arg-type]


def parse_size(arg: str, text: str, value: str) -> int:
    """A neighbour's size: bytes, or K, M, G, T (powers of 1024, ``MiB`` too)."""
    m = _SIZE.fullmatch(value.strip())
    if m is None:
        raise _fail(
            arg, text, f"size {shown(value, 40)} is not a size (bytes, or a number with "
            "K, M, G or T: 600M, 1.5G)",
        )  # fmt: skip
    n = int(float(m.group(1)) * (1 << _SHIFT[(m.group(2) or "").upper()]))
    if not 1 <= n <= MAX_BYTES:
        raise _fail(arg, text, f"size {value} is not within 1 byte and 1 PiB")
    return n


def parse_neighbour(text: str, arg: str = "--neighbour") -> NeighbourArg:
    """One ``--neighbour SPEC`` (module docstring); UsageError for anything else."""
    items = _items(arg, text)
    head, eq, size = items[0].partition("=")
    name = head.strip()
    if not re.fullmatch(NEIGHBOUR_NAME_PATTERN, name):
        raise _fail(
            arg, text, f"name {shown(name, 60)}: letters, digits and _.-, starting with a "
            "letter or digit, at most 64",
        )  # fmt: skip
    memory = parse_size(arg, text, size) if eq else None
    unit: str | None = None
    protection: str | None = None
    for item in items[1:]:
        key, eq, value = item.partition("=")
        if eq and key.strip() == "unit" and unit is None:
            unit = _unit(arg, text, value.strip())
        elif not eq and item in PROTECTIONS and protection is None:
            protection = item
        else:
            raise _fail(
                arg, text, f"{shown(item, 40)}: the items are unit=NAME.service and min or "
                "low, each once",
            )  # fmt: skip
    if memory is None and unit is None:
        raise _fail(
            arg, text, "no size: give NAME=SIZE, or unit=UNIT to read it from the running "
            "unit",
        )  # fmt: skip
    return NeighbourArg(name, memory, unit, protection or "min")


def _unit(arg: str, text: str, unit: str) -> str:
    if not re.fullmatch(NEIGHBOUR_UNIT_PATTERN, unit):
        raise _fail(
            arg, text, f"unit {shown(unit, 60)}: a systemd service, NAME.service (letters, "
            "digits and :_.@-, not starting with '-', no backslash)",
        )  # fmt: skip
    if unit in OWN_UNITS:
        raise _fail(arg, text, f"unit {unit} is one of slmguard's own")
    return unit
