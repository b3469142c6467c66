"""The engines one governor drives: each model's state, measurements and policy view.

Owns :class:`GovernedModel` (one engine: its name, the server's control over it,
its :class:`~slmguard.governor.policy.MemoryModel`, its
:class:`~slmguard.governor.policy.PolicyState`, how it is kept, its leak check (a
:class:`~slmguard.governor.recycling.Recycling`) and what the governor
measured of it: its private memory at first sight, now and at most) and
:class:`ModelPolicy`, the :class:`~slmguard.governor.request.RequestPolicy` of one
model of a board (the one level, that model's context and parking). The loop and
its actions are :mod:`slmguard.governor.runtime`'s; the choice of the model a step
acts on is :mod:`slmguard.governor.ladder`'s. Reads only ``/proc/<pid>/status``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from slmguard.errors import SlmguardError
from slmguard.governor.ladder import Rung
from slmguard.governor.leaks import EngineView, LeakSettings, RecycleOutcome
from slmguard.governor.policy import MemoryModel, PolicyState
from slmguard.governor.recycling import Recycling
from slmguard.governor.request import SizedRequest
from slmguard.host.process import read_status

if TYPE_CHECKING:
    from slmguard.governor.runtime import Governor


class EngineControl(Protocol):
    """What the governor needs from the server for each engine. The server implements it."""

    async def resize_context(self, n_ctx: int) -> None:
        """Recreate the engine's context with ``n_ctx`` tokens; raise SlmguardError on failure."""

    async def abort_newest(self, reason: str) -> bool:
        """Abort the most recently started generation with ``reason``; False if none runs."""

    async def drop_prefix_cache(self) -> None:
        """Forget the engine's cached prompt prefix (its KV cells)."""

    async def park(self, reason: str) -> None:
        """Stop the engine and keep it stopped (running generations end with ``reason``)."""

    async def resume(self, n_ctx: int) -> None:
        """Start the parked engine with ``n_ctx``; return once it serves (EngineError if not)."""

    def engine_pid(self) -> int | None:
        """The engine's pid, None while it is not running."""

    def planned_slots(self) -> int:
        """The slots the engine was planned with (heat admits fewer, never more)."""

    def limit_slots(self, slots: int | None) -> None:
        """Admit at most ``slots`` generations at once (None: as many as the engine has);
        running ones keep their slots, waiting ones wait longer."""

    def engine_view(self) -> EngineView | None:
        """The engine's pid, the generations finished and whether it is idle; None while
        it does not serve (the leak check, :mod:`slmguard.governor.recycling`)."""

    async def recycle(self, reason: str, drain_timeout_s: float) -> RecycleOutcome:
        """Stop admitting to the engine, let in-flight generations finish within
        ``drain_timeout_s`` (else ``postponed``, nothing done), restart it, resume."""


@dataclass(frozen=True)
class Keeping:
    """How a model of a board is kept, as the governor sees it: its ``priority`` (the
    ladder acts on the lowest first), whether it is loaded ``on_demand`` (evicted while
    idle rather than shrunk), the bytes its plan says it makes resident, and the
    server's answers about it now: ``busy`` (requests hold or wait for it), ``resident``
    (its engine holds its memory) and ``evict`` (unload it while idle; False if not)."""

    priority: int = 100
    on_demand: bool = False
    planned_bytes: int = 0
    busy: Callable[[], bool] = lambda: False
    resident: Callable[[], bool] = lambda: True
    evict: Callable[[str], Awaitable[bool]] | None = None


class GovernedModel:
    """One engine the governor drives (see the module docstring). ``memory`` None: the
    governor's configured one (the primary's: ``GovernorConfig.model``)."""

    def __init__(
        self,
        name: str,
        control: EngineControl | None,
        state: PolicyState,
        *,
        memory: MemoryModel | None = None,
        slot_tokens: Callable[[int], int] | None = None,
        keeping: Keeping | None = None,
        recycling: Recycling | None = None,
    ) -> None:
        self.name = name
        self.control = control
        self.state = state
        self.memory = memory
        self.slot_tokens = slot_tokens or (lambda n_ctx: n_ctx)
        self.keeping = keeping or Keeping()
        self.recycling = recycling or Recycling(LeakSettings())  # its leak check
        self.baseline: tuple[int, int] | None = None  # (pid, private bytes at first sight)
        self.private_bytes: int | None = None
        # The most the engine held so far: what a resume must make room for, even
        # when it was parked while loading (holding little yet).
        self.private_max = 0

    def watch(self, root: Path) -> None:
        """Read the engine's private memory now (None while it does not run)."""
        pid = self.control.engine_pid() if self.control is not None else None
        status = read_status(root, pid) if pid is not None else None
        if pid is None or status is None:  # not running, exited, or its status unreadable
            self.private_bytes = None
            return
        private = status.private_bytes
        self.private_bytes = private
        self.private_max = max(self.private_max, private)
        if self.baseline is None or self.baseline[0] != pid:
            self.baseline = (pid, private)

    def extra_bytes(self, use_bytes: int) -> int:
        """Planned compute-buffer bytes (``use_bytes``) the engine has not made resident
        yet (>= 0)."""
        if not use_bytes or self.baseline is None or self.private_bytes is None:
            return use_bytes
        grown = self.private_bytes - self.baseline[1]
        return max(0, use_bytes - max(0, grown))

    def held_bytes(self) -> int:
        """What evicting it would give back: its private memory now, else its plan's."""
        return self.private_bytes if self.private_bytes is not None else self.keeping.planned_bytes

    def need_bytes(self) -> int:
        """What loading it must find room for: its plan's, or the most it held before."""
        return max(self.keeping.planned_bytes, self.private_max)

    def rung(self, memory: MemoryModel, *, several: bool) -> Rung:
        k = self.keeping
        return Rung(
            self.name, self.state, memory, priority=k.priority, on_demand=k.on_demand,
            resident=k.resident() if several else True, busy=k.busy() if several else False,
        )  # fmt: skip


class ModelPolicy:
    """One model's :class:`~slmguard.governor.request.RequestPolicy` on a board: the
    governor's answers with that model's state (its context, whether it is parked)."""

    def __init__(self, governor: Governor, model: GovernedModel) -> None:
        self.governor = governor
        self.model = model

    def max_tokens_cap(self) -> int | None:
        return self.governor.max_tokens_cap(self.model)

    def context_verdict(self, request: SizedRequest) -> SlmguardError | None:
        return self.governor.context_verdict(request, self.model)

    def admit(self, request: SizedRequest) -> SlmguardError | None:
        return self.governor.admit(request, self.model)
