"""A small reader of the Prometheus text exposition format (version 0.0.4).

Owns turning ``GET /metrics`` text into :class:`Metrics` and looking values
up by name and labels. Why not ``prometheus_client``'s parser: that package
is the server's dependency, and ``slmguard top`` must run on a machine with
only the ``top`` extra; the format is line-based and small::

    # HELP slmguard_requests_total HTTP API requests by endpoint and outcome
    # TYPE slmguard_requests_total counter
    slmguard_requests_total{endpoint="chat",outcome="ok"} 12.0
    llamacpp:prompt_tokens_total 4711

Metric names may contain ``:`` (llama.cpp's ``llamacpp:*``); label values
escape ``\\``, ``"`` and newline; values may be ``NaN``, ``+Inf``, ``-Inf``;
an optional timestamp follows the value. A line that does not parse is
skipped and counted (``Metrics.skipped``), never raised: a scrape that is
half garbage still shows the half that is not.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

MAX_SAMPLES = 50_000
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return next((v for k, v in self.labels if k == key), None)


@dataclass(frozen=True)
class Metrics:
    """Every sample of one scrape, by metric name (in the order they came)."""

    samples: Mapping[str, tuple[Sample, ...]] = field(default_factory=dict)
    skipped: int = 0
    declared: frozenset[str] = frozenset()  # names with a ``# TYPE`` line (maybe no samples)

    def has(self, name: str) -> bool:
        """The scrape declares ``name`` (a labelled counter with no samples yet counts)."""
        return (
            bool(self.all(name))
            or name in self.declared
            or (name.removesuffix("_total") in self.declared)
        )

    def names(self) -> tuple[str, ...]:
        return tuple(self.samples)

    def all(self, name: str) -> tuple[Sample, ...]:
        """Samples of ``name``; a counter is also found without its ``_total``."""
        found = self.samples.get(name)
        if found is None and not name.endswith("_total"):
            found = self.samples.get(name + "_total")
        if found is None and name.endswith("_total"):
            found = self.samples.get(name.removesuffix("_total"))
        return found or ()

    def value(self, name: str, **labels: str) -> float | None:
        """The value of the first sample of ``name`` whose labels include ``labels``."""
        for s in self.all(name):
            if all(s.label(k) == v for k, v in labels.items()):
                return s.value if math.isfinite(s.value) else None
        return None

    def first(self, *names: str) -> float | None:
        """The value of the first of ``names`` that is there (spellings across versions)."""
        for n in names:
            v = self.value(n)
            if v is not None:
                return v
        return None

    def total(self, name: str, **labels: str) -> float | None:
        """Sum over the samples matching ``labels``; None when there is none."""
        values = [
            s.value
            for s in self.all(name)
            if all(s.label(k) == v for k, v in labels.items()) and math.isfinite(s.value)
        ]
        return sum(values) if values else None

    def by_label(self, name: str, key: str) -> dict[str, float]:
        """``{label value: sample value}`` over the samples of ``name`` (summed per value)."""
        out: dict[str, float] = {}
        for s in self.all(name):
            v = s.label(key)
            if v is not None and math.isfinite(s.value):
                out[v] = out.get(v, 0.0) + s.value
        return out


def _labels(text: str, pos: int) -> tuple[tuple[tuple[str, str], ...], int]:
    """Parse ``{a="x",b="y"}`` starting at ``text[pos] == "{"``; returns (labels, end)."""
    out: list[tuple[str, str]] = []
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " ,":
            pos += 1
        if pos < len(text) and text[pos] == "}":
            return tuple(out), pos + 1
        m = _LABEL_NAME.match(text, pos)
        if not m:
            raise ValueError("bad label name")
        key = m.group(0)
        pos = m.end()
        if text[pos : pos + 2] != '="':
            raise ValueError("bad label")
        pos += 2
        chars: list[str] = []
        while True:
            if pos >= len(text):
                raise ValueError("unterminated label value")
            c = text[pos]
            if c == "\\" and pos + 1 < len(text):
                nxt = text[pos + 1]
                chars.append("\n" if nxt == "n" else nxt)
                pos += 2
                continue
            if c == '"':
                pos += 1
                break
            chars.append(c)
            pos += 1
        out.append((key, "".join(chars)))


def _value(text: str) -> float:
    word = text.strip()
    lowered = word.lower()
    if lowered in ("+inf", "inf"):
        return math.inf
    if lowered == "-inf":
        return -math.inf
    return float(word)  # "NaN" parses; garbage raises ValueError


def parse_line(line: str) -> Sample | None:
    """One sample line; None for comments and blank lines. ValueError when malformed."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    m = _NAME.match(line)
    if not m:
        raise ValueError("no metric name")
    name = m.group(0)
    pos = m.end()
    labels: tuple[tuple[str, str], ...] = ()
    if pos < len(line) and line[pos] == "{":
        labels, pos = _labels(line, pos)
    rest = line[pos:].split()
    if not rest or len(rest) > 2:
        raise ValueError("no value")
    return Sample(name, labels, _value(rest[0]))


def parse_metrics(text: str) -> Metrics:
    """Every sample of a scrape; malformed lines are counted in ``skipped``."""
    grouped: dict[str, list[Sample]] = {}
    declared: set[str] = set()
    skipped = 0
    count = 0
    for line in _lines(text):
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 3 and len(declared) < MAX_SAMPLES:
                declared.add(parts[2])
            continue
        try:
            sample = parse_line(line)
        except (ValueError, IndexError):
            skipped += 1
            continue
        if sample is None:
            continue
        count += 1
        if count > MAX_SAMPLES:
            skipped += 1
            continue
        grouped.setdefault(sample.name, []).append(sample)
    return Metrics({k: tuple(v) for k, v in grouped.items()}, skipped, frozenset(declared))


def _lines(text: str) -> Iterator[str]:
    yield from text.splitlines()
