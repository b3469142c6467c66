"""Who runs next on the engine: its slots and the bounded FIFO in front of them.

Owns admission to the engine's ``slots`` (llama-server's ``-np``: generations
decoded together by continuous batching). A request takes as many slots as it
asks completions for (``n``); when none are free it waits in arrival order,
and when ``capacity`` requests already wait it is refused with
:class:`~slmguard.errors.QueueFullError` (429 with Retry-After). The slot count
follows the engine (the governor's shrink drops slots first): requests that
hold more than there are now keep them until they finish. A limit below the
engine's slots (:meth:`SlotQueue.limit`, the governor's heat rule) admits fewer
at once, never fewer than one; a request asking more completions than that takes
what is allowed. A request for an on-demand model that is loading waits here too
(:meth:`SlotQueue.loading`), within the same capacity. Nothing here knows HTTP or
the engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterator

from slmguard.errors import QueueFullError


class SlotQueue:
    def __init__(self, slots: int, capacity: int) -> None:
        if slots < 1 or capacity < 0:
            raise ValueError(f"need slots >= 1 and capacity >= 0, got {slots} and {capacity}")
        self.slots = slots
        self.capacity = capacity
        self.in_use = 0
        self.loading_waiters = 0  # requests waiting for the engine to load (no slot yet)
        self.cap: int | None = None  # limit()'s: fewer than the engine's slots at once
        self._waiters: collections.deque[tuple[int, asyncio.Future[int]]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters) + self.loading_waiters

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """A place in the queue while the engine loads (an on-demand model): bounded
        by the same capacity as a wait for a slot (QueueFullError: 429)."""
        if self.waiting >= self.capacity:
            raise QueueFullError(self.capacity)
        self.loading_waiters += 1
        try:
            yield
        finally:
            self.loading_waiters -= 1

    @property
    def busy(self) -> int:
        """Slots held now."""
        return self.in_use

    @property
    def allowed(self) -> int:
        """Slots that may be held at once: the engine's, under the limit, at least one."""
        return self.slots if self.cap is None else max(1, min(self.slots, self.cap))

    def _fits(self, n: int) -> bool:
        return self.in_use + n <= self.allowed

    async def acquire(self, n: int = 1, *, bypass_limit: bool = False) -> int:
        """Wait for ``n`` free slots, first come first served; returns the slots taken
        (``n``, or all of them when the engine now has fewer), to pass to :meth:`release`.

        ``bypass_limit`` skips the capacity check (internal work, e.g. a canary).
        """
        n = max(1, n)
        if not self._waiters and self._fits(min(n, self.allowed)):
            taken = min(n, self.allowed)
            self.in_use += taken
            return taken
        if not bypass_limit and self.waiting >= self.capacity:
            raise QueueFullError(self.capacity)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            return await fut
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif fut.done() and not fut.cancelled():
                self.release(fut.result())  # granted while being cancelled: give it back
            raise

    def release(self, taken: int) -> None:
        """Give back what :meth:`acquire` returned."""
        self.in_use = max(0, self.in_use - taken)
        self._grant()

    def resize(self, slots: int) -> None:
        """The engine now runs ``slots`` slots."""
        self.slots = max(1, slots)
        self._grant()

    def limit(self, slots: int | None) -> None:
        """Hold at most ``slots`` at once (None: the engine's slots); held ones stay held."""
        self.cap = None if slots is None else max(1, slots)
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            n = min(n, self.allowed)
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(n):
                return
            self._waiters.popleft()
            self.in_use += n
            fut.set_result(n)
