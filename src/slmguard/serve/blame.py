"""Who made the engine fail: the requests it proved harmful and the clients that keep sending them.

Owns :class:`CrashMemory`. A request is remembered (by digest, refused from then on
before it reaches the engine, so resending it costs nothing) only when the engine
itself proves it:

- **a crash**: the engine died of SIGSEGV, SIGABRT, SIGBUS or SIGFPE (:data:`CRASH_SIGNALS`)
  while running it, and it is the last request the front gave that engine (the newest
  of those still running there: :meth:`CrashMemory.sent`, :meth:`CrashMemory.finished`,
  :meth:`CrashMemory.settle`, in either order). 400 ``request_crashed_engine``. An engine
  killed from outside (SIGKILL: the OOM killer, the liveness check's kill of a stalled
  engine, an operator) or by SIGILL (a build for another CPU) says nothing of its requests;
- **its grammar's work**: the engine refused it with ``grammar_limit_error`` (its
  ``--grammar-max-work``, slmguard's engine patch). 400 ``grammar_too_complex`` naming the
  field, as the engine's own answer did.

A stall blames no request (with constrained decoding bounded in the engine, a stall is
the engine's, and every request in flight during it is a bystander), except on an engine
build without the bound (:attr:`CrashMemory.grammar_bound` False): there the requests
in flight that carry a grammar are blamed (the one cause of a stall a request is known
to have; a plain request beside them never is).

Every proof is a strike against the client that sent the request (its peer address: one
API key is shared by every client, and a client behind a reverse proxy is the proxy).
:data:`STRIKES` strikes within :data:`STRIKE_WINDOW_S` and the client is refused for
:data:`COOLDOWN_S` (429 ``client_cooldown`` with Retry-After), its neighbours not. Pure
bookkeeping: no I/O; the relay feeds it (sent, finished, a grammar refusal), the engine
supervisor its exits, the liveness check its stalls.
"""

from __future__ import annotations

import hashlib
import json
import math
import signal
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slmguard.errors import ClientCooldownError, GrammarLimitError, RequestError

#: The signals of an engine's own fault: what it was running is suspect.
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE})
#: Strikes (proven failures) within the window that put a client in the cooldown.
STRIKES = 3
STRIKE_WINDOW_S = 600.0
#: How long a client in the cooldown is refused (429, Retry-After).
COOLDOWN_S = 300.0
#: Clients tracked at once (the oldest forgotten first).
MAX_CLIENTS = 4096

_CRASHED, _GRAMMAR = "crashed", "grammar"


def crashed(rc: int | None) -> bool:
    """Whether an exit status (asyncio's: a signal as its negative) is the engine's own
    fault: one of :data:`CRASH_SIGNALS`."""
    return rc is not None and rc < 0 and -rc in CRASH_SIGNALS


