"""When an engine that cannot take a request now is expected to serve again: its Retry-After.

Owns :class:`Readiness`, what one engine's supervisor knows of that (its state, the
restart backoff still to wait or the one a death noticed now would wait, how long its
current load has run, how long its last load took), and :class:`RetryAfter`, the
whole seconds a 503 about that engine tells a client to wait: the backoff left plus
the expected rest of the load, rounded up, never below the server's default
(``--retry-after-s``) nor above ``--retry-after-max-s``. Pure arithmetic on a
snapshot: no clock (:meth:`EngineProcess.readiness
<slmguard.serve.engine.EngineProcess.readiness>` takes it), no I/O, no web stack. The
relay puts the value on its errors; it decides no state and no restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The states whose engine is on its way back through a restart (backoff, then a load).
RESTARTING = ("restarting", "stalled")


@dataclass(frozen=True)
class Readiness:
    """One engine's way back to serving, as its supervisor knows it at one moment.

    ``backoff_left_s``: the restart backoff still to wait (None: none scheduled yet,
    for example a death not yet reaped); ``next_backoff_s``: the backoff a death
    noticed now waits; ``loading_for_s``: how long the current load has run (None:
    not loading); ``last_load_s``: from the child's start to its first 200 on
    ``/health``, the last time it came up (None: it never has yet).

    Example::

        Readiness("restarting", backoff_left_s=0.4, next_backoff_s=1.0, last_load_s=3.2)
    """

    state: str
    backoff_left_s: float | None = None
    next_backoff_s: float = 0.0
    loading_for_s: float | None = None
    last_load_s: float | None = None

    def ready_in_s(self, *, died: bool = False) -> float | None:
        """Seconds until the engine is expected to serve; None when nothing says it.

        Loading: the last load's time less this load's time so far, but never less than
        this load's time so far (a load slower than the last is taken to need as long
        again). Restarting or stalled: the backoff left (or the next one, before it is
        scheduled) plus the last load's time. Ready, but ``died`` (a request found it
        gone before its supervisor did): the next backoff plus the last load's time.
        None before the first load has finished, and for a parked, failed or stopped
        engine, or a ready one that answered busy.
        """
        if self.last_load_s is None:
            return None
        if self.state == "loading":
            ran = self.loading_for_s or 0.0
            return max(self.last_load_s - ran, ran)
        if self.state in RESTARTING:
            left = self.next_backoff_s if self.backoff_left_s is None else self.backoff_left_s
            return max(0.0, left) + self.last_load_s
        if self.state == "ready" and died:
            return self.next_backoff_s + self.last_load_s
        return None


@dataclass(frozen=True)
class RetryAfter:
    """The Retry-After of a 503 about one engine: :meth:`Readiness.ready_in_s` rounded up,
    at least ``default_s`` (the server's Retry-After for any 429 or 503, also what is
    sent when nothing is known) and at most ``max_s``.

    Example::

        RetryAfter(2, 60).seconds(Readiness("loading", loading_for_s=1.0, last_load_s=4.5))  # 4
    """

    default_s: int
    max_s: int

    def seconds(self, readiness: Readiness, *, died: bool = False) -> int:
        expected = readiness.ready_in_s(died=died)
        if expected is None:
            return self.default_s
        return max(self.default_s, min(self.max_s, math.ceil(expected)))
