"""What the front asks about one request: the :class:`RequestPolicy` protocol.

Owns the three questions the front asks of a policy for every generation
(``slmguard.serve.sizing`` the first two, ``slmguard.serve.relay`` the third),
in per-slot tokens (what one request may use of the engine's context), and
:class:`NoPolicy`, the answer of ``--no-governor``:

1. :meth:`~RequestPolicy.max_tokens_cap`: the cap on ``max_tokens`` in force
   now (with ``--max-tokens-cap``, the smaller one wins), asked while the
   request is sized;
2. :meth:`~RequestPolicy.context_verdict`, asked only when the prompt and the
   capped ``max_tokens`` do not fit one slot's context as it is now: an error
   replacing the front's plain 400 ``context_length_exceeded`` (the governor's
   503 ``context_degraded`` while the context is reduced), or None;
3. :meth:`~RequestPolicy.admit`, asked once the request is sized and fits: a
   refusal (an error of :mod:`slmguard.errors`, turned into the envelope by the
   server's one mapping) or None to admit it; the slot queue comes after. A request
   says what it holds in the engine only while it runs
   (:attr:`SizedRequest.transient_bytes`: its images), for the projection.

Over several engines (a board) the questions are asked of each model's own
policy (:meth:`Governor.for_model <slmguard.governor.runtime.Governor.for_model>`: the
one level, that model's context and parking), and one more of the whole:
:meth:`ResidencyPolicy.room_for`, before an on-demand model loads: the idle on-demand
models to evict first, or the refusal (503 naming the memory).

:class:`~slmguard.governor.runtime.Governor` implements both; the rules it
applies are the pure functions of :mod:`slmguard.governor.policy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from slmguard.errors import SlmguardError


@dataclass(frozen=True)
class SizedRequest:
    """A generation as the policy sees it: its tokens in one slot's context."""

    endpoint: str  # "chat" | "completions"
    prompt_tokens: int  # as the engine tokenized it
    max_tokens: int  # what the engine is asked for: requested or the rest of the slot, capped
    n: int = 1  # completions asked for: slots it takes
    stream: bool = False
    #: what the engine holds only while it reads this request (its images read, decoded
    #: and encoded: slmguard.serve.vision), on top of what the plan's parts project
    transient_bytes: int = 0


class RequestPolicy(Protocol):
    """The questions the front asks about each generation (see the module docstring)."""

    def max_tokens_cap(self) -> int | None:
        """The cap on ``max_tokens`` in force now (None: none)."""

    def context_verdict(self, request: SizedRequest) -> SlmguardError | None:
        """The answer when the request does not fit one slot now (None: the plain 400)."""

    def admit(self, request: SizedRequest) -> SlmguardError | None:
        """A refusal for this request now, or None to admit it."""


@dataclass(frozen=True)
class Room:
    """The answer to an on-demand load: the models to evict first (idle, on demand,
    lowest priority first), or the ``refusal`` (None: it fits)."""

    evict: tuple[str, ...] = ()
    refusal: SlmguardError | None = None


class ResidencyPolicy(Protocol):
    """What the front asks before loading an on-demand model."""

    def room_for(self, name: str) -> Room:
        """Whether the model ``name`` may load now, and what to evict first."""


class NoPolicy:
    """``--no-governor``: no cap, no verdict, every request admitted, every on-demand
    model loaded without a memory check."""

    def room_for(self, name: str) -> Room:
        return Room()

    def max_tokens_cap(self) -> int | None:
        return None

    def context_verdict(self, request: SizedRequest) -> SlmguardError | None:
        return None

    def admit(self, request: SizedRequest) -> SlmguardError | None:
        return None
