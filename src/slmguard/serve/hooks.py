"""Extension points the memory governor (``slmguard.governor``) plugs into.

Owns the hook types only; the app calls them. See the package docstring for
how they fit together.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AdmissionInfo:
    """What is known about a request before it is queued (its prompt is tokenized)."""

    endpoint: str  # "chat" | "completions"
    model: str
    stream: bool
    max_tokens: int | None  # as requested (None: until the context is full)
    prompt_tokens: int
    n_messages: int


class AdmissionRejected(Exception):
    """Raised by an admission hook to refuse a request (400, 429 or 503)."""

    def __init__(
        self, message: str, *, status: int = 503, code: str = "overloaded",
        retry_after_s: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.retry_after_s = retry_after_s


AdmissionHook = Callable[[AdmissionInfo], Awaitable[None]]
MaxTokensCap = Callable[[AdmissionInfo], int | None]
HealthContributor = Callable[[], dict[str, Any]]
# (prompt_tokens, effective max_tokens) -> a rejection replacing the plain 400, or None.
ContextVerdict = Callable[[int, int | None], AdmissionRejected | None]


@dataclass
class Hooks:
    """Mutable registry filled before the app starts serving."""

    admission: list[AdmissionHook] = field(default_factory=list)
    max_tokens_caps: list[MaxTokensCap] = field(default_factory=list)
    routers: list[Any] = field(default_factory=list)  # fastapi.APIRouter, mounted as-is
    health: list[HealthContributor] = field(default_factory=list)
    # Called when a prompt does not fit the engine's context as it is now.
    context_verdict: ContextVerdict | None = None
