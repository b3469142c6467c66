"""A plan file: the one reader and the one writer of a :class:`~slmguard.plan.schema.Plan`.

Owns :func:`load_plan` (every verb's ``--plan FILE``), :func:`loads_plan`,
:func:`plan_from_dict` and :func:`check_plan`, and the writing (:func:`plan_to_dict`,
:func:`dumps_plan`: a field marked ``OPTIONAL`` is left out while it holds its default,
so a one-model plan is written byte for byte as before). A plan file is untrusted input:
the reader bounds the file's size (:data:`MAX_PLAN_FILE_BYTES`; the JSON's nesting and
integers: :mod:`slmguard.plan.planjson`), checks the schema version, every field's rule
(:mod:`slmguard.plan.rules`) and every relation (:mod:`slmguard.plan.relations`), and
each violation is a :class:`ConfigError` (exit 78) naming the file and the field path,
e.g. ``plan.engine.n_threads: 1000000 is above 4096``. It declares no field and no
relation (:mod:`slmguard.plan.schema`, :mod:`slmguard.plan.relations`) and does no
arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from slmguard import regularfile
from slmguard.errors import ConfigError
from slmguard.plan.planjson import parse_plan_json
from slmguard.plan.relations import RELATIONS
from slmguard.plan.rules import build, kind
from slmguard.plan.schema import SCHEMA, SCHEMA_MAJOR, Plan
from slmguard.plan.text import shown

# The plan reader's own bound: a plan is a few KB (the JSON's: plan.planjson).
MAX_PLAN_FILE_BYTES = 1 << 20


def _holds_default(obj: Any, f: dataclasses.Field[Any]) -> bool:
    value = getattr(obj, f.name)
    if f.default is not dataclasses.MISSING:
        return bool(value == f.default)
    return f.default_factory is not dataclasses.MISSING and bool(value == f.default_factory())


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {
                f.name: conv(getattr(v, f.name))
                for f in dataclasses.fields(v)
                if not (f.metadata.get("optional") and _holds_default(v, f))
            }
        if isinstance(v, tuple | list):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    out: dict[str, Any] = conv(plan)
    out = {"schema": plan.schema, **{k: v for k, v in out.items() if k != "schema"}}
    return out


def dumps_plan(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), indent=2, sort_keys=False) + "\n"


def check_plan(plan: Plan) -> None:
    """Every field rule and relation, on a plan built in memory (``plan`` checks what it
    writes); :func:`plan_from_dict` does the same while reading."""
    plan_from_dict(json.loads(dumps_plan(plan)))


def plan_from_dict(data: Any) -> Plan:
    if not isinstance(data, dict):
        raise ConfigError(f"plan: expected a JSON object, got {kind(data)}")
    schema = data.get("schema")
    if not isinstance(schema, str) or not schema.startswith("slmguard.plan/"):
        raise ConfigError(f"not an slmguard plan (schema {shown(schema)}, expected {SCHEMA!r})")
    match = re.fullmatch(r"slmguard\.plan/(\d{1,4})(?:\.\d{1,4})?", schema)
    if match is None:
        raise ConfigError(f"unreadable plan schema {shown(schema)}")
    major = int(match.group(1))
    if major < SCHEMA_MAJOR:
        raise ConfigError(
            f"plan schema {schema!r} is from an older slmguard: re-run `slmguard plan` "
            f"(this one reads {SCHEMA!r}, which records the model file's path, size and "
            "sha256)",
            hint="re-run `slmguard plan` (e.g. slmguard plan --model FILE --json --out plan.json)",
        )
    if major != SCHEMA_MAJOR:
        raise ConfigError(
            f"plan schema {schema!r} is not supported (this slmguard reads {SCHEMA!r})",
            hint="re-run `slmguard plan --json` with this version",
        )
    plan: Plan = build(Plan, {**data, "schema": SCHEMA}, "plan")
    for relation in RELATIONS:
        why = relation(plan)
        if why:
            raise ConfigError(why)
    return plan


def _read_bytes(path: Path) -> bytes:
    """The file's bytes: a regular file of at most MAX_PLAN_FILE_BYTES, never blocking."""
    try:
        raw = regularfile.read_bounded(path, MAX_PLAN_FILE_BYTES)
    except FileNotFoundError as err:
        raise ConfigError("plan file not found", path=path) from err
    except regularfile.NotRegularFileError as err:
        raise ConfigError(
            f"plan file is {err.kind}, not a regular file",
            path=path,
            hint="write the plan to a file: slmguard plan --json --out plan.json",
        ) from err
    except OSError as err:
        raise ConfigError(f"cannot read plan file: {err.strerror or err}", path=path) from err
    if raw is None:
        raise ConfigError(
            f"plan file is larger than {MAX_PLAN_FILE_BYTES >> 20} MiB (a plan is a few KB)",
            path=path,
        )
    return raw


def _decode(raw: bytes, path: Path | str | None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"plan file is not UTF-8 (byte {err.start})", path=path) from err


def loads_plan(raw: bytes, path: Path | str | None = None) -> Plan:
    """Validate a plan from its bytes (``path`` only names it in errors)."""
    if len(raw) > MAX_PLAN_FILE_BYTES:
        raise ConfigError(
            f"plan file is larger than {MAX_PLAN_FILE_BYTES >> 20} MiB (a plan is a few KB)",
            path=path,
        )
    try:
        return plan_from_dict(parse_plan_json(_decode(raw, path)))
    except ConfigError as err:
        raise ConfigError(err.message, path=path, hint=err.hint) from err


def load_plan(path: Path) -> Plan:
    """Read and validate a plan file: the one reader every verb uses for ``--plan``.

    Every error is a ConfigError (exit 78) naming the file and, for a bad
    field, its path (``plan.engine.n_threads: 1000000 is above 4096``).
    """
    return loads_plan(_read_bytes(path), path)
