"""Extension points the memory governor (``slmguard.governor``) plugs into.

Owns the hook types only; the app calls them. An admission hook refuses a
request by raising an error of :mod:`slmguard.errors`
(:class:`~slmguard.errors.OverloadedError` for "retry later",
:class:`~slmguard.errors.RequestTooLargeError` for "never"); the envelope
table turns it into the HTTP answer. See the package docstring for how they
fit together.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from slmguard.errors import OverloadedError


@dataclass(frozen=True)
class AdmissionInfo:
    """What is known about a request before it is queued (its prompt is tokenized)."""

    endpoint: str  # "chat" | "completions"
    model: str
    stream: bool
    max_tokens: int | None  # as requested (None: until the context is full)
    prompt_tokens: int
    n_messages: int


AdmissionHook = Callable[[AdmissionInfo], Awaitable[None]]
MaxTokensCap = Callable[[AdmissionInfo], int | None]
HealthContributor = Callable[[], dict[str, Any]]
# (prompt_tokens, effective max_tokens) -> a 503 replacing the plain 400, or None.
ContextVerdict = Callable[[int, int | None], OverloadedError | None]


@dataclass
class Hooks:
    """Mutable registry filled before the app starts serving."""

    admission: list[AdmissionHook] = field(default_factory=list)
    max_tokens_caps: list[MaxTokensCap] = field(default_factory=list)
    routers: list[Any] = field(default_factory=list)  # fastapi.APIRouter, mounted as-is
    health: list[HealthContributor] = field(default_factory=list)
    # Called when a prompt does not fit the engine's context as it is now.
    context_verdict: ContextVerdict | None = None
