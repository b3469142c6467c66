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
   server's one mapping) or None to admit it; the slot queue comes after.

:class:`~slmguard.governor.runtime.Governor` implements it; the rules it
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


class RequestPolicy(Protocol):
    """The questions the front asks about each generation (see the module docstring)."""

    def max_tokens_cap(self) -> int | None:
        """The cap on ``max_tokens`` in force now (None: none)."""

    def context_verdict(self, request: SizedRequest) -> SlmguardError | None:
        """The answer when the request does not fit one slot now (None: the plain 400)."""

    def admit(self, request: SizedRequest) -> SlmguardError | None:
        """A refusal for this request now, or None to admit it."""


class NoPolicy:
    """``--no-governor``: no cap, no verdict, every request admitted."""

    def max_tokens_cap(self) -> int | None:
        return None

    def context_verdict(self, request: SizedRequest) -> SlmguardError | None:
        return None

    def admit(self, request: SizedRequest) -> SlmguardError | None:
        return None