def digest(body: Any) -> str:
    """The request's identity: its JSON, keys sorted (the same request, reordered, matches)."""
    text = json.dumps(body, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class _Sent:
    """A generation given to an engine and not yet answered."""

    key: int  # the flight's id: its order of sending
    digest: str
    client: str | None
    param: str | None  # the field its grammar came from (None: no grammar)


class CrashMemory:
    """The requests engines proved harmful (the last ``size``), and the clients' strikes."""

    def __init__(self, size: int = 256, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.size = size
        self.clock = clock
        self.grammar_bound = True  # the engine stops a grammar past its work bound itself
        self._seen: OrderedDict[str, tuple[str, str | None]] = OrderedDict()  # kind, param
        self._sent: OrderedDict[int, dict[int, _Sent]] = OrderedDict()  # pid: key: sent
        self._exits: OrderedDict[int, int | None] = OrderedDict()  # pid: its status
        self._strikes: OrderedDict[str, list[float]] = OrderedDict()  # client: times
        self._cooling: OrderedDict[str, float] = OrderedDict()  # client: until

    # ------------------------------------------------------------ what the relay tells

    def sent(
        self, pid: int | None, key: int, body: Any, client: str | None,
        param: str | None = None,
    ) -> None:  # fmt: skip
        """Generation ``key`` (``body``, from ``client``; its grammar from field ``param``)
        was given to engine ``pid``."""
        if pid is None or pid in self._exits:  # it had died already: it never ran there
            return
        running = self._sent.setdefault(pid, {})
        running[key] = _Sent(key, digest(body), client, param)
        _trim(self._sent, 16)
        while len(running) > 1024:
            running.pop(min(running))

    def finished(self, pid: int | None, key: int) -> None:
        """Generation ``key`` got its answer (or its client left): not running any more."""
        if pid is not None:
            self._sent.get(pid, {}).pop(key, None)

    def grammar_refused(self, body: Any, client: str | None, param: str | None) -> None:
        """The engine refused ``body`` for its grammar's work: remembered, a strike."""
        self._remember(digest(body), _GRAMMAR, param)
        self._strike(client)

    # ------------------------------------------------------------ what the engine tells

    def settle(self, pid: int, rc: int | None) -> None:
        """Engine ``pid`` ended with ``rc`` (asyncio's: a signal as its negative)."""
        self._exits[pid] = rc
        _trim(self._exits, 16)
        self._judge(pid, self._sent.pop(pid, {}))

    def _judge(self, pid: int, running: dict[int, _Sent]) -> None:
        if not running or not crashed(self._exits.get(pid)):
            return
        last = running[max(running)]
        self._remember(last.digest, _CRASHED, None)
        self._strike(last.client)

    def stalled(self, in_flight: list[tuple[Any, str | None, str | None]]) -> int:
        """The engine stalled with these generations (body, client, grammar field) in
        flight: on a build without the grammar bound, those with a grammar are blamed.
        Returns how many were."""
        if self.grammar_bound:
            return 0
        blamed = 0
        for body, client, param in in_flight:
            if param is not None:
                self._remember(digest(body), _CRASHED, param)
                self._strike(client)
                blamed += 1
        return blamed

    # ------------------------------------------------------------ the verdict

    def check(self, body: Any, client: str | None = None) -> None:
        """429 ``client_cooldown`` for a client in the cooldown; 400 for a request an
        engine proved harmful (``request_crashed_engine``, ``grammar_too_complex``)."""
        wait_s = self.cooldown_s(client)
        if wait_s is not None:
            raise ClientCooldownError(client or "", math.ceil(wait_s))
        seen = self._seen.get(digest(body))
        if seen is None:
            return
        kind, param = seen
        if kind == _GRAMMAR:
            raise GrammarLimitError(
                "the engine refused this same request before: its grammar needs more work "
                "per token than the engine's bound (--grammar-max-work)",
                param=param,
            )
        raise RequestError(
            "the engine died while running this same request before; it is refused so that "
            "it cannot take the service down again",
            code="request_crashed_engine", param=param,
        )  # fmt: skip

    def cooldown_s(self, client: str | None) -> float | None:
        """How long ``client`` is still refused, or None."""
        if client is None:
            return None
        until = self._cooling.get(client)
        if until is None:
            return None
        left = until - self.clock()
        if left <= 0:
            del self._cooling[client]
            return None
        return left

    def remember(self, body: Any) -> None:
        """Remember ``body`` as a request an engine died running (tests, tools)."""
        self._remember(digest(body), _CRASHED, None)

    def __len__(self) -> int:
        return len(self._seen)

    # ------------------------------------------------------------ inside

    def _remember(self, key: str, kind: str, param: str | None) -> None:
        self._seen[key] = (kind, param)
        self._seen.move_to_end(key)
        _trim(self._seen, self.size)

    def _strike(self, client: str | None) -> None:
        if client is None:
            return
        now = self.clock()
        times = [t for t in self._strikes.pop(client, []) if now - t < STRIKE_WINDOW_S]
        times.append(now)
        if len(times) >= STRIKES:
            self._cooling[client] = now + COOLDOWN_S
            self._cooling.move_to_end(client)
            _trim(self._cooling, MAX_CLIENTS)
            times = []
        self._strikes[client] = times
        _trim(self._strikes, MAX_CLIENTS)


def _trim(d: OrderedDict[Any, Any], size: int) -> None:
    while len(d) > size:
        d.popitem(last=False)
