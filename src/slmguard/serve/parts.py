"""What the app and its routes reach of one server: the :class:`ServerParts` protocol.

Owns the seam between the HTTP layer (:mod:`slmguard.serve.app`,
:mod:`slmguard.serve.routes`, :mod:`slmguard.serve.auth`) and the server that
builds the parts (:class:`slmguard.serve.server.Server` implements it): the
app holds it as ``app.state.server`` and the routes read the parts through it,
so neither imports the server, and the server never imports the app (the CLI
composes the two: ``server.run(sock, create_app(server))``). Types only: it
builds nothing and does no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from slmguard.governor.runtime import Governor
    from slmguard.serve.bounds import Bounds
    from slmguard.serve.dialects.context import DialectContext
    from slmguard.serve.engine import EngineProcess
    from slmguard.serve.flights import Flights
    from slmguard.serve.liveness import Liveness
    from slmguard.serve.metrics import ServeMetrics
    from slmguard.serve.models import ModelTable
    from slmguard.serve.queue import SlotQueue
    from slmguard.serve.relay import Relay
    from slmguard.serve.residency import ResidencyManager
    from slmguard.serve.served import ServedModel
    from slmguard.serve.sessions import SessionService
    from slmguard.serve.slots import SlotsView
    from slmguard.settings import ServeSettings, Tokens


class ServerParts(Protocol):
    """The parts of one server the HTTP layer reads (see the module docstring). Every
    served model's parts are in ``models`` (keyed by its names); ``model``, ``engine``
    and the rest are the primary model's."""

    settings: ServeSettings
    tokens: Tokens
    sessions: SessionService | None
    governor: Governor | None
    metrics: ServeMetrics
    models: ModelTable
    residency: ResidencyManager
    body_limit_bytes: int  # --max-body-bytes, and the room for the images a request may carry
    grammar_bound: bool  # the engine stops a grammar past its work bound

    @property
    def model(self) -> ServedModel: ...

    @property
    def engine(self) -> EngineProcess: ...

    @property
    def queue(self) -> SlotQueue: ...

    @property
    def flights(self) -> Flights: ...

    @property
    def slots(self) -> SlotsView: ...

    @property
    def liveness(self) -> Liveness: ...

    @property
    def bounds(self) -> Bounds: ...

    @property
    def relay(self) -> Relay: ...

    @property
    def dialects(self) -> DialectContext: ...

    @property
    def state(self) -> str:
        """The engine's state, ``degraded`` while it serves with a reason to say so."""

    def degraded_reasons(self) -> dict[str, str]:
        """Why the server serves degraded (``memory``: the governor's reason), if it does."""
