"""Which on-demand models are in memory: loaded when a request needs one, unloaded when idle.

Owns :class:`ResidencyManager`. A request for an on-demand model that is not loaded
waits in that model's bounded queue (:meth:`~slmguard.serve.queue.SlotQueue.loading`:
429 when full) while the model loads; one load at a time, after the policy said there
is room (:meth:`~slmguard.governor.request.ResidencyPolicy.room_for`: the governor's
memory signal against the shed watermark, idle on-demand models evicted first, the
lowest priority first; a busy one never) and held until the engine serves, so the
next decision sees its memory; a model that cannot fit is answered 503 naming the
memory. An on-demand model idle for its ``idle_unload_s`` is unloaded. A pinned model
is never loaded or unloaded here. It decides no memory itself (the policy's) and
starts no process (each :class:`~slmguard.serve.modelengine.ModelEngine`'s engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from slmguard.errors import EngineError, SlmguardError
from slmguard.governor.policy import Thresholds, room_for
from slmguard.governor.request import ResidencyPolicy, Room
from slmguard.serve.modelengine import ModelEngine
from slmguard.serve.models import ModelTable

log = logging.getLogger(__name__)

#: The idle check's longest interval (a model idle for ``idle_unload_s`` is unloaded
#: at most this much later, or a quarter of its idle time when that is shorter).
IDLE_POLL_S = 1.0


class ResidencyManager:
    """Loads and unloads the on-demand models of ``models`` (see the module docstring)."""

    def __init__(
        self,
        models: ModelTable,
        policy: ResidencyPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.models = models
        self.policy = policy
        self.clock = clock
        self.loads = 0  # on-demand loads started
        self.evictions = 0  # idle models unloaded to make room
        self.idle_unloads = 0  # idle models unloaded after their idle time
        self._lock = asyncio.Lock()  # one load at a time: each decision sees the last one
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ a request's model

    @contextlib.asynccontextmanager
    async def serving(self, model: ModelEngine) -> AsyncIterator[ModelEngine]:
        """Hold ``model`` for one request, from its route to its relay (it is busy: never
        evicted meanwhile), loaded first when it is an on-demand model out of memory."""
        model.users += 1
        model.touch()
        try:
            await self.ready(model)
            yield model
        finally:
            model.users -= 1
            model.touch()

    async def ready(self, model: ModelEngine) -> None:
        """Return once an on-demand ``model`` serves, loading it when it is not in
        memory; a pinned model as it is (its relay answers 503 while it loads or
        restarts). Waits in the model's bounded queue (429 when full); 503 when it cannot
        fit (the policy's refusal) or does not come up."""
        if not model.residency.on_demand:
            return
        engine = model.engine
        if engine.state == "ready" and not model.unloaded:
            return
        with model.queue.loading():
            if model.unloaded or engine.state == "failed":
                await self._load(model)
            ok = await engine.wait_ready(self.models_timeout_s(model))
        if not ok:
            raise model.relay.unavailable()

    def models_timeout_s(self, model: ModelEngine) -> float:
        return model.engine.load_bound_s()

    async def _load(self, model: ModelEngine) -> None:
        """Make room and load ``model``, one load at a time; the lock is held until the
        engine serves (or gives up), so the next load is decided on its memory."""
        async with self._lock:
            engine = model.engine
            if not (model.unloaded or engine.state == "failed"):
                return  # another request loaded it meanwhile
            await self._make_room(model)
            if engine.state == "failed":
                await engine.revive()
            self.loads += 1
            log.info("loading %s on demand", model.name)
            await model.load()
            if not await engine.wait_ready(self.models_timeout_s(model)):
                log.warning("%s did not come up on demand (%s)", model.name, engine.state)

    async def _make_room(self, model: ModelEngine) -> None:
        """Evict what the policy names for ``model``; ask again when one of them became
        busy meanwhile (it is then not evicted); its refusal is raised."""
        for _ in range(len(self.models) + 1):
            room = self.policy.room_for(model.name)
            if room.refusal is not None:
                raise room.refusal
            evicted = [await self.evict(name, f"evicted to make room for {model.name}")
                       for name in room.evict]  # fmt: skip
            if all(evicted):
                return
        raise EngineError(f"no room could be made for {model.name}: the models to evict "
                          "stayed busy")  # fmt: skip

    async def evict(self, name: str, reason: str) -> bool:
        """Unload the idle on-demand model ``name`` (False when it is busy or pinned)."""
        victim = self.models.get(name)
        if not await victim.evict(reason):
            return False
        self.evictions += 1
        log.info("unloaded %s: %s", name, reason)
        return True

    def failed(self, model: ModelEngine) -> None:
        """An on-demand model's engine gave up: its next request loads it again."""
        err: SlmguardError | None = model.engine.load_error
        log.error(
            "%s (on demand) failed%s; its next request loads it again",
            model.name, f": {err.message}" if err is not None else "",
        )  # fmt: skip

    # ------------------------------------------------------------ idle unloading

    def start(self) -> asyncio.Task[None] | None:
        """Run the idle check (only when some on-demand model has an idle time)."""
        if not any(self._idle_s(m) for m in self.models):
            return None
        self._task = asyncio.create_task(self.run(), name="residency")
        return self._task

    async def aclose(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @staticmethod
    def _idle_s(model: ModelEngine) -> float:
        r = model.residency
        return r.idle_unload_s if r.on_demand and r.idle_unload_s > 0 else 0.0

    async def run(self) -> None:
        times = [t for m in self.models if (t := self._idle_s(m))]
        poll = max(0.05, min(IDLE_POLL_S, min(times) / 4))
        while not self._stop.is_set():
            await self.unload_idle()
            with contextlib.suppress(asyncio.exceptions.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), poll)

    async def unload_idle(self) -> None:
        """Unload each on-demand model idle for its ``idle_unload_s``; a busy one counts
        as used now."""
        now = self.clock()
        for model in self.models:
            idle_s = self._idle_s(model)
            if not idle_s or model.unloaded:
                continue
            if model.busy() or (self._lock.locked() and model.engine.state != "ready"):
                model.touch()
                continue
            if now - model.last_used_s >= idle_s and await model.evict(
                f"idle for {idle_s:g} s (its idle_unload_s)"
            ):
                self.idle_unloads += 1
                log.info("unloaded %s: idle for %g s", model.name, idle_s)

    def status(self) -> list[dict[str, object]]:
        """Each model's residency, for /health."""
        now = self.clock()
        return [
            {
                "model": m.name,
                "residency": m.residency.residency,
                "priority": m.residency.priority,
                "state": m.state,
                "idle_unload_s": m.residency.idle_unload_s,
                "idle_s": round(now - m.last_used_s, 1),
                "busy": m.busy(),
                "planned_bytes": m.residency.planned_bytes,
            }
            for m in self.models
        ]


class PlanResidency:
    """Without a governor (``--no-governor``), an on-demand load is decided by the plan's
    resident sets alone: idle on-demand models are evicted (lowest priority first) until
    the model and those left in memory are within one set; no memory is measured."""

    def __init__(self, models: ModelTable, sets: tuple[frozenset[str], ...]) -> None:
        self.models = models
        self.sets = sets

    def room_for(self, name: str) -> Room:
        evictable = [
            (m.name, 0)
            for m in self.models.by_priority()
            if m.name != name and m.residency.on_demand and not m.unloaded and not m.busy()
        ]
        resident = [m.name for m in self.models if not m.unloaded]
        evict, verdict = room_for(name, 0, evictable, state=None, snap=None, th=Thresholds(),
                                  resident=resident, sets=self.sets)  # fmt: skip
        return Room(evict, verdict.error())
