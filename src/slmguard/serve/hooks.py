"""Extension points the memory governor (``slmguard.governor``) plugs into.

Owns the hook types only; the app calls them. See the package docstring for
how they fit together.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class AdmissionInfo:
    """What is known about a request before it is queued."""

    endpoint: str  # "chat" | "completions"
    model: str
    stream: bool
    max_tokens: int | None  # as requested (None: until the context is full)
    prompt_chars: int
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


class SessionStore(Protocol):
    """Conversation history kept by the server for ``session_id`` (the governor's store).

    Both methods raise ``slmguard.errors.SessionIdError`` for a malformed id.
    """

    async def session_prompt(
        self, session_id: str, new_messages: list[dict[str, str]]
    ) -> list[dict[str, str]]: ...

    async def record_turn(
        self,
        session_id: str,
        new_messages: list[dict[str, str]],
        answer: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None: ...


@dataclass
class Hooks:
    """Mutable registry filled before the app starts serving."""

    admission: list[AdmissionHook] = field(default_factory=list)
    max_tokens_caps: list[MaxTokensCap] = field(default_factory=list)
    routers: list[Any] = field(default_factory=list)  # fastapi.APIRouter, mounted as-is
    health: list[HealthContributor] = field(default_factory=list)
    # Chat requests with a session_id go through this store (None: answered 400).
    sessions: SessionStore | None = None
    # Called when the engine refuses a prompt as too long for the context.
    context_verdict: ContextVerdict | None = None
