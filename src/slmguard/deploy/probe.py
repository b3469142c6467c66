"""The liveness probe a container runs against its own server: fail only when it cannot recover.

Owns what "alive" means for an orchestrator that restarts what it judges dead
(the kubelet's ``livenessProbe``; ``python -m slmguard.deploy.probe`` is the
exec command the rendered manifests give it). The server already recovers from
most failures by itself, and a probe that fails on them would turn every
recovery into a pod restart and a full model reload:

- a **killed or crashed engine** is restarted by the front within its restart
  budget (``/health`` answers 503 meanwhile): alive;
- a **stalled engine** (a wedged decode) is found by the front's liveness loop
  within its stall time, SIGKILLed and replaced (``engine.stalls`` counts
  them; 503 meanwhile): alive;
- a **parked** engine (the governor stopped it to avoid an OOM kill) and an
  engine still **loading**: alive;
- an engine that **failed for good** (restart budget spent; the front exits 70
  right after, which the kubelet sees anyway) or was **stopped**: dead;
- **no answer** within the timeout: the front's event loop is hung (the case
  systemd's ``WatchdogSec=`` catches on a board): dead;
- a stall the front **should have acted on long ago**: requests in flight, no
  engine progress for ``stall_grace`` times its stall time (``/health``
  ``liveness.since_progress_s`` and ``stall_after_s``), yet the engine is
  still "ready": the front's own liveness loop is not running: dead.

Readiness is a different question (is the engine serving?) and is answered by
``GET /health`` itself: 200 only while ready or degraded.

Stdlib only and no other slmguard module: it runs in the pod every period.
Exit 0 alive, 1 dead; one line on stdout with the reason (the kubelet keeps it
in the pod's events).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8080/health"
#: A stall still unhandled after this many stall times means the front is not coping.
DEFAULT_STALL_GRACE = 2.0
#: Engine states after which the front no longer recovers (it exits 70 on "failed").
FINAL_STATES = ("failed", "stopped")
MAX_BODY_BYTES = 1 << 20


def judge(
    status: int | None, body: Mapping[str, Any] | None, stall_grace: float = DEFAULT_STALL_GRACE
) -> tuple[bool, str]:
    """(alive, reason) from one ``GET /health`` answer (``status`` None: no answer)."""
    if status is None:
        return False, "no answer from the front: its event loop is hung or it is gone"
    if status not in (200, 503) or not isinstance(body, Mapping):
        return False, f"GET /health answered {status} without the server's health body"
    engine = body.get("engine")
    engine = engine if isinstance(engine, Mapping) else {}
    state = str(engine.get("state"))
    stalls = engine.get("stalls")
    if state in FINAL_STATES:
        return False, f"engine {state} for good (restarts {engine.get('restarts')})"
    live = body.get("liveness")
    live = live if isinstance(live, Mapping) else {}
    since, after = live.get("since_progress_s"), live.get("stall_after_s")
    in_flight = body.get("in_flight")
    if (
        state == "ready"
        and isinstance(in_flight, int)
        and in_flight > 0
        and isinstance(since, int | float)
        and isinstance(after, int | float)
        and since > stall_grace * after
    ):
        return False, (
            f"no engine progress for {since:.0f} s with {in_flight} requests in flight, "
            f"{stall_grace:g} x the stall time {after:.0f} s, and the front has not replaced it"
        )
    return True, f"alive: engine {state}, {stalls} stalls handled, HTTP {status}"


def fetch(url: str, timeout_s: float) -> tuple[int | None, dict[str, Any] | None]:
    """One GET: (status, JSON body); (None, None) when nothing answered in time."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read(MAX_BODY_BYTES)
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read(MAX_BODY_BYTES)
    except (urllib.error.URLError, OSError, TimeoutError):
        return None, None
    try:
        data = json.loads(raw)
    except ValueError:
        return status, None
    return status, data if isinstance(data, dict) else None


def check(
    url: str = DEFAULT_URL, timeout_s: float = 5.0, stall_grace: float = DEFAULT_STALL_GRACE
) -> tuple[bool, str]:
    """Ask the server at ``url`` once and judge the answer."""
    status, body = fetch(url, timeout_s)
    return judge(status, body, stall_grace)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m slmguard.deploy.probe",
        description="Liveness of a local slmguard server: exit 0 alive, 1 dead.",
    )
    p.add_argument("--url", default=DEFAULT_URL, help="the server's /health (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=5.0, help="no answer in this time is dead")
    p.add_argument("--stall-grace", type=float, default=DEFAULT_STALL_GRACE)
    args = p.parse_args(argv)
    ok, reason = check(args.url, args.timeout_s, args.stall_grace)
    # The kubelet shows a probe's output in the pod's events: the one place this prints.
    sys.stdout.write(reason + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
