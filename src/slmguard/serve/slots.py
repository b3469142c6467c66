"""The engine's slots as llama-server reports them (``GET /slots``), cached.

Owns the parse of llama-server's per-slot JSON into :class:`SlotState`
snapshots (a slot's KV cells, and its :attr:`SlotState.step_key`: what changes
with every decode step it takes part in) and a cache of the last answer with
its time, so ``/health``, ``/metrics`` and the top view never wait on the
engine: llama-server serves ``/slots`` from its main loop between two decode
steps, late while a long prompt batch runs and never while it is wedged. The
liveness check and the metrics refresh the cache; everything else only reads it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from slmguard.errors import EngineUnreachableError

if TYPE_CHECKING:
    from slmguard.serve.engine import EngineProcess


@dataclass(frozen=True)
class SlotState:
    id: int
    n_ctx: int
    is_processing: bool
    n_prompt_tokens: int
    n_decoded: int
    id_task: int = -1  # the task it runs or ran last (-1: none yet)
    n_prompt_processed: int = 0  # prompt tokens of that task evaluated so far

    @property
    def step_key(self) -> tuple[int, bool, int, int, int]:
        """What changes with every decode step the slot takes part in (a batch of its
        prompt, one token out) or when it takes or ends a task: the liveness check's
        per-slot progress."""
        return (self.id_task, self.is_processing, self.n_prompt_tokens,
                self.n_prompt_processed, self.n_decoded)  # fmt: skip

    @property
    def kv_cells_used(self) -> int:
        """The slot's cached tokens: llama-server's ``n_prompt_tokens`` is the size of
        the slot's token list, which already holds every token generated so far (each
        sampled token is appended before it is decoded), so ``n_decoded`` is not added."""
        return min(self.n_prompt_tokens, self.n_ctx)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kv_cells_used": self.kv_cells_used}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def parse_slots(data: Any) -> tuple[SlotState, ...]:
    """llama-server's ``/slots`` array; entries it cannot read are skipped."""
    if not isinstance(data, list):
        return ()
    out = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("id"), int):
            continue
        nxt = item.get("next_token")
        first = nxt[0] if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict) else {}
        out.append(
            SlotState(
                id=item["id"],
                n_ctx=_int(item.get("n_ctx")),
                is_processing=bool(item.get("is_processing")),
                n_prompt_tokens=_int(item.get("n_prompt_tokens")),
                n_decoded=_int(first.get("n_decoded")),
                id_task=item["id_task"] if isinstance(item.get("id_task"), int) else -1,
                n_prompt_processed=_int(item.get("n_prompt_tokens_processed")),
            )
        )
    return tuple(out)


class SlotsView:
    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine
        self.slots: tuple[SlotState, ...] = ()
        self.taken_s: float | None = None
        self.engine_start: int | None = None  # the engine start the cache belongs to

    async def refresh(self, timeout_s: float) -> bool:
        """Ask the engine; True when it answered (the cache is then fresh)."""
        try:
            status, data = await self.engine.client.get_json("/slots", timeout_s=timeout_s)
        except EngineUnreachableError:
            return False
        if status != 200:
            return False
        self.slots = parse_slots(data)
        self.taken_s = time.monotonic()
        self.engine_start = self.engine.starts
        return True

    def current(self) -> tuple[SlotState, ...]:
        """The cached slots, empty when they describe an engine that is gone."""
        if self.engine_start != self.engine.starts or self.engine.state != "ready":
            return ()
        return self.slots
