"""Everything one running server owns, in one object the handlers and the governor reach.

Owns :class:`ServeContext` (no module-level state: two servers in one process,
as in tests, share nothing) and the facts about the served model that the
routes need (:class:`ServedModel`). The app reaches it as
``request.app.state.ctx``; the governor through
:class:`slmguard.governor.serving.ServeEngine`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from slmguard.serve.engine import EngineProcess
from slmguard.serve.flights import Flights
from slmguard.serve.hooks import Hooks
from slmguard.serve.liveness import Liveness
from slmguard.serve.metrics import ServeMetrics
from slmguard.serve.queue import SlotQueue
from slmguard.serve.sessions import SessionService
from slmguard.serve.slots import SlotsView
from slmguard.settings import ServeSettings

#: Said in the startup line, /v1/models and the README: the embedded model is not a chat model.
BASE_MODEL_NOTE = (
    "the embedded Gemma 3 270M is a base (pretrained) model: it continues text well "
    "(/v1/completions) but its chat answers are nonsense; serve an instruction-tuned GGUF "
    "with --model for chat"
)


@dataclass(frozen=True)
class ServedModel:
    """The model the engine serves, as the routes describe it."""

    id: str
    path: str
    file_bytes: int
    sha256: str | None = None
    arch: str = ""
    n_ctx_train: int = 0
    n_vocab: int = 0  # token ids are 0..n_vocab-1 (0: unknown, not checked)
    embeddings: bool = False  # the GGUF declares a pooling type (an embedding model)
    chat_template: bool = False  # the GGUF carries a chat template
    note: str | None = None  # e.g. BASE_MODEL_NOTE for the embedded base model


@dataclass
class ServeContext:
    settings: ServeSettings
    engine: EngineProcess
    queue: SlotQueue
    model: ServedModel
    engine_version: str
    api_key: str | None = None
    admin_token: str | None = None
    sessions: SessionService | None = None
    liveness: Liveness | None = None
    hooks: Hooks = field(default_factory=Hooks)
    flights: Flights = field(default_factory=Flights)
    degraded_reasons: dict[str, str] = field(default_factory=dict)
    created_s: int = field(default_factory=lambda: int(time.time()))
    metrics: ServeMetrics = field(init=False)
    slots: SlotsView = field(init=False)

    def __post_init__(self) -> None:
        self.slots = SlotsView(self.engine)
        self.metrics = ServeMetrics(self)

    @property
    def state(self) -> str:
        state = self.engine.state
        if state == "ready" and self.degraded_reasons:
            return "degraded"
        return state

    @property
    def model_id(self) -> str:
        return self.model.id
