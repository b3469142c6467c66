"""Slow leaks: a process's private memory against what the plan explains, per request.

Owns the pure part of leak-aware recycling. A :class:`LeakTrack` per process (the
engine; the front, which is watched but never recycled) is fed one :class:`Sample` per
governor tick: its pid, RssAnon + RssShmem + VmSwap (resident or swapped out, the same
leak) and the generations served so far. From it:

- :func:`drift`: the footprint beyond what is expected, the larger of the *settled
  baseline* (the footprint once ``warmup_requests`` were served: compute buffers become
  resident as the first requests reach them) and the first sight plus the plan's
  ``use`` parts (memory the plan says grows with use); and the growth per 1,000
  requests since the baseline.
- :func:`drift_bound_bytes`: the planned bound, a share (``room_fraction``) of the room
  between the working set without the drift and the shed watermark of the limit.
- :func:`recycle_verdict`: recycle at a natural idle moment once the drift reached
  ``idle_fraction`` of the bound, drain for one once it would reach the bound with what
  the generations in flight and queued still add on this engine. Only growth
  spread over the requests counts (each half of the requests since the baseline added
  at least ``spread_min`` of it): a one-time step (a long prompt touching more compute
  buffer) is no leak, and a recycle would not give it back.

No file, no clock, no action here: ``governor.recycling`` reads and acts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slmguard.errors import ConfigError

MiB = 1 << 20


@dataclass(frozen=True)
class LeakSettings:
    """When a drift is a leak and what recycling may cost; every field has a default.

    Example::

        LeakSettings(warmup_requests=16, room_fraction=0.5, drain_timeout_s=60)
    """

    enabled: bool = True
    warmup_requests: int = 16  # generations before the baseline is taken
    room_fraction: float = 0.5  # of the room below the shed watermark: the bound
    idle_fraction: float = 0.75  # of the bound: recycle if the engine happens to be idle
    min_bound_bytes: int = 16 * MiB  # never recycle for less
    spread_min: float = 0.2  # each half of the requests added at least this share
    drain_timeout_s: float = 60.0  # in-flight generations may finish within this
    retry_s: float = 30.0  # after a drain that timed out or a recycle that failed
    max_points: int = 128  # (requests, bytes) points kept per process (thinned)

    def __post_init__(self) -> None:
        if not (
            self.warmup_requests >= 1
            and 0 < self.room_fraction <= 1
            and 0 < self.idle_fraction <= 1
            and self.min_bound_bytes >= 0
            and 0 <= self.spread_min < 0.5
            and self.drain_timeout_s > 0
            and self.retry_s >= 0
            and self.max_points >= 8
        ):
            raise ConfigError(
                "leak settings: need warmup_requests >= 1, 0 < room_fraction <= 1, "
                "0 < idle_fraction <= 1, min_bound_bytes >= 0, 0 <= spread_min < 0.5, "
                "drain_timeout_s > 0, retry_s >= 0, max_points >= 8"
            )


@dataclass(frozen=True)
class Sample:
    """One reading of one process: RssAnon + RssShmem + VmSwap, generations served."""

    pid: int
    private_bytes: int
    requests: int


@dataclass(frozen=True)
class LeakTrack:
    """One process's history since it started (a new pid starts a new track)."""

    pid: int | None = None
    first: Sample | None = None
    baseline: Sample | None = None
    last: Sample | None = None
    points: tuple[tuple[int, int], ...] = ()  # (requests, bytes) from the baseline on


def _thin(points: tuple[tuple[int, int], ...], keep: int) -> tuple[tuple[int, int], ...]:
    """At most ``keep`` points: the first, every other one after it, the last."""
    if len(points) <= keep:
        return points
    return (points[0], *points[2:-1:2], points[-1])


def observe(track: LeakTrack, sample: Sample, settings: LeakSettings) -> LeakTrack:
    """``track`` with ``sample`` added (a fresh track when the pid changed)."""
    if track.pid != sample.pid or track.first is None:
        track = LeakTrack(pid=sample.pid, first=sample)
    assert track.first is not None
    baseline, points = track.baseline, track.points
    point = (sample.requests, sample.private_bytes)
    if baseline is None:
        if sample.requests - track.first.requests >= settings.warmup_requests:
            baseline, points = sample, (point,)
    elif sample.requests > points[-1][0]:
        points = _thin((*points, point), settings.max_points)
    else:  # no request since: the latest reading of that point
        points = (*points[:-1], (points[-1][0], max(points[-1][1], sample.private_bytes)))
    return replace(track, baseline=baseline, last=sample, points=points)


