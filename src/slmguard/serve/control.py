"""The engine as the memory governor drives it: the server's ``EngineControl``.

Owns :class:`GovernedEngine`, the server's implementation of
:class:`slmguard.governor.runtime.EngineControl` over its llama-server child,
its queue, its requests in flight and its cached slots. The governor thinks
in KV cells (``n_ctx``, all slots together); this maps them onto the engine:
a smaller total drops slots first (each keeps its planned context), then
shrinks the one slot's context (:func:`~slmguard.serve.engine.config_for_cells`).
A shrink is urgent: running generations are aborted (503 with the reason) and
the child is replaced at once. Growing back waits until every slot is free
(queued requests wait behind it, as behind a request). A resize asked for
while the engine is restarting (after a crash or an OOM kill) is not lost:
the new settings are what the restart comes up with. An on-demand model's engine
can also be evicted (:meth:`GovernedEngine.evict`: unloaded while idle, never while
busy), the first rung of the governor's ladder for such a model. A recycle (the leak
check's) drains and restarts the engine with the same settings
(:mod:`slmguard.serve.recycle`). The governor's heat rule limits how many generations
run at once through the queue (:meth:`SlotQueue.limit`), without touching the engine.
Each wait for the engine to serve again lasts as long as its supervisor lets a load run
(:meth:`GovernedEngine.ready_bound_s`): the supervisor ends a load that takes too long.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from slmguard.errors import EngineError, EngineUnreachableError, RequestAbortedError
from slmguard.governor.leaks import EngineView, RecycleOutcome
from slmguard.serve.engine import EngineProcess, config_for_cells
from slmguard.serve.flights import Flights
from slmguard.serve.llamaserver import EngineConfig
from slmguard.serve.queue import SlotQueue
from slmguard.serve.recycle import recycle
from slmguard.serve.slots import SlotsView

log = logging.getLogger(__name__)

SHRINK_REASON = "the context is being reduced under memory pressure; retry shortly"
#: An engine the governor restarts (resumed, resized, recycled) is given this many times
#: its last measured load to serve again when that is longer than its supervisor's own
#: load bound: on a slow board (or a loaded one) a load of minutes is not a failure.
LOAD_MARGIN = 3.0


class GovernedEngine:
    def __init__(
        self,
        engine: EngineProcess,
        queue: SlotQueue,
        flights: Flights,
        slots: SlotsView,
        *,
        ready_timeout_s: float = 120.0,
        busy: Callable[[], bool] | None = None,
        evict: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        """``busy`` says whether requests hold or wait for the engine (default: its
        flights and queue); ``evict`` unloads it while idle (None: a model that is
        never evicted, as a pinned one)."""
        self.engine = engine
        self.queue = queue
        self.flights = flights
        self.slots = slots
        self.planned = engine.config
        self.ready_timeout_s = ready_timeout_s
        self._busy = busy
        self._evict = evict

    def ready_bound_s(self) -> float:
        """How long a restart the governor asked for may take to serve: as long as the
        supervisor lets a load run (:meth:`EngineProcess.load_bound_s`: it ends a load
        past its timeout itself); ``LOAD_MARGIN`` times the engine's last load when
        that is longer; never below the floor. A shorter bound ended loads the supervisor
        still allowed: resumed, timed out, parked and resumed again, none ever served."""
        own = self.engine.load_bound_s()
        last = self.engine.last_load_s or 0.0
        return max(self.ready_timeout_s, own, LOAD_MARGIN * last)

    def config_for(self, n_ctx: int) -> EngineConfig:
        return config_for_cells(self.planned, n_ctx)

    def slot_tokens(self, n_ctx: int) -> int:
        """The context one request may use when the engine has ``n_ctx`` cells in all."""
        return self.config_for(n_ctx).n_ctx_slot

    async def resize_context(self, n_ctx: int) -> None:
        engine = self.engine
        new = self.config_for(n_ctx)
        if engine.state != "ready":
            engine.config = new
            if not await engine.wait_ready(self.ready_bound_s()):
                raise EngineError(f"engine not ready to resize to {n_ctx} cells ({engine.state})")
            if engine.config == new and engine.state == "ready":
                return
        if new == engine.config:
            return
        if new.n_ctx >= engine.config.n_ctx:
            taken = await self.queue.acquire(self.queue.slots, bypass_limit=True)
            try:
                await engine.reconfigure(new)
            finally:
                self.queue.release(taken)
            return
        self.flights.abort_all(RequestAbortedError(SHRINK_REASON))
        await engine.reconfigure(new)

    async def abort_newest(self, reason: str) -> bool:
        flight = self.flights.newest()
        return flight is not None and flight.abort(RequestAbortedError(reason))

    async def drop_prefix_cache(self) -> None:
        """Erase the KV cells of every idle slot (llama-server's slot erase)."""
        if not await self.slots.refresh(timeout_s=5.0):
            raise EngineError("the engine did not answer /slots")
        for slot in self.slots.slots:
            if slot.is_processing:
                continue
            try:
                status, data = await self.engine.client.post_json(
                    f"/slots/{slot.id}?action=erase", {}
                )
            except EngineUnreachableError as err:
                raise EngineError(f"slot {slot.id} erase: {err}") from err
            if status != 200:
                raise EngineError(f"slot {slot.id} erase answered {status}: {data}")

    async def park(self, reason: str) -> None:
        """Stop the engine; running generations end with 503 ``aborted`` naming ``reason``."""
        self.flights.abort_all(RequestAbortedError(reason))
        await self.engine.park(reason)

    async def resume(self, n_ctx: int) -> None:
        await self.engine.resume(self.config_for(n_ctx))
        if not await self.engine.wait_ready(self.ready_bound_s()):
            raise EngineError(f"engine did not come back from parking ({self.engine.state})")

    def engine_pid(self) -> int | None:
        return self.engine.pid

    def busy(self) -> bool:
        if self._busy is not None:
            return self._busy()
        return bool(len(self.flights) or self.queue.busy or self.queue.waiting)

    def resident(self) -> bool:
        """Whether the engine holds (or is loading) its memory: not parked or unloaded."""
        return not self.engine.parked and self.engine.state not in ("failed", "stopped")

    async def evict(self, reason: str) -> bool:
        """Unload the engine if it may be evicted and is idle; False when it was not."""
        return self._evict is not None and await self._evict(reason)

    def planned_slots(self) -> int:
        return self.planned.n_parallel

    def limit_slots(self, slots: int | None) -> None:
        """Heat's limit on concurrent generations: the queue admits at most ``slots``."""
        self.queue.limit(slots)

    def engine_view(self) -> EngineView | None:
        engine = self.engine
        if engine.state != "ready" or engine.pid is None or engine.recycling:
            return None
        queued = self.queue.busy + self.queue.waiting  # slots held, requests waiting
        idle = not len(self.flights) and not queued
        return EngineView(engine.pid, self.flights.closed, idle, queued=queued)

    async def recycle(self, reason: str, drain_timeout_s: float) -> RecycleOutcome:
        """Drain, restart and resume the engine (:func:`slmguard.serve.recycle.recycle`)."""
        log.warning("recycling the engine: %s", reason)
        return await recycle(
            self.engine, self.queue, self.flights, drain_timeout_s=drain_timeout_s,
            ready_timeout_s=self.ready_bound_s(),
        )  # fmt: skip
