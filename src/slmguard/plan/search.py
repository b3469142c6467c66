"""The largest-context search: the one bisection the planner and the re-budget share.

Owns which contexts per slot are tried (multiples of :data:`CTX_STEP` from the model's
trained length down to :data:`MIN_CTX`, :func:`contexts`) and the search for the
largest that fits (:func:`largest`): memory grows with the context, so a bisection
finds it. What "fits" means is the caller's (the planner's rules at its choices, a
plan's limits at serve's flags); this module imports neither the planner nor the
budget, only the cell padding it steps by.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from slmguard.plan.modelfacts import ModelFacts

T = TypeVar("T")

MIN_CTX = 512  # the smallest context per slot planned for
CTX_STEP = 256  # llama.cpp pads the cells to 256 (allocation.CELL_PAD)
#: The context per slot planned for when the header gives no trained length.
UNKNOWN_TRAINED_CTX = 32_768


def top_ctx(facts: ModelFacts) -> int:
    """The largest context per slot planned for: the trained length in 256s (32768 when
    the header gives none), at least :data:`MIN_CTX`."""
    top = facts.n_ctx_train if facts.n_ctx_train > 0 else UNKNOWN_TRAINED_CTX
    return max(MIN_CTX, top // CTX_STEP * CTX_STEP)


def contexts(top: int) -> list[int]:
    """The contexts per slot tried, largest first: ``top`` down to :data:`MIN_CTX` in 256s."""
    return list(range(top, MIN_CTX - 1, -CTX_STEP))


def largest(top: int, attempt: Callable[[int], T | None]) -> T | None:
    """The result of ``attempt(ctx)`` for the largest context per slot (of
    :func:`contexts`) at which it gives one (not None), or None when none does.

    ``attempt`` must give None above some context and a result at and below it (memory
    grows with the context): the contexts are bisected, not all tried.
    """
    cands = contexts(top)
    lo, hi, best = 0, len(cands) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        found = attempt(cands[mid])
        if found is not None:
            best, hi = found, mid - 1
        else:
            lo = mid + 1
    return best
