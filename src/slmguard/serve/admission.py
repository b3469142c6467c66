"""The engine slot and its bounded FIFO wait queue.

Owns who runs next on the single engine: one request holds the slot, at most
``capacity`` wait for it in arrival order (``asyncio.Lock`` wakes waiters
first-in first-out), and one more is refused with :class:`QueueFull` (the app
answers 429 with Retry-After). Nothing here knows HTTP or the worker.
"""

from __future__ import annotations

import asyncio


class QueueFull(Exception):
    def __init__(self, capacity: int) -> None:
        super().__init__(f"{capacity} requests are already waiting for the engine")
        self.capacity = capacity


class EngineQueue:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.waiting = 0
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def acquire(self, *, bypass_limit: bool = False) -> None:
        """Wait for the slot. ``bypass_limit`` is for internal work (a reload)."""
        if not bypass_limit and self._lock.locked() and self.waiting >= self.capacity:
            raise QueueFull(self.capacity)
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1

    def release(self) -> None:
        if self._lock.locked():
            self._lock.release()