@dataclass(frozen=True)
class Drift:
    """What a track shows now. ``drift_bytes`` may be negative (below what is expected)."""

    pid: int
    first_bytes: int
    baseline_bytes: int
    expected_bytes: int
    current_bytes: int
    drift_bytes: int
    requests: int  # since the baseline
    per_1000_requests_bytes: int | None  # growth since the baseline, per 1,000 requests
    spread: bool  # the growth went on over the requests, not in one step

    def as_dict(self) -> dict[str, int | bool | None]:
        return {
            "pid": self.pid,
            "first_bytes": self.first_bytes,
            "baseline_bytes": self.baseline_bytes,
            "expected_bytes": self.expected_bytes,
            "current_bytes": self.current_bytes,
            "drift_bytes": self.drift_bytes,
            "requests": self.requests,
            "per_1000_requests_bytes": self.per_1000_requests_bytes,
            "spread": self.spread,
        }


def _spread(points: tuple[tuple[int, int], ...], share: float) -> bool:
    """Each half of the requests since the baseline added at least ``share`` of the growth."""
    (r0, b0), (rn, bn) = points[0], points[-1]
    grown = bn - b0
    if grown <= 0 or rn <= r0:
        return False
    middle = r0 + (rn - r0) / 2
    b_mid = max(b for r, b in points if r <= middle)
    return min(b_mid - b0, bn - b_mid) >= share * grown


def drift(track: LeakTrack, settings: LeakSettings, *, use_bytes: int = 0) -> Drift | None:
    """The drift of a settled track (None before its baseline). ``use_bytes``: the plan's
    memory that grows with use, expected on top of the first sight."""
    first, base, last = track.first, track.baseline, track.last
    if first is None or base is None or last is None or track.pid is None:
        return None
    expected = max(base.private_bytes, first.private_bytes + max(0, use_bytes))
    requests = last.requests - base.requests
    grown = last.private_bytes - base.private_bytes
    return Drift(
        pid=track.pid,
        first_bytes=first.private_bytes,
        baseline_bytes=base.private_bytes,
        expected_bytes=expected,
        current_bytes=last.private_bytes,
        drift_bytes=last.private_bytes - expected,
        requests=requests,
        per_1000_requests_bytes=round(grown * 1000 / requests) if requests > 0 else None,
        spread=len(track.points) >= 3 and _spread(track.points, settings.spread_min),
    )


def drift_bound_bytes(
    limit_bytes: int | None,
    shed_pct: float,
    used_bytes: int,
    drift_bytes: int,
    settings: LeakSettings,
) -> int | None:
    """The planned bound: ``room_fraction`` of the room between what is used without the
    drift and the shed watermark, at least ``min_bound_bytes``; None without a limit."""
    if limit_bytes is None:
        return None
    room = limit_bytes * shed_pct / 100 - (used_bytes - max(0, drift_bytes))
    return int(max(settings.min_bound_bytes, settings.room_fraction * room))


def drain_growth_bytes(d: Drift, queued: int) -> int:
    """What the drain still adds to the drift: the ``queued`` generations (in flight or
    waiting) run on the old engine, each growing it as the requests since the baseline
    did on average."""
    rate = d.per_1000_requests_bytes
    return 0 if rate is None or rate <= 0 or queued <= 0 else queued * rate // 1000


def recycle_verdict(
    d: Drift | None,
    bound_bytes: int | None,
    *,
    idle: bool,
    settings: LeakSettings,
    queued: int = 0,
) -> str | None:
    """``"drain"`` (stop admitting, let in-flight finish, recycle), ``"idle"`` (recycle
    now, nothing is running) or None. ``queued``: the generations in flight or waiting,
    which the drain lets finish on this engine first: a leak of megabytes a request
    would carry a drain decided at the bound itself past it."""
    if not settings.enabled or d is None or bound_bytes is None or not d.spread:
        return None
    if d.requests < settings.warmup_requests:
        return None
    if d.drift_bytes + drain_growth_bytes(d, queued) >= bound_bytes:
        return "drain"
    if idle and d.drift_bytes >= settings.idle_fraction * bound_bytes:
        return "idle"
    return None


@dataclass(frozen=True)
class EngineView:
    """The engine as the leak check sees it, when it serves (``EngineControl.engine_view``)."""

    pid: int
    requests: int  # generations the front has finished so far (every engine's)
    idle: bool  # nothing in flight, nothing queued
    queued: int = 0  # generations in flight or waiting: a drain runs them on this engine


@dataclass(frozen=True)
class RecycleEngine:
    """The governor's action: recycle the engine (``verdict``: "idle" or "drain") of the
    model named (None: the primary, the only one of a single-model server)."""

    verdict: str
    model: str | None = None


@dataclass(frozen=True)
class RecycleOutcome:
    """What the server reports back from one recycle (``EngineControl.recycle``)."""

    pid_before: int | None
    pid_after: int | None
    drained_s: float  # from "stop admitting" to the engine idle
    reload_s: float  # from the restart to the engine serving again
    postponed: bool = False  # the in-flight requests did not finish in time: nothing done
    waiting: int = 0  # requests queued behind the recycle when it restarted the engine
