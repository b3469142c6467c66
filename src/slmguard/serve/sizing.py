"""The one ``max_tokens`` decision: how much of one slot a generation may take.

Owns :class:`Sizing`: a prompt's token count (the engine's) and the requested
``max_tokens`` made the request the engine will run (:meth:`Sizing.size`):
the requested ``max_tokens``, or the default (``--default-max-tokens``, a
quarter of the slot up to 512) within the rest of the slot, under the smaller
of the policy's cap and ``--max-tokens-cap``; prompt + max_tokens must fit one
slot's context, else 400 ``context_length_exceeded`` unless the policy's
context verdict says otherwise (the governor's 503 while the context is
shrunk). Also the choices one request may ask (``n``, at most the slots), the
messages it may send (fewer than the slot's tokens) and its prompts' tokens in
all (at most what the slots hold at once).
Pure: it reads the engine's settings and the slot count through the getters it
is given and asks the policy; it sends nothing to the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slmguard.errors import RequestError, RequestTooLargeError, SlmguardError
from slmguard.governor.request import RequestPolicy, SizedRequest
from slmguard.settings import derived_max_tokens

if TYPE_CHECKING:
    from slmguard.plan.schema import EngineSettings


@dataclass(frozen=True)
class TokenLimits:
    """The operator's bounds on ``max_tokens``.

    ``cap`` is ``--max-tokens-cap`` (the policy's cap comes on top); ``default`` bounds
    a request that gives none (None: the rest of the slot).
    """

    cap: int | None = None
    default: int | None = None


class Sizing:
    """The sizing of one engine's generations (see the module docstring).

    ``settings`` gives the engine's settings as they are now (the governor may shrink
    the context), ``slots`` the slot queue's slots now.
    """

    def __init__(
        self,
        policy: RequestPolicy,
        limits: TokenLimits,
        *,
        settings: Callable[[], EngineSettings],
        slots: Callable[[], int],
    ) -> None:
        self.policy = policy
        self.limits = limits
        self.settings = settings
        self.slots = slots

    @property
    def slot_tokens(self) -> int:
        """One slot's context now."""
        return self.settings().n_ctx_slot

    def size(
        self, endpoint: str, prompt_tokens: int, requested: int | None, *, n: int, stream: bool,
        transient_bytes: int = 0,
    ) -> SizedRequest:  # fmt: skip
        """The request as the engine will run it: ``max_tokens`` is the requested one (or
        the default, within the rest of the slot) under the smaller cap, and prompt +
        max_tokens fit one slot. ``prompt_tokens`` counts its images' tokens;
        ``transient_bytes`` is what they hold in the engine while it reads them."""
        room = self.slot_tokens - prompt_tokens
        caps = [c for c in (self.policy.max_tokens_cap(), self.limits.cap) if c is not None]
        wanted = requested if requested is not None else room
        if requested is None and self.limits.default is not None:
            wanted = min(room, self.limits.default)
        if caps:
            wanted = min(wanted, max(1, min(caps)))
        sized = SizedRequest(endpoint, prompt_tokens, wanted, n=n, stream=stream,
                             transient_bytes=transient_bytes)  # fmt: skip
        if prompt_tokens == 0 or not self.fits(prompt_tokens, wanted):
            raise self.context_error(sized)
        return sized

    def context_error(self, sized: SizedRequest) -> SlmguardError:
        """A request that does not fit one slot: the policy's verdict, else a plain 400."""
        verdict = self.policy.context_verdict(sized)
        if verdict is not None:
            return verdict
        more = max(0, sized.max_tokens)
        return RequestTooLargeError(
            f"this model's context is {self.slot_tokens} tokens per request; the "
            f"prompt has {sized.prompt_tokens} tokens and {more} more were requested for the "
            "completion",
            param="messages" if sized.endpoint == "chat" else "prompt",
        )

    def check_parts(self, endpoint: str, parts: int, param: str) -> None:
        """Refuse, before the engine renders them, more messages (or items) than one slot
        holds tokens: each the template renders takes at least one token of the prompt, and
        rendering and counting thousands of them kept the engine busy past the stall time
        (a retryable 503). The policy's verdict first, as for any prompt too
        long (the governor's 503 while it has shrunk the context)."""
        if parts < self.slot_tokens:
            return
        verdict = self.policy.context_verdict(SizedRequest(endpoint, parts, 1))
        if verdict is not None:
            raise verdict
        raise RequestTooLargeError(
            f"{param}: {parts} of them, each at least one token of the prompt; this model's "
            f"context is {self.slot_tokens} tokens per request", param=param,
        )  # fmt: skip

    def check_total(self, prompt_tokens: int, param: str) -> None:
        """Refuse a request whose prompts together (every task's: several prompts, ``n``
        choices each) hold more tokens than the engine's slots do at once: many prompts,
        each fitting a slot, queued in the engine behind everyone else's requests."""
        room = self.slot_tokens * self.slots()
        if prompt_tokens > room:
            raise RequestTooLargeError(
                f"{param}: {prompt_tokens} prompt tokens in all (each prompt once per choice); "
                f"this server's slots hold {room} at once ({self.slots()} x "
                f"{self.slot_tokens})", param=param,
            )  # fmt: skip

    def fits(self, prompt_tokens: int, wanted: int) -> bool:
        """Whether a prompt and ``wanted`` more tokens fit one slot."""
        return wanted > 0 and prompt_tokens + wanted <= self.slot_tokens

    def answer_room(self, requested: int | None) -> int:
        """The tokens an answer is to have room for: the requested ones, or (a session too
        long for the slot keeps room for it) the default answer's."""
        if requested is not None:
            return requested
        return self.limits.default or derived_max_tokens(self.slot_tokens)

    def check_n(self, n: int | None) -> int:
        """The choices asked (``n``, 1 when not given): at most one per slot, else 400."""
        n = n or 1
        slots = self.slots()
        if n > slots:
            raise RequestError(
                f"n={n}: this server runs {slots} slot(s), so at most "
                f"{slots} completions per request", code="invalid_value", param="n",
            )  # fmt: skip
        return n
