"""What the governor tells the outside: one log line per event, plain counters.

Owns the structured log lines (logger ``slmguard.governor``; the message is
the event name followed by a JSON object, and the same fields are passed as
``extra`` for JSON log handlers) and :class:`GovernorCounters`, thread-safe
monotonic counters that ``governor.metrics`` exports to Prometheus. No
prometheus_client here.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from typing import Any

log = logging.getLogger("slmguard.governor")


def emit(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one event as ``<event> {json fields}`` on a single line."""
    payload = {k: v for k, v in fields.items() if v is not None}
    log.log(
        level,
        "%s %s",
        event,
        json.dumps(payload, sort_keys=True, default=str),
        extra={"event": event, "fields": payload},
    )


class GovernorCounters:
    """Monotonic counters by label. Keys are small fixed vocabularies.

    ``transitions[(from, to)]``, ``rejections[reason]``,
    ``degradations[kind]`` (max_tokens_cap, trim_sessions, context_shrink,
    context_grow, abort, park, resume), ``failures[action]`` (an action the
    engine could not carry out), plus byte totals of what context shrinks freed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.transitions: Counter[tuple[str, str]] = Counter()
        self.rejections: Counter[str] = Counter()
        self.degradations: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.freed_bytes_measured = 0
        self.freed_bytes_predicted = 0

    def transition(self, from_level: str, to_level: str) -> None:
        with self._lock:
            self.transitions[(from_level, to_level)] += 1

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejections[reason] += 1

    def degrade(self, kind: str) -> None:
        with self._lock:
            self.degradations[kind] += 1

    def fail(self, action: str) -> None:
        with self._lock:
            self.failures[action] += 1

    def freed(self, measured_bytes: int, predicted_bytes: int) -> None:
        with self._lock:
            self.freed_bytes_measured += measured_bytes
            self.freed_bytes_predicted += predicted_bytes

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "transitions": {f"{a}->{b}": n for (a, b), n in sorted(self.transitions.items())},
                "rejections": dict(sorted(self.rejections.items())),
                "degradations": dict(sorted(self.degradations.items())),
                "failures": dict(sorted(self.failures.items())),
                "freed_bytes_measured": self.freed_bytes_measured,
                "freed_bytes_predicted": self.freed_bytes_predicted,
            }
